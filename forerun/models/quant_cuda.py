"""Weight-only int4 and int8 linears on CUDA (issue 12): GGUF Q4 / Q8_0-style group-wise weights kept quantized
on the GPU.

`CudaQ4Linear` holds a matrix in the word layout of forerun/kernels/quant_gemm.py (int32 words of 8 codes, a
bf16 scale and offset per 32 weights: 5 bits per weight, w = q * scale + zero). Products with at most 16 rows
(decode, verification) run one of the kernels in `KERNELS`, which stream the 4-bit codes once: the tuned table
(`tuned`, q4_configs.json) picks per card, shape and row count (on the H200: 1 row the CUDA C++ kernel of
kernels/q4_cuda.py, 2-16 rows of the layers' products the tensor-core kernel of kernels/q4_mma.py, both compiled
with NVRTC (the head's 2-16-row entries are still Triton's, not yet measured against it); the Triton kernels where
NVRTC cannot run; a shape the table lacks takes the tensor-core kernel from 2 rows). Up to
`CudaQ4Linear.CHUNKED_ROWS` rows run as 16-row calls (32-row calls on the tensor-core kernel); larger ones
(prefill, wide verification at a batch) dequantize the matrix to bf16 in one pass (`q4_cuda.q4c_dequant` where
NVRTC runs, else Triton's `dequantize_int4_w32`, 10x slower) and use cuBLAS. A fused gate/up
matrix also offers `glu(x)`: the SwiGLU in the kernel's epilogue, as FusedLayerOps does for bf16.

`CudaQ8Linear` holds a matrix as 8-bit codes with one scale per 32 weights (GGUF Q8_0: 8.5 bits per weight with
fp16 scales, w = q * scale) in the int8 word layout (int32 words of 4 codes biased by +128); products of up to 8
rows run `q8v_linear` (the same packed-f16 PTX scheme), up to CHUNKED_ROWS rows as 8-row calls, larger ones
dequantize to bf16 and use cuBLAS.

`quantize_model_cuda(model, bits=4)` replaces every decoder linear (and the head) of a bf16 model on the GPU by
its int4 form, quantized with min/max per group of 32 (the GGUF Q4_1 recipe), or (bits=8) by its int8 form
(symmetric per group of 32, the Q8_0 recipe). Kernel configurations come from forerun/kernels/q4_configs.json
(written by benchmarks/quant_decode_gpu.py) per card and shape, else a default.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ..kernels.quant_gemm import (GROUP, MAX_ROWS, Q8_MAX_ROWS, dequantize_int4_w32, dequantize_int8_w32,
                                  pack_int4_w32, pack_int8_w32, q4r_linear, q4t_linear, q4v_linear, q4w2_linear,
                                  q4w_linear, q8v_linear, unpack_int4_w32, unpack_int8_w32)
from ..kernels.q4_cuda import available as q4c_available, dequant_available, q4c_add_linear, q4c_dequant, \
    q4c_linear, q4c_norm_linear, q4c_split_norm_linear, q8c_dequant
from ..kernels.q4_mma import MAX_ROWS as Q4M_MAX_ROWS, SUPER as Q4M_SUPER, available as q4m_available, \
    default_warps as q4m_default_warps, fits as q4m_fits, packed_scales as q4m_packed_scales, q4m_linear
from .quant import quantize_groups_int4



def _q4c(x, qw32, scale, zero, glu, block_n, block_k, use_dot, num_warps, num_stages):
    """The CUDA C++ decode kernel under the Triton kernels' configuration names: block_n = output rows per warp,
    num_stages = groups of weights in flight per lane; it walks the whole of K (block_k, use_dot unused)."""
    return q4c_linear(x, qw32, scale, zero, glu=glu, rows=block_n, warps=num_warps, depth=num_stages)


def _q4m(x, qw32, scale, zero, glu, block_n, block_k, use_dot, num_warps, num_stages, packed=None, x_staged=False):
    """The tensor-core kernel of kernels/q4_mma.py (1-32 rows) under the same names: num_warps per block splitting
    K, num_stages superblocks of weights in flight per lane (block_n, block_k, use_dot unused); packed: its copy of
    the scales and offsets (q4_mma.packed_scales), or None; x_staged: activations through shared memory."""
    return q4m_linear(x, qw32, scale, zero, glu=glu, warps=num_warps, depth=num_stages, packed=packed,
                      staged=x_staged)


KERNELS = {"w": q4w_linear, "w2": q4w2_linear, "v": q4v_linear,  # v: 1-2 bf16 rows, packed f16 (decode)
           "r": q4r_linear,  # r: 1-8 bf16 rows, packed f16, one unpacking per 4 rows (short verification)
           "t": q4t_linear,  # t: 1-16 bf16 rows, bf16 dequantization + tensor cores (verification)
           "c": _q4c,  # c: 1 bf16 row, CUDA C++ through NVRTC (kernels/q4_cuda.py; decode), where it compiles
           "m": _q4m}  # m: 1-32 bf16 rows, CUDA C++ tensor cores through NVRTC (kernels/q4_mma.py; verification)
# the NVRTC kernels' availability (tuned entries naming them fall back where they cannot run)
NVRTC_KERNELS = {"c": lambda: q4c_available(), "m": lambda: q4m_available()}
MAX_KERNEL_ROWS = {"v": 2, "r": 8, "c": 1}  # the others take up to MAX_ROWS

CONFIGS = Path(__file__).resolve().parent.parent / "kernels" / "q4_configs.json"
_tables: dict[str, dict] = {}
_card: list[str] = []


def save_configs(name: str, entries: dict[str, dict]) -> None:
    """Write tuned entries (config_key -> config, replacing whole entries) for card `name` into CONFIGS, the rest of
    the file as it is (the tuning benchmarks' --write)."""
    table = json.loads(CONFIGS.read_text())
    table.setdefault(name, {}).update(entries)
    CONFIGS.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def config_key(m: int, n: int, k: int, glu: bool, bits: int = 4) -> str:
    return f"{'q8_' if bits == 8 else ''}m{m}_n{n}_k{k}{'_glu' if glu else ''}"


def default_config(m: int, bits: int = 4) -> dict:
    if bits == 8:
        return dict(kernel="q8v", block_n=4, block_k=1024, use_dot=False, num_warps=4, num_stages=2)
    return dict(kernel="t", block_n=64, block_k=256, use_dot=True, num_warps=4, num_stages=3) if m > 2 else \
        dict(kernel="v", block_n=8, block_k=4096, use_dot=False, num_warps=4, num_stages=2)


def default_c_config(n: int, k: int, glu: bool) -> dict:
    """The 1-row CUDA C++ kernel's configuration for a shape or card the table lacks: what won most often where it
    was tuned (q4_cuda_gpu.py on the H200 and the H100, 8B and 0.6B shapes): 16 warps; two rows a warp for plain
    matrices up to 8192 x 4096, one for SwiGLU pairs and longer or wider ones; more groups in flight past K = 4096.
    On the H100 with its table hidden the 8B decode step ran 2.065 ms with these against 2.235 with Triton's
    default (q4_cuda_defaults_s49.json), whose products alone took 1.03-1.19x the tuned winners' time."""
    rows = 1 if glu or n > 8192 or k > 4096 else 2
    return dict(kernel="c", block_n=rows, block_k=k, use_dot=False, num_warps=16, num_stages=4 if k > 4096 else 2)


def set_configs(name: str, table: dict) -> None:
    """Use this table (config_key -> config) for card `name` from now on (the tuning benchmark)."""
    _tables[name] = table


def tuned(m: int, n: int, k: int, glu: bool, bits: int = 4) -> dict:
    if not _card:
        _card.append(torch.cuda.get_device_name() if torch.cuda.is_available() else "")
    name = _card[0]
    if name not in _tables:
        try:
            _tables[name] = json.loads(CONFIGS.read_text()).get(name, {})
        except (OSError, ValueError):
            _tables[name] = {}
    table = _tables[name]
    key = config_key(m, n, k, glu, bits)
    got = table.get(key)
    for m2 in range(m + 1, (Q8_MAX_ROWS if bits == 8 else MAX_ROWS) + 1):  # an untuned row count: the next tuned
        if got is not None:  # one above (its tiles hold m rows)
            break
        key = config_key(m2, n, k, glu, bits)
        got = table.get(key)
        if got is not None and m > MAX_KERNEL_ROWS.get(got["kernel"], MAX_ROWS):
            got = None  # a kernel tuned for fewer rows than m
    if got is None and bits == 4 and m > MAX_ROWS:  # 17-32 rows: only the tensor-core kernel takes them (as
        got = table.get(config_key(MAX_ROWS, n, k, glu))  # CudaQ4Linear._product calls it), tuned as for 16
        if got is not None and got["kernel"] != "m":
            got = None
    if got and got["kernel"] in NVRTC_KERNELS and not (  # tuned where NVRTC ran, not here: Triton serves
            NVRTC_KERNELS[got["kernel"]]() and (got["kernel"] != "m" or q4m_fits(m, n, k))):
        got = table.get("triton_" + key)  # (the Triton winner kept beside the entry found)
    if got:
        cfg = {key: got[key] for key in ("kernel", "block_n", "block_k", "use_dot", "num_warps", "num_stages")}
        for opt in ("lane_scales", "x_staged"):  # the tensor-core kernel's options, where the entry has them
            if got["kernel"] == "m" and opt in got:  # (the tuner tries both ways; absent: lane scales read, direct
                cfg[opt] = got[opt]  # activation loads)
        return cfg
    if bits == 4 and m == 1 and NVRTC_KERNELS["c"]():  # an untuned shape or card: the CUDA C++ kernel
        return default_c_config(n, k, glu)
    if bits == 4 and m >= 2 and q4m_fits(m, n, k) and NVRTC_KERNELS["m"]():  # an untuned shape (a draft model's):
        # the tensor-core kernel beat every tuned Triton entry at 2-16 rows on the 8B shapes (q4_mma_h200.json)
        return dict(kernel="m", block_n=16, block_k=k, use_dot=True, num_warps=q4m_default_warps(k), num_stages=4)
    return default_config(m, bits)


def q4_product(x: torch.Tensor, qw32, scale, zero, glu: bool, cfg: dict, packed=None) -> torch.Tensor:
    """x @ W^T through the kernel cfg names; packed: the tensor-core kernel's copy of the scales and offsets
    (CudaQ4Linear.lane_scales), used by that kernel only, unless its entry says ``lane_scales: false``; an entry's
    ``x_staged: true`` stages that kernel's activations through shared memory (q4_mma.q4m_linear)."""
    cfg = dict(cfg)
    k = x.shape[-1]
    while k % cfg["block_k"]:  # K steps must divide K (and stay powers of two): 896 -> 128, 1536 -> 512
        cfg["block_k"] //= 2
    kernel = cfg.pop("kernel")
    lane_scales, x_staged = cfg.pop("lane_scales", True), cfg.pop("x_staged", False)
    if kernel == "m":
        cfg.update(packed=packed if lane_scales else None, x_staged=x_staged)
    return KERNELS[kernel](x, qw32, scale, zero, glu=glu, **cfg)


class CudaQuantLinear(nn.Module):
    """What CudaQ4Linear and CudaQ8Linear share: products through their kernels where `_kernel_ok`, else the
    dequantized matrix and torch; `glu` for a fused gate/up matrix. Subclasses give `dequantized()`,
    `_kernel_ok(x)` and `_product(x, glu)` (x [M, K] -> [M, N or N/2])."""

    # Products of up to this many rows run as kernel calls; more (prefill) dequantize the matrix once and multiply
    # with cuBLAS. On the H200 (8B shape, benchmarks/pdl_gpu.py) a forward of 20 rows cost 169 ms with the torch
    # int4 dequantization and 64 ms with the one-pass kernel, against ~13 ms per 16 rows in the kernels.
    CHUNKED_ROWS = 64
    K_MULTIPLE = 64  # the widths the kernels' K steps divide (powers of two from K_MULTIPLE up)

    def _kernel_ok(self, x: torch.Tensor) -> bool:
        """The Triton kernels take x [M, K]: CUDA, 1..CHUNKED_ROWS contiguous bf16 rows (their activations), K a
        multiple of K_MULTIPLE (every GGUF model's widths, e.g. 576, 896, 1536, 4864, 8960). Anything else (a
        float32 EAGLE input, a CPU tensor) multiplies the dequantized matrix."""
        return x.is_cuda and 1 <= x.shape[0] <= self.CHUNKED_ROWS and x.dtype == torch.bfloat16 \
            and self.dtype == torch.bfloat16 and x.stride(-1) == 1 and x.stride(0) % 2 == 0 \
            and self.in_features % self.K_MULTIPLE == 0

    def _cuda_pass(self, codes: torch.Tensor) -> bool:
        """Whether dequantized() takes the CUDA C++ pass of kernels/q4_cuda.py (the same values as Triton's, ~8x
        its speed on the H200: benchmarks/q4_wide_gpu.py): bf16 weights on a device it runs on, unless
        FORERUN_Q4_DEQUANT=triton."""
        return codes.is_cuda and self.dtype == torch.bfloat16 and dequant_available(codes) \
            and os.environ.get("FORERUN_Q4_DEQUANT", "cuda") != "triton"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self._kernel_ok(x2):
            y = self._product(x2, False)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = nn.functional.linear(x2, self.dequantized().to(x2.dtype),
                                     None if self.bias is None else self.bias.to(x2.dtype))
        return y.reshape(*shape[:-1], self.out_features)

    def glu(self, x: torch.Tensor) -> torch.Tensor:
        """This matrix as gate rows then up rows: silu(x @ gate^T) * (x @ up^T), [T, N/2]."""
        if self.bias is None and self._kernel_ok(x):
            return self._product(x, True)
        g, u = self(x).chunk(2, dim=-1)
        return nn.functional.silu(g) * u


class CudaQ4Linear(CudaQuantLinear):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        """q: [N, K] codes 0..15; scale, zero: [N, K/32] (w = q * scale + zero); bias [N] or None."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("qw32", pack_int4_w32(q))
        self.register_buffer("scale", scale.to(dtype).contiguous())
        self.register_buffer("zero", zero.to(dtype).contiguous())
        # the tensor-core kernel's own copy of the scales and offsets (q4_mma.packed_scales): built where that kernel
        # can run (a CUDA device with NVRTC, FORERUN_Q4_MMA not 0), +20 % memory over qw32 / scale / zero, not read
        # by any other kernel; not saved in the state dict (it is derived)
        packed = None
        if self.scale.is_cuda and q4m_available(self.scale) and self.in_features % Q4M_SUPER == 0:
            packed = q4m_packed_scales(self.scale, self.zero)
        self.register_buffer("lane_scales", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.dtype = dtype

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "CudaQ4Linear":
        q, s, z = quantize_groups_int4(w)  # the GGUF Q4_1 recipe, as the CPU layouts quantize
        return cls(q, s, z, bias, w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qw32, self.scale, self.zero))

    def dequantized(self) -> torch.Tensor:  # [N, K] in self.dtype (products of more than CHUNKED_ROWS rows)
        if not self.qw32.is_cuda:
            return self.dequantized_reference()
        if self._cuda_pass(self.qw32):
            return q4c_dequant(self.qw32, self.scale, self.zero)
        return dequantize_int4_w32(self.qw32, self.scale, self.zero, self.dtype)  # (Triton's one pass)

    def dequantized_reference(self) -> torch.Tensor:  # [N, K] in self.dtype, torch ops (rounded twice)
        n = self.qw32.shape[0]
        q = unpack_int4_w32(self.qw32).reshape(n, -1, GROUP).to(self.dtype)
        return (q * self.scale[..., None] + self.zero[..., None]).reshape(n, -1)

    def _c_config(self, x: torch.Tensor, glu: bool) -> dict | None:
        """This shape's 1-row configuration where it names the CUDA C++ kernel and x is one row it takes, else None."""
        if x.shape[0] != 1 or self.bias is not None or not self._kernel_ok(x) or not x.is_contiguous():
            return None
        cfg = tuned(1, self.out_features // 2 if glu else self.out_features, self.in_features, glu)
        return cfg if cfg["kernel"] == "c" else None

    def norm_product(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     glu: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rmsnorm(x + residual) * norm_weight @ W^T (glu: SwiGLU of the gate and up halves), x + residual) in one
        launch, for one row where this shape's tuned kernel is the CUDA C++ one; None elsewhere (the caller runs
        add + RMSNorm and the product apart)."""
        cfg = self._c_config(x, glu)
        if cfg is None or norm_weight.dtype != x.dtype or (residual is not None and not residual.is_contiguous()):
            return None
        return q4c_norm_linear(x, residual, norm_weight, eps, self.qw32, self.scale, self.zero, glu=glu,
                               rows=cfg["block_n"], warps=cfg["num_warps"], depth=cfg["num_stages"])

    def add_product(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x @ W^T + residual, its partial sums of squares) in one launch (kernels/q4_cuda.q4c_add_linear), for
        one row where this shape's kernel is the CUDA C++ one; None elsewhere (the caller adds apart)."""
        cfg = self._c_config(x, False)
        if cfg is None or residual.dtype != x.dtype or residual.shape != (1, self.out_features):
            return None
        return q4c_add_linear(x, residual, self.qw32, self.scale, self.zero, rows=cfg["block_n"],
                              warps=cfg["num_warps"], depth=cfg["num_stages"])

    SPLIT_MAX_BLOCKS_PER_SM = 8  # split_norm_product: launches of more blocks (the head's) keep the norm kernel

    def split_norm_product(self, s: torch.Tensor, partials: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           glu: bool = False) -> torch.Tensor | None:
        """rmsnorm(s) * norm_weight @ W^T (glu: SwiGLU) with the sums of squares an `add_product` left
        (kernels/q4_cuda.q4c_split_norm_linear); None where this shape's kernel is not the CUDA C++ one, or where
        its launch has more than SPLIT_MAX_BLOCKS_PER_SM blocks per SM: every block pays the prologue's wait for
        the partial sums, and the head's ~70 blocks an SM measured 8 us slower than the norm kernel before it
        (benchmarks/q4_split_norm_gpu.py, H100 and H200)."""
        cfg = self._c_config(s, glu)
        if cfg is None or norm_weight.dtype != s.dtype:
            return None
        n = self.out_features // 2 if glu else self.out_features
        blocks = -(-n // (cfg["block_n"] * cfg["num_warps"]))
        if blocks > self.SPLIT_MAX_BLOCKS_PER_SM * torch.cuda.get_device_properties(s.device).multi_processor_count:
            return None
        return q4c_split_norm_linear(s, partials, norm_weight, eps, self.qw32, self.scale, self.zero, glu=glu,
                                     rows=cfg["block_n"], warps=cfg["num_warps"], depth=cfg["num_stages"])

    def _product(self, x: torch.Tensor, glu: bool) -> torch.Tensor:
        """x [M, K] through the kernels, 16 rows per call (32 where the tensor-core kernel takes more than 16)."""
        n = self.out_features // 2 if glu else self.out_features
        step = MAX_ROWS
        if x.shape[0] > MAX_ROWS and q4m_fits(Q4M_MAX_ROWS, n, self.in_features) and NVRTC_KERNELS["m"]():
            step = Q4M_MAX_ROWS
        parts = []
        for at in range(0, x.shape[0], step):
            xs = x[at: at + step]
            parts.append(q4_product(xs, self.qw32, self.scale, self.zero, glu,
                                    tuned(xs.shape[0], n, self.in_features, glu), self.lane_scales))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def q8_product(x: torch.Tensor, qw8, scale, glu: bool, cfg: dict) -> torch.Tensor:
    cfg = dict(cfg)
    k = x.shape[-1]
    while k % cfg["block_k"]:  # K steps must divide K (and stay powers of two of at least one group)
        cfg["block_k"] //= 2
    cfg.pop("kernel")
    cfg.pop("use_dot", None)
    return q8v_linear(x, qw8, scale, glu=glu, **cfg)


def quantize_int8_groups(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int8, scale [N, K/32] in scale_dtype): symmetric per group of 32 (the Q8_0 recipe),
    the codes rounded against the stored (rounded) scale, so the error is at most half a step of it."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    s = (g.abs().amax(-1) / 127).clamp_min(1e-30).to(scale_dtype)
    q = torch.round(g / s.float()[..., None]).clamp_(-128, 127).to(torch.int8).reshape(n, k)
    return q, s


class CudaQ8Linear(CudaQuantLinear):
    """8-bit codes with one scale per 32 weights (GGUF Q8_0), w = q * scale, kept 8-bit on the GPU (module doc)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16, scale_dtype: torch.dtype | None = None) -> None:
        """q: [N, K] codes -128..127; scale: [N, K/32], stored as scale_dtype (default: dtype; GGUF Q8_0 keeps its
        fp16 scales exactly with torch.float16); bias [N] or None; dtype: the activations'."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("qw8", pack_int8_w32(q))
        self.register_buffer("scale", scale.to(scale_dtype or dtype).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.dtype = dtype

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "CudaQ8Linear":
        dtype = w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        q, s = quantize_int8_groups(w, dtype)
        return cls(q, s, bias, dtype)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qw8, self.scale))

    def codes(self) -> torch.Tensor:  # [N, K] int8
        return unpack_int8_w32(self.qw8)

    def dequantized(self) -> torch.Tensor:  # [N, K] in self.dtype, rounded once
        if self._cuda_pass(self.qw8):
            return q8c_dequant(self.qw8, self.scale)
        return dequantize_int8_w32(self.qw8, self.scale, self.dtype)

    K_MULTIPLE = GROUP  # q8v's K steps go down to one group of 32

    def _product(self, x: torch.Tensor, glu: bool) -> torch.Tensor:
        """x [M, K] through the kernel, 8 rows per call."""
        n = self.out_features // 2 if glu else self.out_features
        parts = []
        for at in range(0, x.shape[0], Q8_MAX_ROWS):
            xs = x[at: at + Q8_MAX_ROWS]
            parts.append(q8_product(xs, self.qw8, self.scale, glu, tuned(xs.shape[0], n, self.in_features, glu, 8)))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def quantize_model_cuda(model: nn.Module, head: bool = True, bits: int = 4) -> int:
    """Replace the nn.Linear layers of a model on the GPU by CudaQ4Linear (bits=4) or CudaQ8Linear (bits=8) (the
    head too unless head=False, or when it is tied to the embedding). Returns the number replaced. Frees the bf16
    weights as it goes."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    targets = []
    for name, mod in model.named_modules():
        for child_name, child in mod.named_children():
            if isinstance(child, nn.Linear) and child.in_features % GROUP == 0:
                full = f"{name}.{child_name}" if name else child_name
                if full.endswith("lm_head") and (not head or tied):
                    continue
                targets.append((mod, child_name, child))
    for mod, child_name, child in targets:
        cls = CudaQ8Linear if bits == 8 else CudaQ4Linear
        q = cls.from_float(child.weight.data, None if child.bias is None else child.bias.data)
        setattr(mod, child_name, q)
        del child
    torch.cuda.empty_cache()
    return len(targets)
