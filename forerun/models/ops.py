"""The layer-kernel extension point: the few operations a decoder layer is made of, behind one interface.

`LayerOps` is the plain torch implementation (any device, any batch): it is the reference, and it is what the
CPU and prefill run. `forerun.models.fused_ops.FusedLayerOps` overrides it on CUDA with Triton kernels that
fuse each operation into one launch (and, for decode-sized batches, skinny matrix products). A model holds one
`LayerOps` in `model.ops`, as it holds one attention backend in `model.backend`.
"""
from __future__ import annotations

import torch
from torch import nn

from ..attention.metadata import AttnMetadata
from ..kvcache.pool import KVPool
from .layers import RMSNorm, RotaryEmbedding, SwiGLU


class LayerOps:
    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, H]. Returns (norm(x + residual), x + residual); residual None means zero."""
        s = x if residual is None else x + residual
        return norm(s), s

    def linear(self, x: torch.Tensor, layer: nn.Module, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x: [T, in] -> [T, out] (optionally cast, e.g. float32 logits)."""
        y = layer(x)
        return y if out_dtype is None else y.to(out_dtype)

    def linear_add(self, x: torch.Tensor, layer: nn.Module, residual: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A product whose output is added to the residual stream: (h, residual) with h + residual the new stream
        (residual None: h is it). Here (layer(x), residual): the add is left to the norm after it; kernels may add
        in the product's epilogue and return (the sum, None)."""
        return self.linear(x, layer), residual

    def mlp(self, x: torch.Tensor, mlp: SwiGLU) -> torch.Tensor:
        """x: [T, H] -> down(silu(gate(x)) * up(x)): [T, H]."""
        return mlp(x)

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, layer: nn.Module,
                    out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """add_rmsnorm, then linear: (layer(norm(x + residual)), x + residual). Kernels may do both in one."""
        h, s = self.add_rmsnorm(x, residual, norm)
        return self.linear(h, layer, out_dtype), s

    def norm_mlp(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, mlp: SwiGLU
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """add_rmsnorm, then mlp: (mlp(norm(x + residual)), x + residual). Kernels may fuse the first two steps."""
        h, s = self.add_rmsnorm(x, residual, norm)
        return self.mlp(h, mlp), s

    def decoder_layers(self, model, h: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, kv: KVPool, n: int,
                       wanted: set[int]) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]] | None:
        """The first n decoder layers of `model` in one go: (h, residual, {layer in wanted: its output}), or None
        to have the model run its layers one module at a time with these ops (the default)."""
        return None

    def decode_attention(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                         q_norm: RMSNorm | None, k_norm: RMSNorm | None, layer: int, meta: AttnMetadata, kv: KVPool,
                         num_heads: int, num_kv_heads: int, head_dim: int, backend, scale: float,
                         window: int | None) -> torch.Tensor | None:
        """A layer's whole attention (qkv_to_cache, then the backend) as one fused operation where these ops have
        one for this step: the heads' outputs [T, Hq, D] with k and v written to the cache; None (the default) to
        have the model run qkv_to_cache and backend.forward."""
        return None

    def qkv_to_cache(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                     q_norm: RMSNorm | None, k_norm: RMSNorm | None, layer: int, meta: AttnMetadata, kv: KVPool,
                     num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """qkv: [T, (Hq + 2 Hkv) D] -> q [T, Hq, D] after Q/K norm and RoPE; k and v are written to the cache."""
        t = qkv.shape[0]
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = q.reshape(t, num_heads, head_dim)
        k = k.reshape(t, num_kv_heads, head_dim)
        v = v.reshape(t, num_kv_heads, head_dim)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = rope(q, k, positions)
        kv.write(layer, meta.slot_mapping, k, v)
        return q
