"""CpuLayerOps: forerun.models.ops.LayerOps on float32 CPU tensors through the C layer kernels (kernels/cpu_layer.py).

add + RMSNorm and Q/K norm + RoPE + the cache write each in one C call; the matrix products stay the layers' own
(oneDNN / the int4 kernel). Anything the C code cannot take falls back to LayerOps (the torch reference). The
runner sets it on float32 CPU models where `kernels.cpu_layer.available()`.

`decoder_layers` runs a whole stack of layers as a flat sequence of calls: the C functions the module path would
reach (int4-kernel products for Q4Linear / Q8Linear, the norms, RoPE + cache write, the row attention), with the
same inputs, in the same order, and the module path's own call for any step they would not take (so bit-identical
to it, tested), without its Python: module calls, per-call checks, the attention plan looked up per layer. That
host work was ~0.5 ms a layer on 2 Zen 3 cores at one token: 15 of the 1.5B's 72 ms and 10 of the 0.5B draft's
27 ms (docs/quantization.md).
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
        """The first n layers of `model` (a LlamaForCausalLM) as a flat run of C calls where the module path would
        call the same C code (int4-kernel linears, the C norms, RoPE and row attention), the module path's own
        call for any other step; None where the C libraries are not there."""
        from ..attention.base import ReferenceBackend
        from ..attention.reference import _flat_plan, _row_plan
        from ..kernels import cpu_q4
        from .quant import Q4Linear, Q8Linear

        if not (cpu_q4.available() and cpu_layer.available()) or h.dtype != torch.float32 or not h.is_contiguous():
            return None
        cfg = model.config
        q4, lay = cpu_q4._load(), cpu_layer._load()
        threads = torch.get_num_threads()
        t = h.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rope, backend = model.rope, model.backend
        f32 = [rope.cos, rope.sin, kv.k[0], kv.v[0]]  # (the pool's layers are allocated alike)
        c_cache = all(x.dtype == torch.float32 and x.is_contiguous() for x in f32)
        c_rope = c_cache and d % 2 == 0 and d <= 1024 and all(x.dtype == torch.int64 and x.is_contiguous()
                                                               for x in (positions, meta.slot_mapping))
        c_attn = c_cache and type(backend) is ReferenceBackend
        if c_attn:  # the attention rows' key lists: one plan for every layer (the module path looks it up per layer)
            keys, off, lens, maxlen = _flat_plan(_row_plan(meta, kv.k[0].shape[1], cfg.sliding_window), t)

        def linear(x, mod):  # Q4Linear.forward / Q8Linear.forward without the module call; else the module
            if type(mod) is Q8Linear:
                x, mod = torch.cat([x, x], dim=-1), mod.planes
            if type(mod) is not Q4Linear:
                return self.linear(x, mod)
            nout, k = mod.out_features, mod.in_features
            m, chunks = x.shape[0], (k // 32 + 15) // 16
            xq = torch.empty(m, chunks * 512, dtype=torch.int8)
            xs, isum = torch.empty(m, chunks * 16), torch.empty(m, chunks * 16)
            q4.q4_quant_act(x.data_ptr(), m, k, xq.data_ptr(), xs.data_ptr(), isum.data_ptr())
            y = torch.empty(m, nout)
            q4.q4_gemm(mod.packed.data_ptr(), nout, k, xq.data_ptr(), xs.data_ptr(), isum.data_ptr(), m, y.data_ptr(),
                       threads)
            return y if mod.bias is None else y.add_(mod.bias)

        def add_rmsnorm(x, r, norm):  # CpuLayerOps.add_rmsnorm
            w = norm.weight
            if w.dtype != torch.float32 or not w.is_contiguous():
                return self.add_rmsnorm(x, r, norm)
            s = torch.empty_like(x) if r is not None else x
            y = torch.empty_like(x)
            lay.add_rmsnorm(x.data_ptr(), None if r is None else r.data_ptr(), w.data_ptr(), norm.eps, s.data_ptr(),
                            y.data_ptr(), t, x.shape[1])
            return y, s

        hidden, res = {}, None
        for i in range(n):
            layer = model.model.layers[i]
            att, mlp = layer.self_attn, layer.mlp
            x, res = add_rmsnorm(h, res, layer.input_layernorm)
            qkv = linear(x, att.qkv_proj)
            qn, kn = (att.q_norm, att.k_norm) if cfg.qk_norm else (None, None)
            if c_rope and qkv.is_contiguous() and (qn is None or (qn.eps == kn.eps and qn.weight.dtype == torch.float32
                                                                   and kn.weight.dtype == torch.float32)):
                q = torch.empty(t, hq, d)
                lay.qkv_rope_store(qkv.data_ptr(), positions.data_ptr(), rope.cos.data_ptr(), rope.sin.data_ptr(),
                                   None if qn is None else qn.weight.data_ptr(),
                                   None if kn is None else kn.weight.data_ptr(), 0.0 if qn is None else qn.eps,
                                   meta.slot_mapping.data_ptr(), kv.k[i].data_ptr(), kv.v[i].data_ptr(), q.data_ptr(),
                                   t, hq, hkv, d)
            else:
                q = self.qkv_to_cache(qkv, positions, rope, qn, kn, i, meta, kv, hq, hkv, d)
            if c_attn:  # paged_attention_rowwise's C path
                qs = q * att.scale
                out = torch.empty_like(qs)
                lay.attn_rows(qs.data_ptr(), kv.k[i].data_ptr(), kv.v[i].data_ptr(), keys.data_ptr(), off.data_ptr(),
                              lens.data_ptr(), out.data_ptr(), t, hq, hkv, d, max(maxlen, 1))
            else:
                out = backend.forward(q, kv.k[i], kv.v[i], meta, att.scale, window=cfg.sliding_window)
            h = linear(out.reshape(t, -1), att.o_proj)
            x, res = add_rmsnorm(h, res, layer.post_attention_layernorm)
            gate, up = linear(x, mlp.gate_up_proj).chunk(2, dim=-1)  # SwiGLU.activation
            h = linear(F.silu(gate) * up, mlp.down_proj)
            if i in wanted:
                hidden[i] = h + res
        return h, res, hidden
