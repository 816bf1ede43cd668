"""GGUF (and safetensors) checkpoints loaded onto CUDA with their linear weights kept quantized (issue 12, item 3).

``load_model(path, "cuda", torch.bfloat16, quantize="auto")`` on a GGUF file (or ``quantize="int4"`` on any
checkpoint) builds every decoder linear straight from the checkpoint into a `CudaQ4Linear` or `CudaQ8Linear`
(word layouts, Triton products for short row counts, forerun/models/quant_cuda.py). The rules of the "int4"
layout are the CPU int4 layout's (quant.py: `make_quantized_linear`), with `CudaQ8Linear` where the CPU keeps
int8:

* GGUF Q4_K / Q4_1 / Q4_0 matrices map exactly onto the 32-weight groups (`quant.gguf_int4_groups`): codes
  copied, group scale ``d*sc`` and offset ``-dmin*m`` computed exactly in fp32 from the block, then stored in the
  model dtype (bf16: the only loss, <= 2^-9 relative per scale / offset). No fp32 copy of the matrix is made.
* Q6_K / Q5_K / Q5_0 / Q5_1 layer matrices (``INT4_OTHERS="layers"``, the default): dequantized exactly, one matrix
  at a time, and re-quantized to int4 min/max groups of 32 (`quant.quantize_groups_int4`; error <= half an int4
  step of the group's range). A fused matrix with a 4-bit part re-quantizes its other parts the same way.
* Q8_0 matrices, and the output head when it is not 4-bit (Q6_K / Q8_0 in Q4_K_M files): `CudaQ8Linear`. Q8_0
  exactly (codes and fp16 scales copied, `gguf_q8_0_groups`); other types dequantized exactly and re-quantized to
  symmetric int8 groups of 32 (error <= half a step of the group's max / 127, the scale stored in the model
  dtype). A tied head stays tied to the (bf16) embedding, no copy. ``FORERUN_INT4_OTHERS=int4`` re-quantizes
  those to int4 too, ``=int8`` keeps the 5/6-bit layer matrices 8-bit as well.
* ``quantize="int8"`` (any checkpoint): every linear `CudaQ8Linear` (the head too, tied or not, as on the CPU);
  Q8_0 exactly, everything else re-quantized as above.
* safetensors with ``quantize="int4"``: every linear re-quantized to int4 groups (the head too, as on the CPU).
* norms and the embedding: the model dtype.

`registry.build_cuda_quantized_model(ckpt, device, dtype, layout)` builds a model of these modules; it takes any
device, so the CPU tests build the same modules (their forward on CPU tensors is ``dequantized()`` + linear).
"""
from __future__ import annotations

import torch
from torch import nn

import numpy as np

from .quant import GROUP, _as_float, _exact_int4, _requantize_to_int4, quantize_groups_int4

CUDA_DTYPES = (torch.bfloat16,)  # the kernels' activations (q4v / q4r / q4t / q8v take bf16 rows)
CUDA_LAYOUTS = ("int4", "int8")


def check_cuda_layout(layout: str, device: torch.device | str, dtype: torch.dtype) -> None:
    """One-line ValueError for a quantized layout this device cannot run."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"quantize={layout!r} runs on cpu and cuda only (got device {dev})")
    if layout not in CUDA_LAYOUTS:
        raise ValueError(f"quantize={layout!r} has no CUDA layout; on cuda use 'int4' (or 'auto' for GGUF files), "
                         f"'int8' or 'none' (bf16)")
    if dtype not in CUDA_DTYPES:
        raise ValueError(f"quantize={layout!r} on cuda multiplies bfloat16 activations; got dtype {dtype} "
                         f"(pass dtype=torch.bfloat16 or quantize='none')")


def gguf_q8_0_groups(t) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Exact (q [N, K] int8, scale [N, K/32] float16) of a GGUF Q8_0 tensor (34-byte blocks of 32: an fp16 scale,
    32 int8 codes; w = q * scale), rows un-permuted like its dequantization; None for other types."""
    if isinstance(t, torch.Tensor) or getattr(t, "type_name", None) != "Q8_0":
        return None
    n, k = t.shape
    b = np.asarray(t.data).view(np.uint8).reshape(-1, 34)
    scale = b[:, 0:2].copy().view(np.float16).reshape(n, k // GROUP)
    q = b[:, 2:].copy().view(np.int8).reshape(n, k)
    if t.unpermute_heads:
        from .loader import _unpermute_qk

        q, scale = _unpermute_qk(q, t.unpermute_heads), _unpermute_qk(scale, t.unpermute_heads)
    return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(scale))


def int8_groups(parts: list, device: torch.device | str, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [N, K] int8, scale [N, K/32]) on ``device`` for the row blocks of a (fused) matrix: GGUF Q8_0 parts
    exactly (fp16 scales; kept fp16 when every part is Q8_0), the others re-quantized from their exact values
    (scales in ``dtype``, or float32 beside exact fp16 ones); None when K is not a multiple of 32."""
    from .quant_cuda import quantize_int8_groups

    if parts[0].shape[1] % GROUP:
        return None
    exact = [gguf_q8_0_groups(p) for p in parts]
    scale_dtype = torch.float16 if all(e is not None for e in exact) else \
        torch.float32 if any(e is not None for e in exact) else dtype
    groups = []
    for e, p in zip(exact, parts):
        if e is not None:
            groups.append((e[0].to(device), e[1].to(device)))
        else:  # one matrix widened at a time, re-quantized on the device
            src = p.to(device) if isinstance(p, torch.Tensor) else _as_float(p).to(device)
            groups.append(quantize_int8_groups(src, scale_dtype))
    return tuple(torch.cat([g[i].to(scale_dtype) if i else g[i] for g in groups]) if len(groups) > 1
                 else groups[0][i] for i in range(2))


def int4_groups(parts: list, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [N, K] uint8, scale [N, K/32] f32, offset [N, K/32] f32) on ``device`` for the row blocks of a (fused)
    matrix, or None where the int4 layout keeps it at 8 bits (CudaQ8Linear; the CPU's choice of int8 in
    quant.make_quantized_linear)."""
    k = parts[0].shape[1]
    if k % GROUP:
        return None
    exact = [_exact_int4(p) for p in parts]
    from_gguf = any(not isinstance(p, torch.Tensor) for p in parts)
    if not (any(e is not None for e in exact) or not from_gguf or all(_requantize_to_int4(p) for p in parts)):
        return None
    groups = []
    for e, p in zip(exact, parts):
        if e is not None:  # GGUF 4-bit blocks: codes and group scale / offset exactly (fp32)
            groups.append(tuple(a.to(device) for a in e))
        else:  # one matrix widened at a time, re-quantized on the device
            src = p.to(device) if isinstance(p, torch.Tensor) else _as_float(p).to(device)
            groups.append(quantize_groups_int4(src))
    return tuple(torch.cat([g[i] for g in groups]) if len(groups) > 1 else groups[0][i] for i in range(3))


def make_cuda_linear(parts: list, bias: torch.Tensor | None, device: torch.device | str, dtype: torch.dtype,
                     tied_head: bool = False, layout: str = "int4") -> nn.Module | None:
    """A CudaQ4Linear or CudaQ8Linear (or a ``dtype`` nn.Linear where K is not a multiple of 32) from a matrix's row
    blocks: torch tensors [n_i, K] or GGUF blocks (loader.GGUFQuantized). None for a tied head that the layout
    keeps in floats (int4): it stays tied."""
    from .quant_cuda import CudaQ4Linear, CudaQ8Linear

    b = None if bias is None else bias.to(device)
    got = int4_groups(parts, device) if layout == "int4" else None
    if got is not None:
        return CudaQ4Linear(*got, b, dtype)
    if tied_head and layout == "int4":
        return None
    got8 = int8_groups(parts, device, dtype)
    if got8 is not None:
        return CudaQ8Linear(*got8, b, dtype, scale_dtype=got8[1].dtype)
    w = torch.cat([_as_float(p) for p in parts]) if len(parts) > 1 else _as_float(parts[0])
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    lin.weight = nn.Parameter(w.to(device=device, dtype=dtype), requires_grad=False)
    if b is not None:
        lin.bias = nn.Parameter(b.to(dtype), requires_grad=False)
    return lin
