"""One decoder for the Llama family: Llama / Mistral, Qwen2 (Q/K/V bias), Qwen3 (Q/K RMSNorm).

The forward takes a flattened ragged batch (token ids, positions, AttnMetadata), writes the new keys and
values into the paged pool, and returns logits only for the rows asked for. `num_layers` runs only the
first n layers before the final norm and head (early exit for self-drafting); `hidden_layers` returns
chosen layers' outputs. Parameter names are transformers' names, so HF checkpoints load as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from ..attention.base import AttentionBackend, ReferenceBackend
from ..attention.metadata import AttnMetadata
from ..config import ModelConfig
from ..kvcache.pool import KVPool
from .layers import RMSNorm, RotaryEmbedding, SwiGLU
from .ops import LayerOps


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [R, V] float32 for the requested rows
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, hidden] (after that layer)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        # q, k and v projections fused into one matrix (rows: q, then k, then v): one weight read, one GEMM
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.scale = d ** -0.5

    def forward(self, x, positions, rope: RotaryEmbedding, meta: AttnMetadata, kv: KVPool, backend: AttentionBackend,
                ops: LayerOps):
        """x: [T, H] (normalised) -> [T, H]."""
        return self.attend(ops.linear(x, self.qkv_proj), positions, rope, meta, kv, backend, ops)

    def attend(self, qkv, positions, rope: RotaryEmbedding, meta: AttnMetadata, kv: KVPool, backend: AttentionBackend,
               ops: LayerOps, rows: torch.Tensor | None = None):
        """qkv: [T, (Hq + 2 Hkv) D] (the projection's output) -> the o-projection's output [T, H] (rows given: of
        those rows only, [R, H]; every row's keys and values are written all the same)."""
        out = self.attention(qkv, positions, rope, meta, kv, backend, ops)
        return ops.linear(out if rows is None else out[rows], self.o_proj)

    def attention(self, qkv, positions, rope: RotaryEmbedding, meta: AttnMetadata, kv: KVPool,
                  backend: AttentionBackend, ops: LayerOps) -> torch.Tensor:
        """qkv: [T, (Hq + 2 Hkv) D] -> the heads' outputs before the o-projection, [T, Hq D]; the keys and values
        written into the cache."""
        t, cfg = qkv.shape[0], self.cfg
        norms = (self.q_norm, self.k_norm) if cfg.qk_norm else (None, None)
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        out = ops.decode_attention(qkv, positions, rope, *norms, self.layer, meta, kv, *heads, backend, self.scale,
                                   cfg.sliding_window)  # all of it in one kernel where the ops can, else None
        if out is None:
            q = ops.qkv_to_cache(qkv, positions, rope, *norms, self.layer, meta, kv,
                                 *heads)  # [T, Hq, D]; k, v now in the cache
            out = backend.forward(q, kv.k[self.layer], kv.v[self.layer], meta, self.scale,
                                  window=cfg.sliding_window)  # [T, Hq, D]
        return out.reshape(t, -1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, residual, positions, rope, meta, kv, backend, ops: LayerOps):
        """The residual stream is carried as (h, residual) with x = h + residual (residual None: x = h), so
        each add is fused with the norm that follows it (and the norm with the product after it where the kernels
        can: LayerOps.norm_linear / norm_mlp), or with the product before it (LayerOps.linear_add, which may
        return (x, None)). Returns the new (h, residual)."""
        qkv, residual = ops.norm_linear(h, residual, self.input_layernorm, self.self_attn.qkv_proj)
        out = self.self_attn.attention(qkv, positions, rope, meta, kv, backend, ops)
        h, residual = ops.linear_add(out, self.self_attn.o_proj, residual)  # (h, residual): x = h + residual
        return ops.norm_mlp(h, residual, self.post_attention_layernorm, self.mlp)


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # nn.Embedding's own init, skipped under torch.device("meta") (the loaders build there): its first normal_
        # on meta tensors imports torch's Python decompositions, ~1.5 s of every model load
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        if not self.embed_tokens.weight.is_meta:
            nn.init.normal_(self.embed_tokens.weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.max_positions = min(max_positions or cfg.max_position_embeddings, 1 << 17)
        self.reset_rope()
        self.backend: AttentionBackend = ReferenceBackend()
        self.ops = LayerOps()  # torch kernels; FusedLayerOps (Triton) on CUDA

    def tie_weights(self) -> None:
        """Share the output head with the embeddings (Qwen2 small models, SmolLM2; GGUFs without output.weight)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)build the cos/sin tables (needed after materialising a meta-device model)."""
        cfg = self.config
        with torch.device(device or "cpu"):
            self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict, self.max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttnMetadata,
        kv: KVPool,
        logits_indices: torch.Tensor | None = None,  # [R] rows whose logits are wanted (None: all rows)
        num_layers: int | None = None,  # early exit after this many layers
        hidden_layers: Iterable[int] = (),
    ) -> ForwardOutput:
        n = self.config.num_layers if num_layers is None else num_layers
        if not 1 <= n <= self.config.num_layers:
            raise ValueError(f"num_layers must be in 1..{self.config.num_layers}, got {n}")
        wanted = set(hidden_layers)
        h, res = self.model.embed_tokens(input_ids), None  # [T, hidden]
        hidden: dict[int, torch.Tensor] = {}
        flat = self.ops.decoder_layers(self, h, positions, meta, kv, n, wanted)  # (the CPU int4 layout: C calls)
        if flat is not None:
            h, res, hidden = flat
        else:
            for i in range(n):
                h, res = self.model.layers[i](h, res, positions, self.rope, meta, kv, self.backend, self.ops)
                if i in wanted:
                    hidden[i] = h if res is None else h + res
        if logits_indices is not None:
            if logits_indices.numel() == 0:  # no logits wanted (a prefill chunk): skip the norm and the head
                return ForwardOutput(torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=h.device), hidden)
            if not (logits_indices.numel() == h.shape[0] == 1):  # (one row wanted of one: h itself, which the
                h = h[logits_indices]                                # ops may know the sums of squares of)
                res = None if res is None else res[logits_indices]
        logits, _ = self.ops.norm_linear(h, res, self.model.norm, self.lm_head, out_dtype=torch.float32)  # [R, V]
        return ForwardOutput(logits, hidden)

    # -- weights -------------------------------------------------------------------------------------
    # HF names of the fused matrices' parts, in row order
    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def _param_slices(self) -> dict[str, tuple[torch.Tensor, slice]]:
        """HF tensor name -> (parameter, row slice). Fused parameters are split back into their HF parts."""
        out: dict[str, tuple[torch.Tensor, slice]] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            mod, _, leaf = name.rpartition(".")
            base, _, fused = mod.rpartition(".")
            if fused not in self.FUSED:
                out[name] = (p, slice(None))
                continue
            owner = self.get_submodule(base)  # the Attention or SwiGLU holding the fused matrix
            sizes = [owner.q_size, owner.kv_size, owner.kv_size] if fused == "qkv_proj" else [p.shape[0] // 2] * 2
            start = 0
            for part, size in zip(self.FUSED[fused], sizes):
                out[f"{base}.{part}.{leaf}"] = (p, slice(start, start + size))
                start += size
        return out

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under transformers' names (fused matrices split back; views, no copies)."""
        tied = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        return {name: p[rows] for name, (p, rows) in self._param_slices().items() if name not in tied}

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters; every (part of a) parameter must be given exactly once."""
        targets = self._param_slices()
        tied = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        seen: set[str] = set()
        for name, tensor in tensors:
            if name in tied or name.endswith("rotary_emb.inv_freq"):
                continue
            if name not in targets:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {self.config.arch} model")
            p, rows = targets[name]
            dst = p[rows]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor.to(p.dtype))
            seen.add(name)
        missing = set(targets) - seen - tied
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
