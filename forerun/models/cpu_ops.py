"""CpuLayerOps: forerun.models.ops.LayerOps on float32 CPU tensors through the C layer kernels (kernels/cpu_layer.py).

add + RMSNorm and Q/K norm + RoPE + the cache write each in one C call; the matrix products stay the layers' own
(oneDNN / the int4 kernel). Anything the C code cannot take falls back to LayerOps (the torch reference). The
runner sets it on float32 CPU models where `kernels.cpu_layer.available()`.

`decoder_layers` runs a whole stack of layers without the modules: the calls the module path ends in, with the same
inputs, in the same order (so bit-identical to it, tested), without its module calls and reshapes and with the
attention's key plan looked up once per forward instead of per layer. That host work was ~0.5 ms a layer on 2 Zen 3
cores at one token: 15 of the 1.5B's 72 ms and 10 of the 0.5B draft's 27 ms (docs/quantization.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

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

    def decoder_layers(self, model, h, positions, meta, kv, n: int, wanted: set[int]):
        """The first n layers of `model` (a LlamaForCausalLM) without the modules: the same calls the module path
        ends in (this class's norms and RoPE, the int4 kernel's products, the C row attention with one key plan
        for the forward), in the same order; None where the C libraries are not there."""
        from ..attention.base import ReferenceBackend
        from ..attention.reference import _flat_plan, _row_plan
        from .quant import Q4Linear, Q8Linear

        if not cpu_layer.available():  # (a Q4Linear exists only where the int4 kernel built)
            return None
        cfg = model.config
        threads = torch.get_num_threads()
        t = h.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rope, backend = model.rope, model.backend
        if type(backend) is ReferenceBackend:  # its CPU rows (paged_attention_rowwise), the plan looked up once
            plan = _flat_plan(_row_plan(meta, kv.k[0].shape[1], cfg.sliding_window), t)

        def linear(x, mod):  # the product without the module call and its reshapes
            return mod.rows(x, threads) if type(mod) in (Q4Linear, Q8Linear) else self.linear(x, mod)

        hidden, res = {}, None
        for i in range(n):
            layer = model.model.layers[i]
            att, mlp = layer.self_attn, layer.mlp
            x, res = self.add_rmsnorm(h, res, layer.input_layernorm)
            qn, kn = (att.q_norm, att.k_norm) if cfg.qk_norm else (None, None)
            q = self.qkv_to_cache(linear(x, att.qkv_proj), positions, rope, qn, kn, i, meta, kv, hq, hkv, d)
            out = None
            if type(backend) is ReferenceBackend and q.dtype == torch.float32:
                kf, vf = kv.k[i].view(-1, hkv, d), kv.v[i].view(-1, hkv, d)
                out = cpu_layer.attention_rows(q * att.scale, kf, vf, *plan)
            if out is None:
                out = backend.forward(q, kv.k[i], kv.v[i], meta, att.scale, window=cfg.sliding_window)
            h = linear(out.reshape(t, -1), att.o_proj)
            x, res = self.add_rmsnorm(h, res, layer.post_attention_layernorm)
            gate, up = linear(x, mlp.gate_up_proj).chunk(2, dim=-1)  # SwiGLU.activation
            h = linear(F.silu(gate) * up, mlp.down_proj)
            if i in wanted:
                hidden[i] = h + res
        return h, res, hidden
