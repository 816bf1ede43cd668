"""GGUF (and safetensors) checkpoints loaded onto CUDA with their linear weights kept 4-bit (issue 12, item 3).

``load_model(path, "cuda", torch.bfloat16, quantize="auto")`` on a GGUF file (or ``quantize="int4"`` on any
checkpoint) builds every decoder linear straight from the checkpoint into a `CudaQ4Linear` (word layout, Triton
products for <= 16 rows, forerun/models/quant_cuda.py). The rules are the CPU int4 layout's (quant.py:
`make_quantized_linear`), with bf16 where the CPU keeps int8 (there is no CUDA int8 linear):

* GGUF Q4_K / Q4_1 / Q4_0 matrices map exactly onto the 32-weight groups (`quant.gguf_int4_groups`): codes
  copied, group scale ``d*sc`` and offset ``-dmin*m`` computed exactly in fp32 from the block, then stored in the
  model dtype (bf16: the only loss, <= 2^-9 relative per scale / offset). No fp32 copy of the matrix is made.
* Q6_K / Q5_K / Q5_0 / Q5_1 layer matrices (``INT4_OTHERS="layers"``, the default): dequantized exactly, one matrix
  at a time, and re-quantized to int4 min/max groups of 32 (`quant.quantize_groups_int4`; error <= half an int4
  step of the group's range). A fused matrix with a 4-bit part re-quantizes its other parts the same way.
* Q8_0 matrices and the output head when it is not 4-bit (Q6_K / Q8_0 in Q4_K_M files): bf16 ``nn.Linear``
  (the GGUF's values rounded once to bf16); a tied head stays tied to the (bf16) embedding, no copy.
  ``FORERUN_INT4_OTHERS=int4`` re-quantizes those to int4 too, ``=int8`` keeps the 5/6-bit ones bf16 as well.
* safetensors with ``quantize="int4"``: every linear re-quantized to int4 groups (the head too, as on the CPU).
* norms and the embedding: the model dtype.

`build_cuda_q4_model(ckpt, device, dtype)` takes any device, so the CPU tests build the same modules (their
forward on CPU tensors is ``dequantized()`` + linear).
"""
from __future__ import annotations

import torch
from torch import nn

from .quant import GROUP, _as_float, _exact_int4, _requantize_to_int4, quantize_groups_int4

CUDA_DTYPES = (torch.bfloat16, torch.float16)


def check_cuda_layout(layout: str, device: torch.device | str, dtype: torch.dtype) -> None:
    """One-line ValueError for a quantized layout this device cannot run."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"quantize={layout!r} runs on cpu and cuda only (got device {dev})")
    if layout != "int4":
        raise ValueError(f"quantize={layout!r} has no CUDA layout; on cuda use 'int4' (or 'auto' for GGUF files) "
                         f"or 'none' (bf16)")
    if dtype not in CUDA_DTYPES:
        raise ValueError(f"quantize='int4' on cuda multiplies bfloat16/float16 activations; got dtype {dtype} "
                         f"(pass dtype=torch.bfloat16 or quantize='none')")


def int4_groups(parts: list, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [N, K] uint8, scale [N, K/32] f32, offset [N, K/32] f32) on ``device`` for the row blocks of a (fused)
    matrix, or None where the int4 layout keeps it in floats (same choice as quant.make_quantized_linear)."""
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
                     tied_head: bool = False) -> nn.Module | None:
    """A CudaQ4Linear (or a ``dtype`` nn.Linear where the layout keeps floats) from a matrix's row blocks: torch
    tensors [n_i, K] or GGUF blocks (loader.GGUFQuantized). None for a float tied head: keep it tied."""
    from .quant_cuda import CudaQ4Linear

    b = None if bias is None else bias.to(device)
    got = int4_groups(parts, device)
    if got is not None:
        return CudaQ4Linear(*got, b, dtype)
    if tied_head:
        return None
    w = torch.cat([_as_float(p) for p in parts]) if len(parts) > 1 else _as_float(parts[0])
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    lin.weight = nn.Parameter(w.to(device=device, dtype=dtype), requires_grad=False)
    if b is not None:
        lin.bias = nn.Parameter(b.to(dtype), requires_grad=False)
    return lin


def build_cuda_q4_model(ckpt, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                        max_positions: int | None = None, progress: bool = True):
    """The checkpoint with its linears as CudaQ4Linear (see the module doc) on ``device``, everything else in
    ``dtype``. On cuda ``dtype`` must be bf16/fp16; any device and dtype are accepted for tests."""
    from .registry import build_quantized_model

    if torch.device(device).type == "cuda":
        check_cuda_layout("int4", device, dtype)
    model = build_quantized_model(
        ckpt, device, "int4", max_positions, progress, dtype=dtype,
        make_linear=lambda parts, bias, path: make_cuda_linear(parts, bias, device, dtype,
                                                               tied_head=(path == "lm_head"
                                                                          and ckpt.config.tie_word_embeddings)))
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return model
