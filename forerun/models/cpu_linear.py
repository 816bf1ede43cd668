"""CPU speed: linear layers with oneDNN pre-packed weights.

On this project's 2-core CI machine, torch's default fp32 GEMM is ~8x slower for 2..16 rows than for one
(a GEMV), which would make verifying k + 1 tokens cost far more than decoding one and ruin speculative
decoding on the CPU. Packing each weight once into oneDNN's blocked layout (what torch.compile's CPU
freezing does) makes a 5-row product cost ~1.4x a 1-row one, and the 1-row product itself faster.
Results equal F.linear up to float rounding (the real-model tests compare against transformers at 1e-4).

Batch invariance (fp32): oneDNN computes one row by a GEMV whose summation order differs from its GEMM's, while
for 2 or more rows a row's result does not depend on the other rows (tested bitwise at 1..17 rows). So a single
row is multiplied as two (itself and a zero row): a decode row then gets exactly the bits it would get among
k + 1 verify rows, for ~2 % of the one-row time. (bf16 packed weights are not batch-invariant.)
"""
from __future__ import annotations

import torch
from torch import nn


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def fast_cpu_bf16() -> bool:
    """oneDNN has native bf16 kernels on this CPU (AVX512-BF16 / AMX): packed bf16 weights halve the bytes."""
    try:
        return packing_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout (inference only)."""

    def __init__(self, linear: nn.Linear, rows_hint: int = 8) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous(), rows_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 1:  # the GEMV path sums in another order than the GEMM: use the GEMM (see above)
            flat = torch.cat([flat, flat.new_zeros(1, self.in_features)])
            y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")[:1]
        else:
            y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Replace every CPU nn.Linear (fp32, or bf16 where oneDNN has bf16 kernels) by a PackedLinear;
    returns how many were packed."""
    if not packing_available():
        return 0
    dtypes = (torch.float32, torch.bfloat16) if fast_cpu_bf16() else (torch.float32,)
    # (parent, name) pairs only: once a Linear is replaced nothing holds it, so peak memory stays ~1x the model
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and child.weight.dtype in dtypes]
    for parent, name in targets:
        setattr(parent, name, PackedLinear(getattr(parent, name)))
    return len(targets)
