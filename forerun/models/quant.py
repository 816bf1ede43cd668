"""Quantized weights kept quantized in memory, and the linear modules that multiply them directly (CPU).

Why: decode on the CPU is bound by the bytes of weights streamed per token. The fp32 path widens a Q4_K_M
GGUF to 4 bytes per weight (the 1.5B target: ~6 GB per token); these layouts stream 1 byte (int8) or ~0.56-0.63
bytes (int4) per weight. Measured in docs/quantization.md:

* ``int4`` (default for GGUF files where forerun's C kernel runs: gcc and AVX512-VNNI/BW or AVX2, F16C):
  group-wise (32) asymmetric 4-bit weights. GGUF Q4_K / Q4_1 / Q4_0 blocks map onto it exactly (a Q4_K sub-block
  of 32 weights is ``d*sc * q - dmin*m``, q in 0..15). ``Q4Linear`` multiplies them with forerun/kernels/cpu_q4.c:
  fp16 group scale and offset, 4-row groups read as one stream, int8 activations with one scale per 32 values
  (llama.cpp's recipe), VNNI dot products (AVX2: maddubs + madd, the same integers), batch-invariant (each
  output's operations do not depend on the other rows), at memory speed for 1-4 rows. GGUF matrices with no 4-bit part: see ``INT4_OTHERS`` (default: the 5/6-bit layer
  matrices are re-quantized to int4, the output head and 8-bit matrices are int8). Without the C kernel:
  ``Int4Linear``, torch's ``_weight_int4pack_mm_for_cpu`` with bf16 scales and activations, compute-bound (its
  cost grows ~linearly with the rows) and not batch-invariant.
* ``int8`` (default for GGUF files without the C kernel): per-output-channel symmetric int8 weights, activations
  quantized per row to int8 at run time (W8A8; 7 bits on CPUs without VNNI, see ``int8_activation_range``),
  multiplied by oneDNN's u8 x s8 -> s32 kernel (AVX512-VNNI / AMX; AVX2).
  The integer accumulation is exact and the one float multiply per output does not depend on how many rows are
  in the batch, so a row's result is bit-identical whether it is computed alone (plain decode) or among k + 1
  verify rows (tests/test_quant.py). Lossy versus the GGUF's own dequantization: weights are re-quantized per
  row (from the exact dequantized values), activations per row. On CPUs without VNNI, where oneDNN's product is
  slow, 8-bit linears are ``Q8Linear`` instead: int8 per 32 weights run by the int4 C kernel (``int8_linear``).

The rest of the CPU forward is batch-invariant too (row-wise reference attention, tests/test_batch_invariance.py),
so greedy speculative output equals plain output exactly on both layouts.

Fused matrices (qkv, gate_up) are quantized once over their concatenated rows.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
from torch import nn

QUANTIZE_CHOICES = ("none", "int8", "int4")
GROUP = 32  # int4 group size (a Q4_K sub-block, a Q4_0 / Q4_1 block)
ROW_CHUNK = 8192  # rows re-quantized per pass: no full-size float temporaries for a 150k-row head (peak memory)
# int4 layout: how GGUF matrices with no 4-bit part are held (docs/quantization.md, measured on the 1.5B target):
#   "layers" (default): 5/6-bit ones (Q5_0, Q5_1, Q5_K, Q6_K: a Q4_K_M's half of ffn_down) re-quantized to int4 from
#            their exact dequantized values (Q4Linear), except the output head; 8-bit ones and the head: int8
#   "int8":  all of them int8 (oneDNN per row; Q8Linear per 32 on a CPU without VNNI, see int8_linear)
#   "int4":  all of them re-quantized to int4, the head too
# (environment variable FORERUN_INT4_OTHERS, for benchmarks such as `forerun bench`)
INT4_OTHERS = os.environ.get("FORERUN_INT4_OTHERS", "layers")
# a separate draft model only proposes: its 8-bit GGUF matrices and its head are held as int4 too (faster draft
# steps; measured in docs/quantization.md). FORERUN_DRAFT_INT4_OTHERS=layers keeps the target's policy for drafts.
DRAFT_INT4_OTHERS = os.environ.get("FORERUN_DRAFT_INT4_OTHERS", "int4")
_POLICIES = ("layers", "int8", "int4")


@contextlib.contextmanager
def int4_others(policy: str):
    """Within this block, models loaded in the int4 layout hold their GGUF matrices with no 4-bit part as `policy`
    (see INT4_OTHERS). Loading is single-threaded; the engine wraps its draft model's load in it."""
    global INT4_OTHERS
    if policy not in _POLICIES:
        raise ValueError(f"int4 policy for other matrices must be one of {', '.join(_POLICIES)}, got {policy!r}")
    old, INT4_OTHERS = INT4_OTHERS, policy
    try:
        yield
    finally:
        INT4_OTHERS = old
_REQUANT_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")
_HEAD_TENSORS = ("tensor output.weight", "tensor token_embd.weight")  # GGUF names (loader: GGUFQuantized.where)


def _requantize_to_int4(part) -> bool:
    """Whether the int4 layout re-quantizes this GGUF matrix with no 4-bit part to int4 (see INT4_OTHERS)."""
    if INT4_OTHERS == "int4":
        return True
    if INT4_OTHERS != "layers" or isinstance(part, torch.Tensor):
        return False
    return getattr(part, "type_name", "") in _REQUANT_TYPES and not str(getattr(part, "where", "")).endswith(_HEAD_TENSORS)


def parse_quantize(value: str | None, fmt: str, device: torch.device | str = "cpu") -> str:
    """Resolve a user's ``quantize`` choice for a checkpoint of format ``fmt`` ("gguf" | "safetensors").
    None / "auto": GGUF files stay quantized: int4 where forerun's C kernel runs (gcc, AVX512-VNNI or AVX2; GGUF 4-bit
    blocks kept exactly, see Q4Linear), else int8; on CUDA int4 (CudaQ4Linear, with CudaQ8Linear for the 8-bit
    matrices, models/gguf_cuda.py);
    safetensors checkpoints load as stored ("none")."""
    if value is None or value == "auto":
        if fmt != "gguf":
            return "none"
        if torch.device(device).type == "cuda":
            return "int4"
        from ..kernels import cpu_q4

        return "int4" if cpu_q4.available() else "int8"
    if value not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of auto, {', '.join(QUANTIZE_CHOICES)}; got {value!r}")
    return value


def available(layout: str) -> bool:
    """Whether this torch build has the CPU kernel for a layout."""
    try:
        if layout == "int8":
            return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")
        if layout == "int4":
            return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    except (AttributeError, RuntimeError):
        return False
    return layout == "none"


# ====================================================================== int8 (W8A8, oneDNN)


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (q [N, K] int8 in -127..127, scale [N] float32) with w ~= q * scale[:, None].
    Done in row chunks so a 150k-row head needs no full-size float temporaries (peak memory at load)."""
    n = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    for i in range(0, n, ROW_CHUNK):
        c = w[i:i + ROW_CHUNK].float()
        s = c.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [rows]
        q[i:i + ROW_CHUNK] = torch.round(c / s[:, None]).clamp_(-127, 127)
        scale[i:i + ROW_CHUNK] = s
    return q, scale


def int8_activation_range() -> tuple[int, int]:
    """(largest code, zero point) of Int8Linear's unsigned activations. oneDNN's u8 x s8 kernel is exact on CPUs
    with VNNI (AVX512-VNNI, AVX-VNNI, AMX): codes -127..127 stored as u8 with zero point 128. Without VNNI (AVX2
    only: AMD Zen 1-3, Intel before Cascade Lake) it multiplies with vpmaddubsw, which saturates a pair of u8 x s8
    products at 2^15: 2 * 255 * 127 overflows and the products come out wrong by ~15 % (measured on an AMD EPYC
    Zen 3, tests/test_quant.py). There the activations take 7 bits, -63..63 with zero point 64, so a pair is at
    most 2 * 127 * 127 < 2^15 (what PyTorch's fbgemm calls reduce_range)."""
    from ..kernels.cbuild import cpu_ok

    vnni = any(cpu_ok((f,)) for f in ("avx512_vnni", "avx_vnni", "amx_int8"))
    return (127, 128) if vnni else (63, 64)


class Int8Linear(nn.Module):
    """y = x W^T + b with W as per-row int8 (oneDNN-packed) and x quantized per row at run time (8 bits, or 7
    where the CPU has no VNNI: see int8_activation_range)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        # q: [N, K] int8, scale: [N] float32, bias: [N]
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.packed = torch.ops.onednn.qlinear_prepack(q.contiguous(), None)
        self.register_buffer("w_scale", scale.float().contiguous(), persistent=False)
        self.register_buffer("w_zero", torch.zeros(self.out_features, dtype=torch.int32), persistent=False)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.act_max, self.act_zero = int8_activation_range()

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        q, s = quantize_rows_int8(w)
        return cls(q, s, bias)

    @property
    def weight_bytes(self) -> int:
        return self.out_features * self.in_features + 4 * self.out_features

    def dequantized(self) -> torch.Tensor:  # [N, K] float32 (tests)
        eye = torch.eye(self.in_features)
        q = torch.ops.onednn.qlinear_pointwise(
            (eye * self.act_max + self.act_zero).to(torch.uint8), 1.0, self.act_zero, self.packed, self.w_scale,
            self.w_zero, None, 1.0, 0, torch.float32, "none", [], "")  # [K, N] = act_max * W^T
        return (q / float(self.act_max)).t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features).float()
        s = flat.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30).div_(float(self.act_max))  # [R, 1] per-row scale
        xq = torch.round(flat / s).add_(self.act_zero).to(torch.uint8)  # symmetric codes stored as u8 + zero point
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, self.act_zero, self.packed, self.w_scale, self.w_zero, None,
                                               1.0, 0, torch.float32, "none", [], "")  # [R, N] = sum(q_x q_w) * w_scale
        y = y.mul_(s)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


# ====================================================================== int4 (group-wise, torch int4pack)


def quantize_groups_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (q [N, K] uint8 0..15, scale [N, K/g], offset [N, K/g]) with
    w ~= q * scale + offset per group (asymmetric min/max, like GGUF Q4_1)."""
    n, k = w.shape
    dev = w.device if isinstance(w, torch.Tensor) else "cpu"  # (loader.DequantizedRows: CPU rows)
    q = torch.empty(n, k, dtype=torch.uint8, device=dev)
    scale, lo = torch.empty(n, k // group, device=dev), torch.empty(n, k // group, device=dev)
    for i in range(0, n, ROW_CHUNK):  # row-wise: the same values as one pass
        r = slice(i, i + ROW_CHUNK)
        g = w[r].float().reshape(-1, k // group, group)
        lo[r], hi = g.amin(-1), g.amax(-1)
        scale[r] = ((hi - lo[r]) / 15.0).clamp_min(1e-12)
        q[r] = torch.round((g - lo[r, :, None]) / scale[r, :, None]).clamp_(0, 15).to(torch.uint8).reshape(-1, k)
    return q, scale, lo


class Int4Linear(nn.Module):
    """y = x W^T + b with W as group-wise asymmetric int4 (w = q * scale + offset per 32 weights), bf16 math."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias: torch.Tensor | None = None,
                 group: int = GROUP) -> None:
        # q: [N, K] uint8 0..15, scale / offset: [N, K / group] float32, bias: [N]
        super().__init__()
        self.out_features, self.in_features = q.shape
        if self.in_features % group:
            raise ValueError(f"int4 needs in_features divisible by {group}, got {self.in_features}")
        self.group = group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        # the kernel computes (q - 8) * scale + zero: zero = offset + 8 * scale
        sz = torch.stack([scale.float().t(), (offset.float() + 8 * scale.float()).t()], dim=-1)  # [K/g, N, 2]
        self.register_buffer("scales_zeros", sz.to(torch.bfloat16).contiguous(), persistent=False)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "Int4Linear":
        return cls(*quantize_groups_int4(w), bias=bias)

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2

    def dequantized(self) -> torch.Tensor:  # [N, K] float32, as the kernel sees it (tests)
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scales_zeros).float().t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_zeros).float()
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class Q4Linear(nn.Module):
    """y = x W^T + b with W as group-wise (32) int4 codes, fp16 scale and offset (GGUF Q4_K / Q4_1 / Q4_0 exactly,
    up to the fp16 rounding of the group scale and offset), x quantized to int8 per 32 values at run time, multiplied
    by forerun/kernels/cpu_q4.c (AVX512-VNNI, or AVX2). 5 bits per weight; batch-invariant (each output computed alone)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> None:
        from ..kernels import cpu_q4

        super().__init__()
        self.out_features, self.in_features = q.shape
        # a plain attribute, not a buffer: weight_bytes counts it once, as quantized-linear bytes
        self.packed = cpu_q4.pack_weights(q, scale, offset)  # [ceil(N/4), group bytes] uint8, see cpu_q4.c
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @staticmethod
    def fits(n: int, k: int) -> bool:
        from ..kernels import cpu_q4

        return k % 32 == 0 and cpu_q4.available()

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel()

    def dequantized(self) -> torch.Tensor:  # [N, K] float32 (tests)
        from ..kernels.cpu_q4 import unpack_weights

        n, k = self.out_features, self.in_features
        q, s, o = unpack_weights(self.packed, n, k)
        return (q.view(n, k // 32, 32).float() * s.float()[..., None] + o.float()[..., None]).reshape(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        return self.rows(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def rows(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:  # [M, K] -> [M, N] float32
        """The product of 2-D rows (forward's work without its reshapes; CpuLayerOps.decoder_layers calls it)."""
        from ..kernels.cpu_q4 import q4_matmul

        y = q4_matmul(x, self.packed, self.out_features, threads)
        return y if self.bias is None else y.add_(self.bias)


class Q8Linear(nn.Module):
    """y = x W^T + b with W as int8 per 32 weights (w = q * s, q in -128..127, fp16 s: GGUF Q8_0's layout),
    multiplied by cpu_q4.c's int8 kernel (`q8_gemm`: the int4 product's int8 activations, u8 x s8 pairs by the
    sign trick, exact int32 dot products per group, then s * xs per group in float). 8.5 bits per weight,
    batch-invariant like Q4Linear, the same bits from the AVX2 and AVX-512 builds.

    Why: on CPUs without VNNI, oneDNN's int8 product is slow (the 1.5B's head: 46 ms a token on an AMD Zen 3).
    Until session 38 this class ran the int4 kernel on two nibble planes over a doubled K (10 bits per weight,
    twice the multiply work): the 1.5B's 8-bit head cost ~25 % of a 5-row verify (docs/quantization.md)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        # q: [N, K] int8, scale: [N, K/32] (fp16-representable), bias: [N] or None
        from ..kernels import cpu_q4

        super().__init__()
        self.out_features, self.in_features = q.shape
        self.packed = cpu_q4.pack_q8(q.to(torch.int8), scale)  # a plain attribute, as Q4Linear's
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "Q8Linear":
        """Symmetric int8 per 32 weights from exact values (scale rounded to fp16 first, codes from it)."""
        n, k = w.shape
        q = torch.empty(n, k, dtype=torch.int8)
        scale = torch.empty(n, k // GROUP)
        for i in range(0, n, ROW_CHUNK):
            g = w[i:i + ROW_CHUNK].float().view(-1, k // GROUP, GROUP)
            s = (g.abs().amax(-1) / 127.0).clamp_min_(1e-7).half().float()
            q[i:i + ROW_CHUNK] = torch.round(g / s[..., None]).clamp_(-127, 127).view(-1, k).to(torch.int8)
            scale[i:i + ROW_CHUNK] = s
        return cls(q, scale, bias)

    @staticmethod
    def fits(n: int, k: int) -> bool:
        return Q4Linear.fits(n, k)

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel()

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, K] int8, scale [N, K/32] fp16) as stored (exact row subsets: vocab_subset.py)."""
        from ..kernels.cpu_q4 import unpack_q8

        return unpack_q8(self.packed, self.out_features, self.in_features)

    def dequantized(self) -> torch.Tensor:  # [N, K] float32 (tests)
        q, s = self.codes()
        return (q.float().view(self.out_features, -1, GROUP) * s.float()[..., None]).view(q.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        return self.rows(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def rows(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:  # [M, K] -> [M, N] float32
        from ..kernels.cpu_q4 import q8_matmul

        y = q8_matmul(x, self.packed, self.out_features, threads)
        return y if self.bias is None else y.add_(self.bias)


class Q6KLinear(nn.Module):
    """y = x W^T + b with W from GGUF Q6_K blocks, exactly (w = d * scale_16 * (q - 32), 6.5625 bits a weight), in
    cpu_q4.c's layout for them (`pack_q6k`: the same bytes re-ordered so that a vector lane is a group of 32, as in
    the int8 layout), multiplied by `q6k_gemm`: the int4 product's int8 activations per 32 values, exact int32 dot
    products per 16 weights times their int8 scale, d * xs in float. Batch-invariant like Q4Linear.

    Why: a Q4_K_M file's output head is Q6_K. Held as Q8Linear it was re-quantized (within half an 8-bit step per
    weight) into 8.5 bits a weight; kept exact it streams 23 % fewer bytes a token and its logits are closer to the
    fp32 head's (measured in docs/quantization.md: the 1.5B's head, benchmarks/q6k_head_cpu.py)."""

    def __init__(self, packed: np.ndarray, in_features: int, bias: torch.Tensor | None = None) -> None:
        # packed: [N, K / 256 * 210] uint8 in pack_q6k's layout; bias: [N] or None
        super().__init__()
        from ..kernels.cpu_q4 import Q6K_BLOCK

        if in_features % 256 or packed.ndim != 2 or packed.shape[1] != in_features // 256 * Q6K_BLOCK:
            raise ValueError(f"Q6_K rows {tuple(packed.shape)} do not hold {in_features} weights each")
        self.packed = np.ascontiguousarray(packed, dtype=np.uint8)  # (a plain attribute: not a parameter)
        self.out_features, self.in_features = packed.shape[0], in_features
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def from_blocks(cls, blocks: np.ndarray, in_features: int, bias: torch.Tensor | None = None) -> "Q6KLinear":
        """From GGUF Q6_K blocks [N, K / 256 * 210] as the file stores them."""
        from ..kernels.cpu_q4 import pack_q6k

        return cls(pack_q6k(np.asarray(blocks), ROW_CHUNK), in_features, bias)

    @classmethod
    def from_gguf(cls, part, bias: torch.Tensor | None = None) -> "Q6KLinear":
        return cls.from_blocks(part.data, part.shape[1], bias)

    @staticmethod
    def fits(part) -> bool:
        """A 2-D GGUF Q6_K tensor (rows not permuted) whose rows are whole blocks, and the C kernel here."""
        from ..kernels import cpu_q4

        return (not isinstance(part, torch.Tensor) and getattr(part, "type_name", "") == "Q6_K"
                and not getattr(part, "unpermute_heads", None) and len(part.shape) == 2 and part.shape[1] % 256 == 0
                and getattr(part.data, "ndim", 0) == 2 and cpu_q4.available())

    @property
    def weight_bytes(self) -> int:
        return int(self.packed.nbytes)

    def blocks(self) -> np.ndarray:
        """The GGUF Q6_K blocks, as the file stored them (the layout's inverse)."""
        from ..kernels.cpu_q4 import unpack_q6k

        return unpack_q6k(self.packed)

    def dequantized(self) -> torch.Tensor:  # [N, K] float32, gguf's dequantization (tests, vocabulary subsets)
        from ..kernels.cpu_q4 import unpack_q6k
        from .gguf_embedding import row_dequantizer

        w = np.concatenate([row_dequantizer("Q6_K")(unpack_q6k(self.packed[i:i + ROW_CHUNK]))
                            for i in range(0, self.out_features, ROW_CHUNK)])
        return torch.from_numpy(w.reshape(self.out_features, self.in_features))

    def select_rows(self, ids: torch.Tensor) -> "Q6KLinear":
        """The rows `ids` (their own bytes: exact)."""
        return Q6KLinear(self.packed[ids.cpu().numpy()], self.in_features,
                         None if self.bias is None else self.bias[ids])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        return self.rows(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def rows(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:  # [M, K] -> [M, N] float32
        from ..kernels.cpu_q4 import q6k_matmul

        y = q6k_matmul(x, self.packed, self.out_features, threads)
        return y if self.bias is None else y.add_(self.bias)


# ====================================================================== GGUF blocks -> int4 groups


def gguf_int4_groups(data: np.ndarray, type_name: str, shape: tuple[int, int]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Exact (q [N, K] uint8, scale [N, K/32] f32, offset [N, K/32] f32) of a 4-bit GGUF tensor, with
    w = q * scale + offset, or None for types that are not 4-bit group-of-32 (Q5_0, Q6_K, Q8_0, ...).
    ``data`` is the tensor's raw bytes as gguf's reader gives them; ``shape`` is (N, K) in HF order."""
    n, k = shape
    raw = np.asarray(data).view(np.uint8).reshape(n, -1)
    if type_name == "Q4_K":  # 144-byte blocks of 256: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 qs
        from gguf.quants import Q4_K

        b = raw.reshape(-1, 144)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())  # [B, 8] each
        scale = d * sc.astype(np.float32)  # [B, 8]
        offset = -(dmin * m.astype(np.float32))
        qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(-1, 256)
    elif type_name in ("Q4_0", "Q4_1"):  # 18 / 20-byte blocks of 32: d (, m) f16, 16 qs
        size = 18 if type_name == "Q4_0" else 20
        b = raw.reshape(-1, size)
        scale = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
        offset = (-8 * scale) if type_name == "Q4_0" else b[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = b[:, size - 16:].reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
        q = (qs & 0x0F).reshape(-1, 32)
    else:
        return None
    return (q.reshape(n, k).astype(np.uint8), np.ascontiguousarray(scale.reshape(n, k // GROUP), dtype=np.float32),
            np.ascontiguousarray(offset.reshape(n, k // GROUP), dtype=np.float32))


# ====================================================================== memory report


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by quantized linears, by other parameters/buffers, and in total (deduplicated)."""
    seen, quant, other = set(), 0, 0
    for m in model.modules():
        if hasattr(m, "qw32") or hasattr(m, "qw8"):  # CudaQ4Linear / CudaQ8Linear (quant_cuda.py): their buffers
            packed = getattr(m, "lane_scales", None)  # (a kernel's copy of the scales: held, not streamed)
            quant += m.weight_bytes + (0 if packed is None else packed.numel() * packed.element_size())
            seen.update(t.data_ptr() for t in (getattr(m, "qw32", None), getattr(m, "qw8", None), m.scale,
                                               getattr(m, "zero", None), packed) if t is not None)
        elif isinstance(m, (Int8Linear, Int4Linear, Q4Linear, Q8Linear, Q6KLinear)):
            quant += m.weight_bytes
            for t in (m.bias,):
                if t is not None:
                    other += t.numel() * t.element_size()
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or t.device.type == "meta":
            continue
        seen.add(t.data_ptr())
        other += t.numel() * t.element_size()
    for m in model.modules():  # oneDNN-packed fp32/bf16 weights (PackedLinear) are not parameters; nor are a GGUF
        other += getattr(m, "quantized_bytes", 0)  # embedding's blocks (GGUFEmbedding: mapped from the file)
        packed = getattr(m, "packed", None)
        if packed is not None and not isinstance(m, (Int8Linear, Int4Linear, Q4Linear, Q8Linear, Q6KLinear)) \
                and hasattr(packed, "numel"):
            other += packed.numel() * packed.element_size()
    return {"quantized_linear_bytes": quant, "other_bytes": other, "total_bytes": quant + other}


# ====================================================================== building a layer from checkpoint parts


def _as_float(t) -> torch.Tensor:
    return t.dequantize() if hasattr(t, "dequantize") and not isinstance(t, torch.Tensor) else t.float()


def _float_rows(parts: list):
    """The (possibly fused) matrix as something the re-quantizers slice by rows (w.shape, w[i:j]): one GGUF tensor
    stays in its blocks and is dequantized a chunk of rows at a time (loader.DequantizedRows: a 151,936-row head
    never exists in fp32 at once), anything else is concatenated in fp32."""
    if len(parts) == 1 and not isinstance(parts[0], torch.Tensor) and hasattr(parts[0], "rows"):
        rows = parts[0].rows()
        if rows is not None:
            return rows
    return torch.cat([_as_float(p) for p in parts]) if len(parts) > 1 else _as_float(parts[0])


def _exact_int4(t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Exact int4 groups of a GGUF 4-bit tensor (rows un-permuted like its dequantization), else None."""
    if isinstance(t, torch.Tensor) or not hasattr(t, "type_name"):
        return None
    got = gguf_int4_groups(t.data, t.type_name, tuple(t.shape))
    if got is None:
        return None
    if t.unpermute_heads:
        from .loader import _unpermute_qk

        got = tuple(_unpermute_qk(a, t.unpermute_heads) for a in got)
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in got)


def make_quantized_linear(parts: list, bias: torch.Tensor | None, layout: str) -> nn.Module:
    """One quantized linear from the row blocks of a (possibly fused) matrix. ``parts``: torch tensors
    [n_i, K] or GGUF blocks (loader.GGUFQuantized), concatenated in order; bias: [sum n_i] or None."""
    if layout == "int4":
        exact = [_exact_int4(p) for p in parts]
        from_gguf = any(not isinstance(p, torch.Tensor) for p in parts)
        k, n = parts[0].shape[1], sum(p.shape[0] for p in parts)
        # torch's int4pack needs N % 16 == 0 (odd vocabularies: the head stays int8)
        wanted = (any(e is not None for e in exact) or not from_gguf
                  or (Q4Linear.fits(n, k) and all(_requantize_to_int4(p) for p in parts)))
        if k % GROUP == 0 and (n % 16 == 0 or Q4Linear.fits(n, k)) and wanted:
            groups = [e if e is not None else quantize_groups_int4(_float_rows([p])) for e, p in zip(exact, parts)]
            q, s, o = (torch.cat([g[i] for g in groups]) for i in range(3))
            return Q4Linear(q, s, o, bias) if Q4Linear.fits(n, k) else Int4Linear(q, s, o, bias)
        # a GGUF matrix with no 4-bit part (Q6_K, Q8_0, ...): int8 keeps more of its precision
    if layout in ("int4", "int8"):
        if len(parts) == 1 and Q6KLinear.fits(parts[0]):
            # (a Q4_K_M's head, exact, on every CPU the kernel runs on: with VNNI oneDNN's per-row int8 (Int8Linear)
            # put the 1.5B's logits 16x further from the fp32 head's (KL 1.9e-3 against 1.2e-4; top-1 97.5 against
            # 99.7 %) for 2-5 % of decode speed, session 42, docs/quantization.md)
            return Q6KLinear.from_gguf(parts[0], bias)
        return int8_linear(_float_rows(parts), bias)
    raise ValueError(f"unknown quantized layout {layout!r}")


def int8_linear(w: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """An 8-bit linear for this CPU: oneDNN's W8A8 (Int8Linear) where it has VNNI; without VNNI, where oneDNN's
    product is 3-6x slower (docs/quantization.md, AMD Zen 3) and forerun's int4 kernel runs, int8 per 32 weights
    on that kernel (Q8Linear)."""
    n, k = w.shape
    if int8_activation_range()[0] != 127 and k % GROUP == 0 and Q8Linear.fits(n, k):
        return Q8Linear.from_float(w, bias)
    return Int8Linear.from_float(w, bias)
