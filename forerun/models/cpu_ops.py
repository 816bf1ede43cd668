"""CpuLayerOps: forerun.models.ops.LayerOps on float32 CPU tensors through the C layer kernels (kernels/cpu_layer.py).

add + RMSNorm and Q/K norm + RoPE + the cache write each in one C call; the matrix products stay the layers' own
(oneDNN / the int4 kernel). Anything the C code cannot take falls back to LayerOps (the torch reference). The
runner sets it on float32 CPU models where `kernels.cpu_layer.available()`.
"""
from __future__ import annotations

from ..kernels import cpu_layer
from .ops import LayerOps


class CpuLayerOps(LayerOps):
    def add_rmsnorm(self, x, residual, norm):
        got = cpu_layer.add_rmsnorm_rows(x, residual, norm.weight, norm.eps)
        return got if got is not None else super().add_rmsnorm(x, residual, norm)

    def qkv_to_cache(self, qkv, positions, rope, q_norm, k_norm, layer, meta, kv, num_heads, num_kv_heads, head_dim):
        q = None
        if q_norm is None or (k_norm is not None and q_norm.eps == k_norm.eps):
            q = cpu_layer.qkv_rope_store(qkv, positions, rope.cos, rope.sin,
                                         None if q_norm is None else q_norm.weight,
                                         None if k_norm is None else k_norm.weight,
                                         q_norm.eps if q_norm is not None else 0.0, meta.slot_mapping,
                                         kv.k[layer], kv.v[layer], num_heads, num_kv_heads, head_dim)
        if q is None:
            return super().qkv_to_cache(qkv, positions, rope, q_norm, k_norm, layer, meta, kv, num_heads,
                                        num_kv_heads, head_dim)
        return q
