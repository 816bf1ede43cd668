"""EAGLE draft heads: one decoder layer that drafts from the target's own hidden states.

Two published families, one module:

- EAGLE-1/2 (github.com/SafeAILab/EAGLE, `cnets.py` of v1/v2): x = fc([embed(token), f]) where f is the
  target's LAST hidden state after its final norm (what transformers' LlamaModel returns); one decoder
  layer WITHOUT input_layernorm; the output goes straight into the target's lm_head (a head's own `norm` /
  `lm_head` are used when the checkpoint has them). The layer's output is trained to regress the next
  feature, so it is fed back as f for the next draft step.
- EAGLE-3 (EAGLE repo v3, SpecForge): the feature is fc(cat(h_a, h_b, h_c)) of three target layers'
  outputs (default layers 1, L/2 - 1, L - 4: SGLang's `eagle_aux_hidden_state_layer_ids`); the layer's
  attention reads cat(input_layernorm(embed(token)), hidden_norm(x)) (q/k/v over 2H), its residual is x;
  logits = lm_head(norm(out)) over a reduced draft vocabulary, draft id d is target id d + d2t[d]. The
  layer output (before the norm) is fed back as x for the next step (no fc).

Row t of the head's cache pairs the token x_{t+1} with the feature of position t (EAGLE's shift), at RoPE
position t; the output of row t predicts x_{t+2}.

Two forwards share the weights: `forward` over the paged KV cache (drafting, through a ModelRunner's
prepared step) and `forward_dense` over [B, T] batches with an explicit attention mask (training,
including EAGLE-3's training-time-test unrolling). The embedding, and for EAGLE-1 the norm and lm_head,
are the target's: they are held by reference, not as parameters, so they are neither saved nor trained.

Checkpoints: `load_eagle_head(dir, target)` reads config.json + model.safetensors / pytorch_model.bin in
the EAGLE-1/2 layout (fc.*, layers.0.*) or the EAGLE-3 / SpecForge layout (fc.weight, midlayer.*, norm,
lm_head, d2t, t2d); `save_eagle_head` writes the same layouts. Nothing from the folder is executed
(safetensors, or torch.load with weights_only=True).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn
import torch.nn.functional as F

from ..attention.metadata import AttnMetadata
from ..config import ModelConfig
from ..kvcache.pool import KVPool
from .ops import LayerOps
from .layers import RMSNorm, RotaryEmbedding
from .llama import DecoderLayer, LlamaForCausalLM


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high target layers, as 'output of layer i' indices (forerun's hidden_layers)."""
    return (min(1, num_layers - 1), max(num_layers // 2 - 1, 0), max(num_layers - 4, 0))


@dataclass(frozen=True)
class EagleConfig:
    """version 1 (EAGLE-1/2) or 3. layer: the head's decoder layer shape (num_layers = 1). aux_layers: the
    target layers whose outputs form the feature (v1: the last layer, taken after the final norm).
    draft_vocab_size: rows of the head's own lm_head (v3; None with v1 means the target's lm_head)."""

    version: int
    layer: ModelConfig
    aux_layers: tuple[int, ...]
    fc_bias: bool = False
    own_norm: bool = False
    own_lm_head: bool = False
    draft_vocab_size: int | None = None
    hf_config: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.version not in (1, 3):
            raise ValueError(f"EAGLE version must be 1 or 3, got {self.version}")
        if self.layer.num_layers != 1:
            raise ValueError("an EAGLE head has exactly one decoder layer")
        if self.version == 3 and not (self.own_norm and self.own_lm_head):
            raise ValueError("an EAGLE-3 head has its own norm and lm_head")

    @property
    def feature_size(self) -> int:
        """Width of the target feature a cache row is fed with."""
        return self.layer.hidden_size * (len(self.aux_layers) if self.version == 3 else 1)

    @classmethod
    def for_target(cls, target: ModelConfig, version: int = 3, draft_vocab_size: int | None = None,
                   aux_layers: tuple[int, ...] | None = None, intermediate_size: int | None = None) -> "EagleConfig":
        """A fresh head for a target (training): the target's attention shape, llama-style layer."""
        layer = replace(target, arch="llama", num_layers=1, attention_bias=False, qk_norm=False,
                        tie_word_embeddings=False, intermediate_size=intermediate_size or target.intermediate_size)
        if version == 1:
            return cls(1, layer, (target.num_layers - 1,), fc_bias=True)
        return cls(3, layer, tuple(aux_layers or default_aux_layers(target.num_layers)), own_norm=True,
                   own_lm_head=True, draft_vocab_size=draft_vocab_size or target.vocab_size)


class EagleHead(nn.Module):
    def __init__(self, cfg: EagleConfig, target: LlamaForCausalLM, max_positions: int | None = None) -> None:
        super().__init__()
        self.eagle = cfg
        lc = cfg.layer
        tc = target.config
        if lc.hidden_size != tc.hidden_size:
            raise ValueError(f"EAGLE head hidden size {lc.hidden_size} != target hidden size {tc.hidden_size}")
        if any(not 0 <= i < tc.num_layers for i in cfg.aux_layers):
            raise ValueError(f"EAGLE head reads target layers {cfg.aux_layers}; the target has {tc.num_layers}")
        self.config = lc  # what a KVPool / ModelRunner over the head reads (one layer)
        self.max_positions = min(max_positions or target.max_positions, target.max_positions)
        h = lc.hidden_size
        fc_in = 2 * h if cfg.version == 1 else cfg.feature_size
        self.fc = nn.Linear(fc_in, h, bias=cfg.fc_bias)
        self.layer = DecoderLayer(lc, 0)
        attn = self.layer.self_attn
        if cfg.version == 3:  # q/k/v read [embedding, hidden] side by side
            attn.qkv_proj = nn.Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=lc.attention_bias)
            self.hidden_norm = RMSNorm(h, lc.rms_norm_eps)
        else:
            del self.layer.input_layernorm  # EAGLE-1/2's layer 0 has none
        self.norm = RMSNorm(h, lc.rms_norm_eps) if cfg.own_norm else None
        vd = cfg.draft_vocab_size or tc.vocab_size
        self.lm_head = nn.Linear(h, vd, bias=False) if cfg.own_lm_head else None
        # draft id -> target id (identity without a reduced vocabulary)
        self.register_buffer("draft_to_target", torch.arange(vd), persistent=False)
        self._target = (target,)  # by reference: not a submodule (not saved, not trained)
        with torch.device("cpu"):
            self.rope = RotaryEmbedding(lc.head_dim, lc.rope_theta, lc.rope_scaling_dict, self.max_positions)

    @property
    def target(self) -> LlamaForCausalLM:
        return self._target[0]

    @property
    def vocab_size(self) -> int:
        """The TARGET's vocabulary: `logits` are always over target ids."""
        return self.target.config.vocab_size

    @property
    def draft_vocab_size(self) -> int:
        return self.draft_to_target.numel()

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        """d2t: [Vd] long, EAGLE-3's offsets (target id = d + d2t[d])."""
        if d2t.numel() != self.draft_vocab_size:
            raise ValueError(f"d2t has {d2t.numel()} entries, the draft lm_head {self.draft_vocab_size} rows")
        ids = torch.arange(d2t.numel()) + d2t.long().cpu()
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError("d2t maps draft ids outside the target vocabulary or twice onto one token")
        self.draft_to_target = ids.to(self.draft_to_target.device)

    # -- features ------------------------------------------------------------------------------------
    def target_feature(self, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's hidden states (forerun's `hidden_states[layer]`, before the final norm) -> the feature
        a cache row is fed with [n, feature_size]: v1 applies the target's final norm, v3 concatenates."""
        if self.eagle.version == 1:
            x = states[self.eagle.aux_layers[0]]
            return self.target.model.norm(x)
        return torch.cat([states[i] for i in self.eagle.aux_layers], dim=-1)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the head computes in (its norms'; the linears may be quantized: forerun.drafters.eagle)."""
        return self.layer.post_attention_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layer.post_attention_layernorm.weight.device

    def _input(self, input_ids: torch.Tensor, feats: torch.Tensor, from_target: bool, ops: LayerOps | None = None):
        """(attention input [.., 2H or H], residual [.., H]). ops: the target's layer ops (paged forward: fused
        norm kernels on CUDA); None: the modules themselves (training: autograd)."""
        emb = self.target.model.embed_tokens(input_ids).to(self.compute_dtype)
        feats = feats.to(self.compute_dtype)
        if self.eagle.version == 1:
            x = self.fc(torch.cat([emb, feats], dim=-1))
            return x, x
        x = self.fc(feats) if from_target else feats
        if ops is not None:
            return torch.cat([ops.add_rmsnorm(emb, None, self.layer.input_layernorm)[0],
                              ops.add_rmsnorm(x.contiguous(), None, self.hidden_norm)[0]], dim=-1), x
        return torch.cat([self.layer.input_layernorm(emb), self.hidden_norm(x)], dim=-1), x

    def _mlp_tail(self, a: torch.Tensor, residual: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        if ops is not None:  # the residual add and the norm in one kernel, the SwiGLU in the product's epilogue (CUDA)
            n, h = ops.add_rmsnorm(a, residual, self.layer.post_attention_layernorm)
            return h + ops.mlp(n, self.layer.mlp)
        h = residual + a
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))

    def logits(self, out: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        """Head output [R, H] -> float32 logits over the DRAFT vocabulary [R, Vd]."""
        if self.norm is None:
            x = out
        else:
            x = self.norm(out) if ops is None else ops.add_rmsnorm(out, None, self.norm)[0]
        head = self.lm_head if self.lm_head is not None else self.target.lm_head
        return head(x.to(self._head_dtype(head))).float()

    @staticmethod
    def _head_dtype(head: nn.Module) -> torch.dtype:
        w = getattr(head, "weight", None)
        if w is not None:
            return w.dtype
        if isinstance(getattr(head, "dtype", None), torch.dtype):  # CudaQ4Linear / CudaQ8Linear: their activations
            return head.dtype
        packed = getattr(head, "packed", None)  # PackedLinear: fp32 / bf16; quantized linears take float32
        return packed.dtype if packed is not None and packed.is_floating_point() else torch.float32

    def to_target_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[R, Vd] -> [R, V]: -inf on target tokens the draft vocabulary lacks."""
        if self.draft_vocab_size == self.vocab_size and self.lm_head is None:
            return draft_logits
        out = draft_logits.new_full((draft_logits.shape[0], self.vocab_size), float("-inf"))
        out[:, self.draft_to_target] = draft_logits
        return out

    # -- paged forward (drafting) --------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        feats: torch.Tensor,  # [T, feature_size] target features (from_target) or [T, H] head outputs
        positions: torch.Tensor,  # [T]
        meta: AttnMetadata,
        kv: KVPool,
        from_target: bool,
        rows: torch.Tensor | None = None,  # [R] rows whose outputs are wanted (None: all)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the rows' keys/values into the head's cache; returns (out [R, H], draft logits [R, Vd])."""
        t = self.target
        x, residual = self._input(input_ids, feats, from_target, t.ops)
        attn = self.layer.self_attn
        # the o-projection and the MLP only for the rows whose outputs are wanted (rows are independent there)
        a = attn.attend(t.ops.linear(x, attn.qkv_proj), positions, self.rope, meta, kv, t.backend, t.ops, rows=rows)
        if rows is not None:
            residual = residual[rows]
        out = self._mlp_tail(a, residual, t.ops)
        return out, self.logits(out, t.ops)

    # -- dense forward (training) --------------------------------------------------------------------
    def attention_dense(self, x: torch.Tensor, positions: torch.Tensor, cache: list | None, mask: torch.Tensor
                        ) -> torch.Tensor:
        """x: [B, T, in]; positions: [T]; cache: list of (k, v) of earlier unrolled steps, each
        [B, Hkv, T, D] (the new step's k, v are appended); mask: [T, T * (len(cache) + 1)] bool."""
        attn, lc = self.layer.self_attn, self.eagle.layer
        b, t, _ = x.shape
        qkv = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.reshape(b * t, lc.num_heads, lc.head_dim)
        k = k.reshape(b * t, lc.num_kv_heads, lc.head_dim)
        pos = positions.repeat(b)
        q, k = self.rope(q, k, pos)
        q = q.view(b, t, lc.num_heads, lc.head_dim).transpose(1, 2)
        k = k.view(b, t, lc.num_kv_heads, lc.head_dim).transpose(1, 2)
        v = v.reshape(b, t, lc.num_kv_heads, lc.head_dim).transpose(1, 2)
        if cache is not None:
            cache.append((k, v))
            k = torch.cat([c[0] for c in cache], dim=2)
            v = torch.cat([c[1] for c in cache], dim=2)
        rep = lc.num_heads // lc.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale)  # [B, Hq, T, D]
        return attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def forward_dense(self, input_ids: torch.Tensor, feats: torch.Tensor, from_target: bool,
                      cache: list | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T], feats [B, T, F] -> head outputs [B, T, H]; plain causal attention unless an
        unrolling cache and mask are given (see forerun.eagle.train)."""
        t = input_ids.shape[1]
        x, residual = self._input(input_ids, feats, from_target)
        if mask is None:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        a = self.attention_dense(x, torch.arange(t, device=x.device), cache, mask)
        return self._mlp_tail(a, residual)

    # -- weights -------------------------------------------------------------------------------------
    def published_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under the published names (EAGLE-1/2: layers.0.*; EAGLE-3 / SpecForge: midlayer.*)."""
        prefix = "layers.0." if self.eagle.version == 1 else "midlayer."
        out: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            if name.startswith("layer."):
                rest = name[len("layer."):]
                mod, _, leaf = rest.rpartition(".")
                base, _, fused = mod.rpartition(".")
                if fused in LlamaForCausalLM.FUSED:
                    owner = self.layer.get_submodule(base)
                    sizes = ([owner.q_size, owner.kv_size, owner.kv_size] if fused == "qkv_proj"
                             else [p.shape[0] // 2] * 2)
                    for part, chunk in zip(LlamaForCausalLM.FUSED[fused], p.split(sizes, 0)):
                        out[f"{prefix}{base}.{part}.{leaf}"] = chunk
                else:
                    out[prefix + rest] = p
            elif name.startswith("hidden_norm."):
                out["midlayer." + name] = p
            else:
                out[name] = p
        if self.eagle.version == 3:
            ids = self.draft_to_target.cpu()
            out["d2t"] = ids - torch.arange(ids.numel())
            t2d = torch.zeros(self.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            out["t2d"] = t2d
        return {k: v.detach() for k, v in out.items()}

    @torch.no_grad()
    def load_published(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy tensors named as `published_state_dict` (plus ignored extras: embed_tokens, t2d, rotary)."""
        own = self.published_state_dict()
        if "d2t" in tensors:
            self.set_draft_vocab(tensors["d2t"])
        params = dict(self.named_parameters())
        seen = set()
        for name, t in tensors.items():
            if name in ("d2t", "t2d", "embed_tokens.weight") or name.endswith("rotary_emb.inv_freq"):
                continue
            if name not in own:
                raise KeyError(f"EAGLE checkpoint tensor {name!r} has no place in a v{self.eagle.version} head")
            if tuple(own[name].shape) != tuple(t.shape):
                raise ValueError(f"EAGLE checkpoint tensor {name!r} has shape {tuple(t.shape)}, "
                                 f"expected {tuple(own[name].shape)}")
            seen.add(name)
        missing = set(own) - seen - {"d2t", "t2d"}
        if missing:
            raise KeyError(f"EAGLE checkpoint lacks {sorted(missing)[:4]}")
        # write through: own[] are views of the parameters (split chunks are views too)
        for name in seen:
            own[name].copy_(tensors[name].to(own[name].dtype))
        del params


# -- checkpoints --------------------------------------------------------------------------------------
def _read_tensors(d: Path) -> dict[str, torch.Tensor]:
    files = sorted(d.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(d.glob("pytorch_model*.bin"))
    if bins:
        out = {}
        for f in bins:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
        return out
    raise FileNotFoundError(f"{d}: no *.safetensors or pytorch_model*.bin EAGLE weights")


def eagle_config_from(hf: dict, tensors: dict[str, torch.Tensor], target: ModelConfig) -> EagleConfig:
    """The layout is read off the tensor names; shapes from config.json, checked against the tensors."""
    v3 = any(k.startswith("midlayer.") for k in tensors)
    prefix = "midlayer." if v3 else "layers.0."
    if not v3 and not any(k.startswith("layers.0.") for k in tensors):
        raise ValueError("not an EAGLE head: no layers.0.* (EAGLE-1/2) or midlayer.* (EAGLE-3) tensors")
    if "fc.weight" not in tensors:
        raise ValueError("not an EAGLE head: no fc.weight")
    d = dict(hf)
    d["model_type"] = "llama"
    d.setdefault("num_attention_heads", target.num_heads)
    d.setdefault("hidden_size", target.hidden_size)
    d.setdefault("intermediate_size", tensors[prefix + "mlp.gate_proj.weight"].shape[0])
    d.setdefault("vocab_size", target.vocab_size)
    d.setdefault("rope_theta", target.rope_theta)
    d["num_hidden_layers"] = 1
    layer = ModelConfig.from_hf(d)
    layer = replace(layer, attention_bias=prefix + "self_attn.q_proj.bias" in tensors, qk_norm=False,
                    tie_word_embeddings=False)
    h = layer.hidden_size
    fc_in = tensors["fc.weight"].shape[1]
    if v3:
        eagle_cfg = hf.get("eagle_config") or {}
        aux = tuple(eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.num_layers))
        if fc_in != h * len(aux):
            raise ValueError(f"EAGLE-3 fc reads {fc_in} features, {len(aux)} target layers give {h * len(aux)}")
        vd = tensors["lm_head.weight"].shape[0]
        return EagleConfig(3, layer, aux, fc_bias="fc.bias" in tensors, own_norm=True, own_lm_head=True,
                           draft_vocab_size=vd, hf_config=hf)
    if fc_in != 2 * h:
        raise ValueError(f"EAGLE-1/2 fc reads {fc_in} features, expected 2 x hidden = {2 * h}")
    vd = tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else None
    return EagleConfig(1, layer, (target.num_layers - 1,), fc_bias="fc.bias" in tensors,
                       own_norm="norm.weight" in tensors, own_lm_head="lm_head.weight" in tensors,
                       draft_vocab_size=vd, hf_config=hf)


def load_eagle_head(path: str | Path, target: LlamaForCausalLM, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> EagleHead:
    d = Path(path).expanduser()
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: not an EAGLE head folder (no config.json)")
    hf = json.loads((d / "config.json").read_text())
    tensors = _read_tensors(d)
    cfg = eagle_config_from(hf, tensors, target.config)
    tv = target.config.vocab_size
    if "d2t" not in tensors and cfg.own_lm_head and cfg.draft_vocab_size != tv:
        raise ValueError(f"EAGLE lm_head has {cfg.draft_vocab_size} rows but no d2t map to the target's {tv} tokens")
    head = EagleHead(cfg, target)
    head.load_published(tensors)
    ref = target.model.norm.weight  # the activations' device and dtype (the embedding may be GGUF blocks)
    return head.to(device=device or ref.device, dtype=dtype or ref.dtype).eval()


def save_eagle_head(head: EagleHead, path: str | Path, extra_config: dict | None = None) -> Path:
    """config.json (a LlamaConfig dict of the layer, EAGLE-3 fields) + model.safetensors, published names."""
    from safetensors.torch import save_file

    d = Path(path).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    cfg, lc = head.eagle, head.eagle.layer
    hf = {
        "architectures": ["LlamaForCausalLMEagle3" if cfg.version == 3 else "LlamaForCausalLM"],
        "model_type": "llama", "hidden_size": lc.hidden_size, "intermediate_size": lc.intermediate_size,
        "num_attention_heads": lc.num_heads, "num_key_value_heads": lc.num_kv_heads, "head_dim": lc.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": lc.rms_norm_eps, "rope_theta": lc.rope_theta,
        "max_position_embeddings": lc.max_position_embeddings, "vocab_size": head.vocab_size,
        "hidden_act": "silu", "tie_word_embeddings": False, "bias": cfg.fc_bias, "torch_dtype": "float32",
    }
    if lc.rope_scaling:
        hf["rope_scaling"] = lc.rope_scaling_dict
    if cfg.version == 3:
        hf["draft_vocab_size"] = head.draft_vocab_size
        hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers)}
    hf.update(extra_config or {})
    tensors = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous()
               for k, v in head.published_state_dict().items()}
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(hf, indent=2))
    return d
