"""CpuLayerOps: forerun.models.ops.LayerOps on float32 CPU tensors through the C layer kernels (kernels/cpu_layer.py).

add + RMSNorm, Q/K norm + RoPE + the cache write and silu * up each in one C call; the matrix products stay the
layers' own (oneDNN / the int4 and int8 kernels). Anything the C code cannot take falls back to LayerOps (the torch
reference). The runner sets it on float32 CPU models where `kernels.cpu_layer.available()`.

`decoder_layers` runs a whole stack of layers without the modules: the calls the module path ends in, with the same
inputs, in the same order (so bit-identical to it, tested), without its module calls and reshapes and with the
attention's key plan looked up once per forward instead of per layer. That host work was ~0.5 ms a layer on 2 Zen 3
cores at one token: 15 of the 1.5B's 72 ms and 10 of the 0.5B draft's 27 ms. Runs of layers whose products are all
cpu_q4.c's go to C in one call (`cpu_layer.decoder_stack`, session 38: the remaining ~100 us a layer of Python
between the C calls; docs/quantization.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import cpu_layer
from .layers import SwiGLU
from .ops import LayerOps
from .quant import Q4Linear, Q8Linear


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

    def mlp(self, x, mlp):
        """down(silu(gate) * up) with the activation in one C call (the module path; decoder_layers does the same)."""
        gu = self.linear(x, mlp.gate_up_proj)
        act = cpu_layer.silu_mul_rows(gu)
        return self.linear(SwiGLU.activation(gu) if act is None else act, mlp.down_proj)

    def decoder_layers(self, model, h, positions, meta, kv, n: int, wanted: set[int]):
        """The first n layers of `model` (a LlamaForCausalLM) without the modules: the same calls the module path
        ends in (this class's norms, RoPE and activation, the int4 kernel's products, the C row attention with one
        key plan for the forward), in the same order; None where the C libraries are not there. Runs of layers
        whose products are all cpu_q4.c's (Q4Linear, Q8Linear) go to C in one call each
        (`cpu_layer.decoder_stack`, split after each layer in `wanted`); other layers take the calls one by one
        from here."""
        from ..attention.base import ReferenceBackend
        from ..attention.reference import flat_row_plan

        if not cpu_layer.available():  # (a Q4Linear exists only where the int4 kernel built)
            return None
        cfg = model.config
        threads = torch.get_num_threads()
        t = h.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rope, backend = model.rope, model.backend
        plan = None
        if type(backend) is ReferenceBackend:  # its CPU rows (paged_attention_rowwise), the plan looked up once
            plan = flat_row_plan(meta, kv.k[0].shape[1], cfg.sliding_window)
        table = self._layer_table(model, kv) if plan is not None and self._stack_ok(model, h, positions, meta, kv) \
            else None

        def linear(x, mod):  # the product without the module call and its reshapes
            return mod.rows(x, threads) if type(mod) in (Q4Linear, Q8Linear) else self.linear(x, mod)

        hidden, res, i = {}, None, 0
        while i < n:
            if table is not None and table.in_c[i]:
                j = i + 1  # a run of such layers, ending after a wanted one
                while j < n and j - 1 not in wanted and table.in_c[j]:
                    j += 1
                h, res = cpu_layer.decoder_stack(table.rows[i:j], table.eps[i:j], h, res, table.dims, positions,
                                                 rope.cos, rope.sin, meta.slot_mapping, plan, table.scale,
                                                 table.act_scratch)
                i = j
                if i - 1 in wanted:
                    hidden[i - 1] = h + res
                continue
            layer = model.model.layers[i]
            att, mlp = layer.self_attn, layer.mlp
            x, res = self.add_rmsnorm(h, res, layer.input_layernorm)
            qn, kn = (att.q_norm, att.k_norm) if cfg.qk_norm else (None, None)
            q = self.qkv_to_cache(linear(x, att.qkv_proj), positions, rope, qn, kn, i, meta, kv, hq, hkv, d)
            out = None
            if plan is not None and q.dtype == torch.float32:
                kf, vf = kv.k[i].view(-1, hkv, d), kv.v[i].view(-1, hkv, d)
                out = cpu_layer.attention_rows(q * att.scale, kf, vf, *plan)
            if out is None:
                out = backend.forward(q, kv.k[i], kv.v[i], meta, att.scale, window=cfg.sliding_window)
            h = linear(out.reshape(t, -1), att.o_proj)
            x, res = self.add_rmsnorm(h, res, layer.post_attention_layernorm)
            gu = linear(x, mlp.gate_up_proj)
            act = cpu_layer.silu_mul_rows(gu)
            h = linear(SwiGLU.activation(gu) if act is None else act, mlp.down_proj)
            if i in wanted:
                hidden[i] = h + res
            i += 1
        return h, res, hidden

    @staticmethod
    def _stack_ok(model, h, positions, meta, kv) -> bool:
        """What the C stack's calls need of this forward (what the one-call wrappers check before each call)."""
        from ..kernels import cpu_q4

        cfg = model.config
        rope = model.rope
        return (cpu_q4.available() and cfg.head_dim % 2 == 0 and cfg.head_dim <= 1024
                and h.dim() == 2 and cpu_layer._ok(h, rope.cos, rope.sin, kv.k[0], kv.v[0])
                and positions.dtype == torch.int64 and positions.is_contiguous() and positions.device.type == "cpu"
                and meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.is_contiguous())

    def _layer_table(self, model, kv) -> "_LayerTable":
        """The C stack's table for every layer of `model` with cache `kv`, built once and kept while the layers'
        modules and the cache are the same objects (a module swapped for another rebuilds it; a tensor reassigned
        inside a module after the first forward is not seen). Building it costs ~2 ms a forward at 28 layers."""
        layers = list(model.model.layers._modules.values())
        key = tuple(m for layer in layers for m in _modules_of(layer))
        cached = getattr(self, "_table", None)
        if cached is not None and cached.kv is kv and cached.k0 == kv.k[0].data_ptr() and cached.key == key:
            return cached
        from ..kernels import cpu_q4

        cfg = model.config
        p = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        rows, eps, in_c = [], [], []
        for li, layer in enumerate(layers):
            att = layer.self_attn
            ok = _in_c(layer)
            in_c.append(ok)
            qn, kn = (att.q_norm, att.k_norm) if cfg.qk_norm else (None, None)
            prods = _products(layer)
            rows.append([0] * len(cpu_layer.STACK_FIELDS) if not ok else [
                p(layer.input_layernorm.weight), prods[0].packed.data_ptr(), p(prods[0].bias),
                p(None if qn is None else qn.weight), p(None if kn is None else kn.weight), prods[1].packed.data_ptr(),
                p(prods[1].bias), p(layer.post_attention_layernorm.weight), prods[2].packed.data_ptr(),
                p(prods[2].bias), prods[3].packed.data_ptr(), p(prods[3].bias), kv.k[li].data_ptr(),
                kv.v[li].data_ptr(), sum(1 << b for b, m in enumerate(prods) if type(m) is Q8Linear)])
            eps.append([layer.input_layernorm.eps, layer.post_attention_layernorm.eps, 0.0 if qn is None else qn.eps])
        widest = max(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
        self._table = _LayerTable(key, kv, kv.k[0].data_ptr(), torch.tensor(rows, dtype=torch.int64),
                                  torch.tensor(eps, dtype=torch.float32), in_c,
                                  (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size),
                                  layers[0].self_attn.scale, cpu_q4.act_scratch(widest))
        return self._table


@dataclass
class _LayerTable:
    """CpuLayerOps' cached C-stack table (cpu_layer.decoder_stack's arguments that stay the same between forwards).
    Every layer's cache is built alike by KVPool: _stack_ok checks layer 0's."""
    key: tuple  # the modules it was built from (held: their ids stay theirs)
    kv: object  # the cache it points into (held)
    k0: int  # kv.k[0]'s address when built
    rows: torch.Tensor  # [L, len(cpu_layer.STACK_FIELDS)] int64 addresses (zeros where in_c is False)
    eps: torch.Tensor  # [L, 3] float32
    in_c: list  # [L] bool: _in_c(layer)
    dims: tuple  # (H, Hq, Hkv, D, I)
    scale: float  # the softmax scale
    act_scratch: tuple  # cpu_q4.act_scratch of the widest product input


def _modules_of(layer) -> tuple:
    """The modules of a decoder layer the C stack's table reads (through the module dicts: no nn.Module.__getattr__)."""
    att, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
    return (layer._modules["input_layernorm"], layer._modules["post_attention_layernorm"], att["qkv_proj"],
            att["o_proj"], att.get("q_norm"), att.get("k_norm"), mlp["gate_up_proj"], mlp["down_proj"])


def _products(layer) -> tuple:
    """A decoder layer's four products, in the order of the C stack's int8 bits."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _in_c(layer) -> bool:
    """Whether the C stack takes a decoder layer: its four products all cpu_q4.c's (Q4Linear / Q8Linear) and its
    Q/K norms (if any) of one eps (what cpu_layer.c's qkv_rope_store takes)."""
    att = layer.self_attn
    return (all(type(m) in (Q4Linear, Q8Linear) for m in _products(layer))
            and (getattr(att, "q_norm", None) is None or att.q_norm.eps == att.k_norm.eps))
