"""EAGLE heads, drafting and training.

References nobody here wrote: transformers' LlamaDecoderLayer / LlamaAttention / LlamaRotaryEmbedding (the
EAGLE repo's cnets.py builds its layers from the same code) for the head's maths, and plain greedy decoding
with the target for losslessness. Checkpoints are written by the test itself in the published layouts.
"""
from __future__ import annotations

import json
import math
import time

import pytest
import torch
import transformers
from safetensors.torch import save_file

from forerun.config import CacheConfig
from forerun.drafters.base import TreeProposal
from forerun.drafters.eagle import EagleDrafter, TreeLayout
from forerun.drafters.eagle_budget import TreeBudget
from forerun.engine.round import _tree_mask
from forerun.engine.sampler import _depths
from forerun.models.eagle_head import EagleConfig, EagleHead, load_eagle_head, save_eagle_head
from forerun.request import Request
from forerun.runtime.runner import Chunk, ModelRunner
from forerun.sampling_params import SamplingParams
from forerun.structured import ALL_ALLOWED, apply_bitmask_, bitmask_words, grammar_of, tree_node_masks
from forerun.verify import SamplingTensors, verify_tree
from forerun.verify.probs import logits_to_probs, sample_from_probs

from test_verify_common import assert_exact_with_one_point_power
from tiny import hf_model, ours_from_hf

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def random_head(target, version: int, seed: int = 0, draft_vocab: int | None = None) -> EagleHead:
    torch.manual_seed(seed)
    cfg = EagleConfig.for_target(target.config, version=version, draft_vocab_size=draft_vocab)
    head = EagleHead(cfg, target)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 0.15)
    if draft_vocab:  # a reduced vocabulary: a random subset of the target's, in order
        ids = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))
        ids = ids[:draft_vocab].sort().values
        head.set_draft_vocab(ids - torch.arange(draft_vocab))
    return head.eval()


# -- the head's maths against transformers' layers -------------------------------------------------
def _hf_layer(head: EagleHead, tensors: dict[str, torch.Tensor]):
    """The EAGLE head's layer rebuilt from transformers' Llama modules and the published tensors."""
    from transformers.models.llama import modeling_llama as ml

    lc = head.eagle.layer
    cfg = transformers.LlamaConfig(hidden_size=lc.hidden_size, intermediate_size=lc.intermediate_size,
                                   num_attention_heads=lc.num_heads, num_key_value_heads=lc.num_kv_heads,
                                   head_dim=lc.head_dim, rms_norm_eps=lc.rms_norm_eps, rope_theta=lc.rope_theta,
                                   num_hidden_layers=1, vocab_size=head.vocab_size, max_position_embeddings=512)
    cfg._attn_implementation = "eager"
    layer = ml.LlamaDecoderLayer(cfg, 0)
    h = lc.hidden_size
    if head.eagle.version == 3:  # EAGLE-3: q/k/v read [embedding, hidden]
        a = layer.self_attn
        a.q_proj = torch.nn.Linear(2 * h, a.q_proj.out_features, bias=False)
        a.k_proj = torch.nn.Linear(2 * h, a.k_proj.out_features, bias=False)
        a.v_proj = torch.nn.Linear(2 * h, a.v_proj.out_features, bias=False)
    prefix = "layers.0." if head.eagle.version == 1 else "midlayer."
    sd = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and "hidden_norm" not in k}
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    assert not unexpected
    assert missing == (["input_layernorm.weight"] if head.eagle.version == 1 else [])
    if head.eagle.version == 1:
        layer.input_layernorm = torch.nn.Identity()
    return layer.eval(), ml.LlamaRotaryEmbedding(cfg), ml


def reference_outputs(head: EagleHead, tensors: dict[str, torch.Tensor], ids: torch.Tensor, feats: torch.Tensor):
    """EAGLE's forward (cnets.py) over one causal sequence: returns (outputs [T, H], logits over target ids)."""
    layer, rope, ml = _hf_layer(head, tensors)
    target = head.target
    t = ids.shape[0]
    emb = target.model.embed_tokens.weight[ids]  # [T, H]
    pos = torch.arange(t)[None]
    cos, sin = rope(emb[None], pos)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    eps = head.eagle.layer.rms_norm_eps

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    fc = torch.nn.functional.linear
    if head.eagle.version == 1:
        x = fc(torch.cat([emb, feats], -1), tensors["fc.weight"], tensors.get("fc.bias"))
        out = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
        out = (out[0] if isinstance(out, tuple) else out)[0]
        logits = out @ target.lm_head.weight.T if "lm_head.weight" not in tensors else out @ tensors["lm_head.weight"].T
        return out, logits
    x = fc(feats, tensors["fc.weight"])
    inp = torch.cat([rms(emb, tensors["midlayer.input_layernorm.weight"]),
                     rms(x, tensors["midlayer.hidden_norm.weight"])], -1)[None]
    a = layer.self_attn(inp, position_embeddings=(cos, sin), attention_mask=mask)[0][0]
    h1 = x + a
    out = h1 + layer.mlp(layer.post_attention_layernorm(h1[None]))[0]
    draft = rms(out, tensors["norm.weight"]) @ tensors["lm_head.weight"].T
    full = torch.full((t, head.vocab_size), float("-inf"))
    full[:, torch.arange(draft.shape[1]) + tensors["d2t"]] = draft
    return out, full


def paged_outputs(head: EagleHead, ids: torch.Tensor, feats: torch.Tensor, split: int = 3):
    """The head's paged forward, fed in two chunks (a prefix, then the rest) through its own runner."""
    runner = ModelRunner(head, CacheConfig(block_size=4, num_blocks=64), "cpu", torch.float32)
    runner.kv.add_sequence(0)
    outs, logits = [], []
    for lo, hi in ((0, split), (split, ids.shape[0])):
        step = runner.prepare([Chunk(0, ids[lo:hi].tolist(), logits="all")])
        with torch.inference_mode():
            o, lg = head(step.input_ids, feats[lo:hi], step.positions, step.meta, runner.kv, True,
                         rows=step.logits_indices)
        runner.kv.set_length(0, hi)
        outs.append(o)
        logits.append(head.to_target_vocab(lg))
    return torch.cat(outs), torch.cat(logits)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("version", [1, 3])
def test_head_matches_transformers_layers(arch, version, tmp_path):
    target = ours_from_hf(hf_model(arch)).model
    head = random_head(target, version, draft_vocab=40 if version == 3 else None)
    save_eagle_head(head, tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    torch.manual_seed(1)
    ids = torch.randint(0, target.config.vocab_size, (9,))
    feats = torch.randn(9, head.eagle.feature_size)
    ref_out, ref_logits = reference_outputs(head, tensors, ids, feats)
    out, logits = paged_outputs(head, ids, feats)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the training forward is the same function
        dense = head.forward_dense(ids[None], feats[None], from_target=True)[0]
    torch.testing.assert_close(dense, ref_out, rtol=1e-4, atol=1e-4)


# -- published layouts ------------------------------------------------------------------------------
def _write(path, tensors, config, fmt):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    else:
        torch.save(tensors, path / "pytorch_model.bin")


def test_loads_eagle1_repo_layout(tmp_path):
    """EAGLE-1/2 (SafeAILab/EAGLE): pytorch_model.bin with fc.weight/bias, layers.0.* (no input_layernorm),
    embed_tokens.weight; a LlamaConfig config.json."""
    target = ours_from_hf(hf_model("llama")).model
    cfg = target.config
    h, kvh, d, inter = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, 96
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    tensors = {"fc.weight": r(h, 2 * h), "fc.bias": r(h), "embed_tokens.weight": target.model.embed_tokens.weight.clone(),
               "layers.0.self_attn.q_proj.weight": r(h, h), "layers.0.self_attn.k_proj.weight": r(kvh * d, h),
               "layers.0.self_attn.v_proj.weight": r(kvh * d, h), "layers.0.self_attn.o_proj.weight": r(h, h),
               "layers.0.mlp.gate_proj.weight": r(inter, h), "layers.0.mlp.up_proj.weight": r(inter, h),
               "layers.0.mlp.down_proj.weight": r(h, inter), "layers.0.post_attention_layernorm.weight": 1 + r(h)}
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": inter,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": kvh, "num_hidden_layers": 1,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": cfg.vocab_size, "bias": True}
    _write(tmp_path / "e1", tensors, config, "bin")
    head = load_eagle_head(tmp_path / "e1", target)
    assert head.eagle.version == 1 and head.eagle.fc_bias and head.lm_head is None
    assert head.eagle.aux_layers == (cfg.num_layers - 1,)
    ids, feats = torch.arange(2, 9), torch.randn(7, h)
    ref_out, ref_logits = reference_outputs(head, tensors, ids, feats)
    out, logits = paged_outputs(head, ids, feats)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    # round trip in the same layout
    save_eagle_head(head, tmp_path / "rt")
    again = load_eagle_head(tmp_path / "rt", target)
    torch.testing.assert_close(paged_outputs(again, ids, feats)[1], logits)


def test_loads_specforge_eagle3_layout(tmp_path):
    """EAGLE-3 / SpecForge: model.safetensors with fc.weight [H, 3H], midlayer.* (hidden_norm, q/k/v over 2H),
    norm, lm_head over a draft vocabulary, d2t offsets, t2d mask; eagle_config names the target layers."""
    target = ours_from_hf(hf_model("qwen2")).model
    cfg = target.config
    h, kvh, d, inter, vd = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, 80, 30
    g = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    draft_ids = torch.randperm(cfg.vocab_size, generator=g)[:vd].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {"fc.weight": r(h, 3 * h), "midlayer.hidden_norm.weight": 1 + r(h),
               "midlayer.input_layernorm.weight": 1 + r(h), "midlayer.post_attention_layernorm.weight": 1 + r(h),
               "midlayer.self_attn.q_proj.weight": r(h, 2 * h), "midlayer.self_attn.k_proj.weight": r(kvh * d, 2 * h),
               "midlayer.self_attn.v_proj.weight": r(kvh * d, 2 * h), "midlayer.self_attn.o_proj.weight": r(h, h),
               "midlayer.mlp.gate_proj.weight": r(inter, h), "midlayer.mlp.up_proj.weight": r(inter, h),
               "midlayer.mlp.down_proj.weight": r(h, inter), "norm.weight": 1 + r(h), "lm_head.weight": r(vd, h),
               "d2t": draft_ids - torch.arange(vd), "t2d": t2d}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": cfg.num_heads, "num_key_value_heads": kvh,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": cfg.rope_theta,
              "vocab_size": cfg.vocab_size, "draft_vocab_size": vd,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    _write(tmp_path / "e3", tensors, config, "safetensors")
    head = load_eagle_head(tmp_path / "e3", target)
    assert head.eagle.version == 3 and head.eagle.aux_layers == (0, 1, 2) and head.draft_vocab_size == vd
    ids, feats = torch.arange(3, 11), torch.randn(8, 3 * h)
    ref_out, ref_logits = reference_outputs(head, tensors, ids, feats)
    out, logits = paged_outputs(head, ids, feats)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert set(logits[0].isfinite().nonzero().squeeze(1).tolist()) == set(draft_ids.tolist())
    save_eagle_head(head, tmp_path / "rt")
    again = load_eagle_head(tmp_path / "rt", target)
    torch.testing.assert_close(paged_outputs(again, ids, feats)[1], logits)


def test_bad_checkpoints_say_why(tmp_path):
    target = ours_from_hf(hf_model("llama")).model
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_eagle_head(tmp_path, target)
    _write(tmp_path / "x", {"foo": torch.zeros(2)}, {"hidden_size": 64}, "safetensors")
    with pytest.raises(ValueError, match="not an EAGLE head"):
        load_eagle_head(tmp_path / "x", target)


# -- drafting: lossless greedy through a round that mimics the engine's ------------------------------
def _request(rid, prompt, temperature=0.0, seed=0, max_tokens=64):
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    return Request(rid, None, list(prompt), params, torch.Generator().manual_seed(seed), frozenset())


def run_rounds(target: ModelRunner, drafter: EagleDrafter, requests: list[Request], new_tokens: int, k: int = 3,
               tree: bool = False, max_drafts=None) -> dict:
    """A minimal engine: propose -> one target forward (with hidden states) -> greedy / exact verify ->
    truncate caches -> hand the committed tokens' states to the drafter. Returns acceptance stats.
    max_drafts: request -> the node cap a tree round passes (as Engine._k_for does), None: none passed."""
    kv = target.kv
    layers = drafter.target_hidden_layers
    stats = {"rounds": 0, "accepted": 0, "drafted": 0, "request_rounds": 0}
    for r in requests:
        kv.add_sequence(r.req_id)
    live = list(requests)
    while live:
        chunks, info = [], []
        if tree:
            prop = drafter.propose_tree(live, None if max_drafts is None else [max_drafts(r) for r in live])
            for r, toks, par in zip(live, prop.tokens, prop.parents):
                catch = r.all_tokens[kv.length(r.req_id):-1]
                c, n, root = len(catch), len(toks), r.num_tokens - 1
                depth = [0] * n
                anc = torch.zeros(n, n, dtype=torch.bool)
                for j in range(n):
                    depth[j] = 0 if par[j] < 0 else depth[par[j]] + 1
                    a = j
                    while a >= 0:
                        anc[j, a] = True
                        a = par[a]
                full = torch.zeros(c + n, c + n, dtype=torch.bool)
                full[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
                full[c:, :c] = True
                full[c:, c:] = anc
                chunks.append(Chunk(r.req_id, catch + toks, positions=list(range(root - c, root)) +
                                    [root + d for d in depth], tree_mask=full, logits=n))
                info.append((c, n))
        else:
            prop = drafter.propose(live, [k] * len(live))
            for r, d in zip(live, prop.tokens):
                catch = r.all_tokens[kv.length(r.req_id):]
                chunks.append(Chunk(r.req_id, catch + d, logits=len(d) + 1))
                info.append((len(catch), len(d)))
        bases = [kv.length(r.req_id) for r in live]
        out, starts = target.forward(chunks, hidden_layers=layers)
        hs = out.hidden_states
        row0 = 0
        states, st_starts, emitted_all = [], [], []
        if tree and all(len(t) == 1 for t in prop.tokens):  # no tree anywhere (first round): plain greedy
            for i, r in enumerate(live):
                c, n = info[i]
                states.append({l: hs[l][row0: row0 + c + 1] for l in layers})
                st_starts.append(bases[i])
                emitted_all.append([int(out.logits[starts[i]].argmax())])
                row0 += c + n
        elif tree:
            res = verify_tree(out.logits, torch.tensor([t for toks in prop.tokens for t in toks]),
                              torch.tensor([p for par in prop.parents for p in par]), torch.tensor(starts),
                              torch.tensor([len(t) for t in prop.tokens]),
                              SamplingTensors.from_params([r.params for r in live]),
                              torch.cat([torch.rand(len(t), 2, generator=r.generator) for r, t in zip(live, prop.tokens)]),
                              draft_probs=torch.cat(prop.probs), rule="auto")
            for i, r in enumerate(live):
                c, n = info[i]
                a = int(res.num_accepted[i])
                path = res.accepted_nodes[i, : a + 1].tolist()
                root = r.num_tokens - 1
                kv.move(r.req_id, [root + j for j in path[1:]], [root + j for j in range(1, a + 1)])
                rows = list(range(row0, row0 + c)) + [row0 + c + j for j in path]
                states.append({l: hs[l][rows] for l in layers})
                st_starts.append(bases[i])
                emitted_all.append(res.output_token_ids[i, : a + 1].tolist())
                kv.truncate(r.req_id, root + a + 1)
                stats["drafted"] += 1
                stats["accepted"] += a
                row0 += c + n
        else:
            for i, r in enumerate(live):
                c, nd = info[i]
                d = prop.tokens[i]
                am = out.logits[starts[i]: starts[i] + nd + 1].argmax(-1).tolist()
                a = 0
                while a < nd and d[a] == am[a]:
                    a += 1
                valid = bases[i] + c + a
                states.append({l: hs[l][row0: row0 + c + a] for l in layers})
                st_starts.append(bases[i])
                emitted_all.append(d[:a] + [am[a]])
                kv.truncate(r.req_id, valid)
                stats["drafted"] += nd
                stats["accepted"] += a
                row0 += c + nd
        for r, e in zip(live, emitted_all):
            r.output_token_ids.extend(e)
        drafter.observe_target(live, states, st_starts)
        for r in live:
            drafter.rollback(r, kv.length(r.req_id))
            assert drafter.cached_length(r) <= kv.length(r.req_id)
        stats["rounds"] += 1
        stats["request_rounds"] += len(live)
        lim = {id(r): min(new_tokens, r.params.max_tokens or new_tokens) for r in live}  # (as _commit cuts)
        done = [r for r in live if len(r.output_token_ids) >= lim[id(r)]]
        for r in done:
            r.output_token_ids[:] = r.output_token_ids[:lim[id(r)]]
            drafter.release(r)
            kv.free(r.req_id)
        live = [r for r in live if r not in done]
    return stats


def plain_greedy(target: ModelRunner, prompt: list[int], n: int) -> list[int]:
    rid = 10_000
    target.kv.add_sequence(rid)
    out, _ = target.forward([Chunk(rid, list(prompt))])
    toks = [int(out.logits[-1].argmax())]
    while len(toks) < n:
        out, _ = target.forward([Chunk(rid, [toks[-1]])])
        toks.append(int(out.logits[-1].argmax()))
    target.kv.free(rid)
    return toks


@pytest.mark.parametrize("version,tree,eager", [(1, False, 64), (3, False, 64), (1, True, 64), (3, True, 64),
                                                (3, False, 1), (1, True, 2)])
def test_greedy_is_lossless_tiny(version, tree, eager):
    """eager: observe_target feeds the head at once when this many rows are pending (prefill chunks)."""
    hf = hf_model("qwen2")
    target = ours_from_hf(hf, num_blocks=512)
    head = random_head(target.model, version, draft_vocab=50 if version == 3 else None)
    drafter = EagleDrafter(target, head, cache=CacheConfig(block_size=4, num_blocks=512), tree_topk=3,
                           tree_steps=3, tree_nodes=8)
    drafter.eager_rows = eager
    prompts = [[5, 6, 7, 8, 9], [11, 3, 90, 2, 2, 2, 40, 41], [60, 61]]
    reqs = [_request(i, p) for i, p in enumerate(prompts)]
    run_rounds(target, drafter, reqs, 24, k=3, tree=tree)
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == plain_greedy(target, p, 24)
    assert drafter.cache.kv.num_free_blocks == drafter.cache.kv.num_blocks - 1  # everything given back


def test_rows_pair_token_with_previous_feature():
    """EAGLE-1 with fc = [0, I] and a silent layer returns its input feature, so its first draft is
    lm_head(norm(f_{N-1})) = the target's own choice of x_N, the token just emitted: checks that the last row
    pairs the newest token with the feature before it (EAGLE's shift) and that the cache keeps rows < N-1."""
    hf = hf_model("llama")
    target = ours_from_hf(hf, num_blocks=512)
    head = random_head(target.model, 1)
    h = target.config.hidden_size
    with torch.no_grad():  # out = fc([emb, f]) = f; attention and MLP contribute nothing
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.eye(h)
        head.fc.bias.zero_()
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    drafter = EagleDrafter(target, head, cache=CacheConfig(block_size=4, num_blocks=256))
    req = _request(0, [5, 6, 7, 8])
    target.kv.add_sequence(0)
    out, _ = target.forward([Chunk(0, req.all_tokens)], hidden_layers=drafter.target_hidden_layers)
    req.output_token_ids.append(int(out.logits[-1].argmax()))
    drafter.observe_target([req], [{l: v for l, v in out.hidden_states.items()}], [0])
    prop = drafter.propose([req], [1])
    # the first draft is lm_head(f_{N-1}): the target's own prediction of x_N, i.e. the token just emitted
    assert prop.tokens[0] == [req.output_token_ids[-1]]
    assert drafter.cached_length(req) == req.num_tokens - 2


# -- sampled trees stay exact ----------------------------------------------------------------------------
def _first_token_counts(n: int, capped: bool = False, batch: int = 500) -> tuple[torch.Tensor, torch.Tensor]:
    """n independent single rounds at temperature 1 from one context, each with a fresh sampled EAGLE-3 tree
    verified by the exact rule: counts of the token emitted right after the root, and the target's p. The rounds
    run `batch` requests at a time (one batched tree drafting, one target forward over every tree, one verify_tree
    call), each request with its own seed.
    capped: each counted request has 2 tokens left and a node cap of 2 (its tree: the root and the first 2 of the
    3 children drawn, depth 1) while an uncapped request beside it in the batch grows the full layout (grow_tree's
    per-request caps)."""
    hf = hf_model("llama", vocab_size=12)
    target = ours_from_hf(hf, num_blocks=8 * batch + 64, max_seqs=2 * batch + 8)
    head = random_head(target.model, 3, draft_vocab=10)
    drafter = EagleDrafter(target, head, cache=CacheConfig(block_size=4, num_blocks=8 * batch + 64), tree_topk=3,
                           tree_steps=2, tree_nodes=6, max_seqs=2 * batch + 8)
    prompt = [3, 4, 5]
    with torch.inference_mode():
        target.kv.add_sequence(10**7)
        out, _ = target.forward([Chunk(10**7, prompt + [7])])
        target.kv.free(10**7)
    p = torch.softmax(out.logits[-1].double(), -1)  # the target's distribution after prompt + [7]
    with torch.inference_mode():
        target.kv.add_sequence(10**7)
        o, _ = target.forward([Chunk(10**7, prompt, logits="none")], hidden_layers=drafter.target_hidden_layers)
        target.kv.free(10**7)
    counts = torch.zeros(12)
    sizes = 0
    for s0 in range(0, n, batch):
        reqs = []
        for s in range(s0, min(n, s0 + batch)):
            r = _request(s, prompt, temperature=1.0, seed=s)
            r.output_token_ids.append(7)
            if capped:
                r.params = SamplingParams(temperature=1.0, max_tokens=3, seed=s)
            reqs.append(r)
        others = []
        if capped:
            for s in range(s0, s0 + len(reqs)):
                other = _request(10**6 + s, prompt, temperature=1.0, seed=10**6 + s)
                other.output_token_ids.append(7)
                others.append(other)
        both = [x for pair in zip(reqs, others) for x in pair] if capped else reqs
        for r in reqs:
            target.kv.add_sequence(r.req_id)
        drafter.observe_target(both, [o.hidden_states] * len(both), [0] * len(both))
        prop = drafter.propose_tree(both, [2, 5] * len(reqs) if capped else None)
        for other in others:
            drafter.release(other)
        if capped:
            for i in range(len(reqs)):
                assert len(prop.tokens[2 * i + 1]) == 6 and max(_depths(prop.parents[2 * i + 1])) == 2
                assert len(prop.tokens[2 * i]) == 3 and prop.probs[2 * i][1:].abs().sum() == 0  # leaves: zero rows
            prop = TreeProposal(prop.tokens[::2], prop.parents[::2], prop.probs[::2])
        toks, pars = prop.tokens, prop.parents
        assert all(len(t) <= 6 for t in toks)
        sizes += sum(len(t) for t in toks)
        with torch.inference_mode():
            o2, _ = target.forward([_tree_chunk(r, t, q) for r, t, q in zip(reqs, toks, pars)])
        lens = torch.tensor([len(t) for t in toks])
        res = verify_tree(o2.logits, torch.tensor([x for t in toks for x in t]),
                          torch.tensor([x for q in pars for x in q]), torch.cumsum(lens, 0) - lens, lens,
                          SamplingTensors.from_params([r.params for r in reqs]),
                          torch.cat([torch.rand(len(t), 2, generator=r.generator) for r, t in zip(reqs, toks)]),
                          draft_probs=torch.cat(prop.probs), rule="auto")
        counts += torch.bincount(res.output_token_ids[:, 0], minlength=12)[:12].float()
        for r in reqs:
            target.kv.free(r.req_id)
            drafter.release(r)
    assert counts.sum() == n
    assert sizes > (2 if capped else 4) * n  # real trees, not just roots
    return counts, p


@pytest.fixture
def one_thread():
    """Thousands of tiny forwards: one thread avoids the spin-waits of two on a loaded 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_sampled_tree_is_exact_chi_square(one_thread):
    """The drafting scheme for sampled requests (i.i.d. children, no pruning by value) keeps the exact rule
    lossless: the first emitted token follows the target (chi-square over 60000 rounds, which resolve a 1-point
    bias; the power check below shows a wrong scheme is off by 4-20 points per token)."""
    counts, p = _first_token_counts(60000)
    assert_exact_with_one_point_power(counts, p)


def test_capped_sampled_tree_is_exact_chi_square(one_thread):
    """The same check for a tree cut to fit its request (depth and node caps, in a batch with an uncapped tree)."""
    counts, p = _first_token_counts(60000, capped=True)
    assert_exact_with_one_point_power(counts, p)


def test_sampled_tree_power_check(monkeypatch, one_thread):
    """Power: drafting the sampled tree's children as deterministic top-k (EAGLE's greedy scheme) while
    verifying with the exact rule is biased, and the same chi-square test catches it (with fewer draws)."""
    from scipy.stats import chisquare

    import forerun.drafters.eagle as eagle_mod

    def top_children(q, u):  # q: [parents x 3, V], each parent's row repeated for its 3 draws
        return q.view(-1, 3, q.shape[1])[:, 0].topk(3, dim=-1).indices.reshape(-1)

    monkeypatch.setattr(eagle_mod, "sample_from_probs", top_children)
    counts, p = _first_token_counts(1000)
    assert chisquare(counts.numpy(), (p * counts.sum()).numpy()).pvalue < 1e-6


def _tree_chunk(r, toks, par) -> Chunk:
    """The target's verify chunk for request r's draft tree (toks, par): the tree after its committed tokens."""
    n = len(toks)
    anc = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for j in range(n):
        depth[j] = 0 if par[j] < 0 else depth[par[j]] + 1
        a = j
        while a >= 0:
            anc[j, a] = True
            a = par[a]
    c = r.num_tokens - 1
    full = torch.zeros(c + n, c + n, dtype=torch.bool)
    full[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
    full[c:, :c] = True
    full[c:, c:] = anc
    return Chunk(r.req_id, r.all_tokens[:-1] + toks, positions=list(range(c)) + [c + d for d in depth],
                 tree_mask=full, logits=n)


# -- the host-built tree: the reference the device tree must equal ---------------------------------------------
class HostTreeDrafter(EagleDrafter):
    """The dynamic tree as it was built on the host before the device version (one host read per step, Python
    trees), kept here as the oracle: same nodes, parents, scores, draws."""

    def propose_tree(self, requests: list[Request], max_drafts: list[int] | None = None) -> TreeProposal:
        v = self.head.vocab_size
        ranges = [self._feed_range(r) for r in requests]
        # each tree fits its request: at most remaining - 1 levels and max_drafts[i] nodes beyond the root
        md = [None if max_drafts is None else max_drafts[i] for i in range(len(requests))]
        dcap = [max(0, min(r.remaining - 1, 10**9 if m is None else m)) for r, m in zip(requests, md)]
        live = [i for i, rng in enumerate(ranges) if rng is not None and dcap[i] > 0]
        trees = [_HostTree(r.all_tokens[-1]) for r in requests]
        t_steps = []
        shape = self.budget.choose(len(live)) if self.budget is not None and live else \
            TreeBudget(self.tree_topk, self.tree_steps, self.tree_nodes)
        topk, n_steps, n_nodes = shape.topk, shape.steps, shape.nodes
        dcap = [min(d, n_steps) for d in dcap]
        ncap = [n_nodes - 1 if m is None else min(n_nodes - 1, m) for m in md]
        if live:  # the batch grows the deepest and largest tree any of its requests keeps
            n_steps, n_nodes = max(dcap[i] for i in live), min(n_nodes, 1 + max(ncap[i] for i in live))
        reduced = (n_steps, n_nodes) != (shape.steps, shape.nodes)
        if live and shape.drafts:
            group = [requests[i] for i in live]
            t = time.perf_counter()
            out, logits = self._extend(group, [ranges[i] for i in live])
            bank = out  # every step's outputs, stacked: a node's children's feature is row tree.hidden[node]
            self._grow(group, [trees[i] for i in live], [[0] for _ in live], out, logits, topk, n_nodes, 0)
            if self.budget is not None:
                self.budget.record_head_step(sum(n - lo for lo, n in (ranges[i] for i in live)), time.perf_counter() - t)
            for step in range(1, n_steps):
                t = time.perf_counter()
                chunks, feat_rows, sel_rows, owners = [], [], [], []
                for i in live:
                    tree, r = trees[i], requests[i]
                    sel = tree.frontier(step, topk, r.params.temperature > 0, n_nodes)
                    if not sel:
                        continue
                    nodes = tree.closure(sel)  # non-root ancestors-or-self, by depth: sel last
                    root = r.num_tokens - 1
                    chunks.append(Chunk(r.req_id, [tree.tok[j] for j in nodes],
                                        positions=[root - 1 + tree.depth[j] for j in nodes],
                                        tree_mask=tree.mask(nodes), logits=len(sel)))
                    feat_rows += [tree.hidden[tree.parent[j]] for j in nodes]
                    owners.append(i)
                    sel_rows.append(sel)
                if not chunks:
                    break
                feats = bank.index_select(0, torch.tensor(feat_rows, device=bank.device))  # one gather for all
                out, logits = self._run(chunks, feats, from_target=False)
                for i in owners:  # the tree rows are scratch: back to the committed rows
                    self.cache.kv.truncate(requests[i].req_id, requests[i].num_tokens - 1)
                base = bank.shape[0]
                bank = torch.cat([bank, out])
                self._grow([requests[i] for i in owners], [trees[i] for i in owners], sel_rows, out, logits, topk,
                           n_nodes, base)
                t_steps.append(time.perf_counter() - t)
                if self.budget is not None:
                    self.budget.record_head_step(sum(len(c.token_ids) for c in chunks), t_steps[-1])
            self._settle(group)
        toks, parents, probs = [], [], []
        sampled_values = 0
        for r, tree, d, c in zip(requests, trees, dcap, ncap):
            if r.params.temperature == 0:  # the best candidates of depth <= its cap
                keep = tree.keep(min(n_nodes, 1 + c), d)
                if self.tree_confidence > 0:  # those of cumulative draft probability >= it (the root always)
                    keep = [j for j in keep if j == 0 or tree.score[j] >= math.log(self.tree_confidence)]
            else:  # the first nodes drawn (their count fixed before the draws), no deeper than its cap
                keep = [j for j in range(len(tree.tok)) if tree.depth[j] <= d][: 1 + c]
            if self.budget is not None and r.params.temperature == 0 and len(keep) > 1:
                self._outcome[r.req_id] = (r.num_tokens, sum(math.exp(tree.score[j]) for j in keep[1:]))
                if sampled_values < self.budget.sample_trees and not reduced:  # V of every sub-shape of this tree
                    self.budget.record_values(self.budget.tree_values(tree.parent, tree.depth, tree.score, tree.rank))
                    sampled_values += 1
            index = {j: a for a, j in enumerate(keep)}
            toks.append([tree.tok[j] for j in keep])
            parents.append([index[tree.parent[j]] if tree.parent[j] >= 0 else -1 for j in keep])
            if r.params.temperature > 0:
                rows = torch.zeros(len(keep), v, device=self.cache.device)
                for a, j in enumerate(keep):
                    if tree.q.get(j) is not None and any(tree.parent[c] == j for c in keep):
                        rows[a] = tree.q[j].float()
            else:  # never read (greedy verification): one zero row, broadcast, on the device
                rows = torch.zeros(1, v, device=self.cache.device).expand(len(keep), v)
            probs.append(rows)
        if self.budget is not None:
            self._proposed = (time.perf_counter(), {r.req_id: len(t) for r, t in zip(requests, toks)})
        return TreeProposal(toks, parents, probs, step_seconds=sum(t_steps) / len(t_steps) if t_steps else None)

    def _grow(self, reqs: list[Request], trees: list["_HostTree"], expanded: list[list[int]], out: torch.Tensor,
              draft_logits: torch.Tensor, topk: int, budget: int, base: int) -> None:
        """Children of the expanded nodes (rows of out / logits in order): top-k (greedy) or i.i.d. draws;
        topk children per node, budget nodes in all (sampled trees). An expanded node's output (its children's
        feature) is row base + its row of the proposal's output bank."""
        row_req = [a for a, sel in enumerate(expanded) for _ in sel]
        k = min(topk, self.head.draft_vocab_size)
        q = None
        states = [grammar_of(r) for r in reqs]
        constrained = any(st is not None for st in states)
        if all(reqs[a].params.temperature == 0 for a in row_req) and not constrained:
            # greedy rows only: top-k over the draft vocabulary (the target's other tokens are -inf), no
            # target-vocabulary tensors
            top = draft_logits.float().log_softmax(-1).topk(k, dim=-1)
            ids = self.head.draft_to_target[top.indices]
        else:
            full = self.head.to_target_vocab(draft_logits)  # [rows, V]
            if constrained:  # issue 14: each expanded node's children from q masked by the grammar after its path
                words = bitmask_words(full.shape[-1])
                apply_bitmask_(full, torch.cat([
                    tree_node_masks(states[a], trees[a].tok, trees[a].parent, [node]) if states[a] is not None
                    else torch.full((1, words), ALL_ALLOWED, dtype=torch.int32)
                    for a, sel in enumerate(expanded) for node in sel]))
            st = SamplingTensors.from_params([reqs[a].params for a in row_req], full.device)
            q = logits_to_probs(full, st.temperature, st.top_k, st.top_p, st.min_p)
            top = full.log_softmax(-1).topk(k, dim=-1)
            ids = top.indices
        top_ids, top_lp = ids.tolist(), top.values.tolist()  # one host read for every row
        row = 0
        for a, (r, tree, sel) in enumerate(zip(reqs, trees, expanded)):
            for node in sel:
                tree.hidden[node] = base + row
                if r.params.temperature == 0:
                    for tok, lp in zip(top_ids[row], top_lp[row]):
                        tree.add(node, tok, tree.score[node] + lp)
                else:
                    m = min(k, budget - len(tree.tok))
                    if m > 0:
                        tree.q[node] = q[row]
                        u = torch.rand(m, generator=r.generator).to(q.device)
                        drawn = sample_from_probs(q[row].expand(m, -1), u)
                        lq = q[row][drawn].clamp_min(1e-30).log()
                        for tok, lp in zip(drawn.tolist(), lq.tolist()):
                            tree.add(node, tok, tree.score[node] + lp)
                row += 1


class _HostTree:
    """A request's growing draft tree: node 0 is the root (the newest committed token)."""

    def __init__(self, root_token: int) -> None:
        self.tok, self.parent, self.depth, self.score = [root_token], [-1], [0], [0.0]
        self.rank = [0]  # a node's index among its parent's children (greedy: its top-k rank)
        self._nchild: dict[int, int] = {}
        self.hidden: dict[int, int] = {}  # node -> row of its head output (its children's feature) in the bank
        self.q: dict[int, torch.Tensor] = {}  # node -> processed draft distribution its children were drawn from

    def add(self, parent: int, token: int, score: float) -> None:
        self.tok.append(token)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.score.append(score)
        self.rank.append(self._nchild.get(parent, 0))
        self._nchild[parent] = self.rank[-1] + 1

    def frontier(self, depth: int, width: int, sampled: bool, budget: int) -> list[int]:
        """The `width` best nodes at `depth` (by cumulative log-probability) to expand next. A sampled tree
        stops expanding when its node budget is spent (a greedy one is pruned afterwards)."""
        if sampled and len(self.tok) >= budget:
            return []
        level = [j for j, d in enumerate(self.depth) if d == depth]
        return sorted(sorted(level, key=lambda j: -self.score[j])[:width])

    def closure(self, sel: list[int]) -> list[int]:
        nodes = set()
        for j in sel:
            while j > 0:
                nodes.add(j)
                j = self.parent[j]
        return sorted(nodes, key=lambda j: (self.depth[j], j))

    def mask(self, nodes: list[int]) -> torch.Tensor:
        """[n, n] bool: row a sees b iff nodes[b] is nodes[a] or one of its ancestors."""
        pos = {j: a for a, j in enumerate(nodes)}
        m = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)
        for a, j in enumerate(nodes):
            while j > 0:
                m[a, pos[j]] = True
                j = self.parent[j]
        return m

    def keep(self, budget: int, max_depth: int | None = None) -> list[int]:
        """SGLang's final selection: the budget - 1 best non-root nodes (of depth <= max_depth), ancestor-closed (a
        parent scores at least its child's score and sorts first on ties), returned breadth first."""
        order = sorted((j for j in range(1, len(self.tok)) if max_depth is None or self.depth[j] <= max_depth),
                       key=lambda j: (-self.score[j], self.depth[j], j))
        kept = {0}
        for j in order:
            if len(kept) >= budget:
                break
            if self.parent[j] in kept:
                kept.add(j)
        return sorted(kept, key=lambda j: (self.depth[j], j))


class Twin:
    """Drives the device drafter and the host reference side by side through `run_rounds`: every proposal
    must give the same tree (nodes, parents, tokens; the draws of sampled trees; the device's verify mask and
    depths equal those built on the host from its parents)."""

    def __init__(self, device: EagleDrafter, host: HostTreeDrafter) -> None:
        self.d, self.h = device, host
        self.target_hidden_layers = device.target_hidden_layers
        self.trees = 0
        self.sizes: list[int] = []  # each live tree's node count, and its request's id
        self.owners: list[int] = []

    def propose_tree(self, requests, max_drafts=None):
        states = [r.generator.get_state() for r in requests]
        pd = self.d.propose_tree(requests, max_drafts)
        after = [r.generator.get_state() for r in requests]
        for r, st in zip(requests, states):
            r.generator.set_state(st)
        ph = self.h.propose_tree(requests, max_drafts)
        for r, st in zip(requests, after):
            assert torch.equal(r.generator.get_state(), st)  # the same draws, in the same order
        assert pd.tokens == ph.tokens
        assert pd.parents == ph.parents
        for i, r in enumerate(requests):  # the caps, checked apart from the oracle (which shares grow_tree's rule)
            if len(pd.tokens[i]) > 1:
                assert max(_depths(pd.parents[i])) <= r.remaining - 1, (i, r.remaining, pd.parents[i])
            if max_drafts is not None and max_drafts[i] is not None:
                assert len(pd.tokens[i]) <= 1 + max_drafts[i], (i, max_drafts[i], len(pd.tokens[i]))
        tree = self.d.last_tree
        live = [i for i, t in enumerate(pd.tokens) if len(t) > 1]
        for a, i in enumerate(live):
            n = len(pd.tokens[i])
            assert torch.equal(tree.mask[a, :n, :n].cpu(), _tree_mask(pd.parents[i]))
            assert tree.depth[a, :n].tolist() == _depths(pd.parents[i])
            if requests[i].params.temperature > 0:
                torch.testing.assert_close(pd.probs[i], ph.probs[i], rtol=1e-4, atol=1e-6)  # float rounding only
            self.sizes.append(n)
            self.owners.append(requests[i].req_id)
        self.trees += len(live)
        return pd

    def observe_target(self, *a):
        self.d.observe_target(*a)
        self.h.observe_target(*a)

    def rollback(self, r, n):
        self.d.rollback(r, n)
        self.h.rollback(r, n)

    def release(self, r):
        self.d.release(r)
        self.h.release(r)

    def cached_length(self, r):
        a, b = self.d.cached_length(r), self.h.cached_length(r)
        assert a == b
        return a


def _twins(target, head, topk, steps, nodes, **kw):
    mk = lambda cls: cls(target, head, cache=CacheConfig(block_size=4, num_blocks=512), tree_topk=topk,  # noqa: E731
                         tree_steps=steps, tree_nodes=nodes, **kw)
    return Twin(mk(EagleDrafter), mk(HostTreeDrafter))


def calibrate(head, q: list[float]) -> None:
    """Logits that put q_r on K tokens chosen from the row's input token (so each node's children differ) and
    spread the rest evenly: every node's children have the same probabilities, so cumulative scores tie
    exactly across paths (r1, r2) and (r2, r1) and the tie-breaks decide the tree.
    (Exact only as far as torch's log_softmax rounds every such row alike: it does not, by 1 ulp across shapes and
    positions; the oracle shares the device path's torch ops, so both break the same near-ties.)"""
    forward = head.forward
    k = len(q)

    def calibrated(input_ids, feats, positions, meta, kv, from_target, rows=None):
        out, logits = forward(input_ids, feats, positions, meta, kv, from_target, rows=rows)
        ids = input_ids if rows is None else input_ids[rows]
        rows_, vd = logits.shape
        rest = max(1.0 - sum(q), 1e-6) / max(vd - k, 1)
        fake = torch.full((rows_, vd), math.log(rest), dtype=torch.float32)
        top = (ids.cpu()[:, None] * 7 + torch.arange(k)[None, :] * 13 + 1) % vd
        fake.scatter_(1, top, torch.tensor([math.log(x) for x in q]).expand(rows_, k))
        return out, fake.to(logits.device)

    head.forward = calibrated


TREES = [(3, 3, 8), (4, 4, 16), (2, 5, 12), (1, 4, 5), (4, 2, 30), (3, 1, 4)]


@pytest.mark.parametrize("topk,steps,nodes", TREES)
@pytest.mark.parametrize("version,batch", [(3, 1), (3, 3), (1, 2)])
def test_device_tree_equals_host_tree(topk, steps, nodes, version, batch):
    """Greedy dynamic trees on random heads, several rounds each (extends after acceptance, ragged batches): the
    device tree is the host-built one, node for node."""
    _device_tree_equals_host_tree(topk, steps, nodes, version, batch)


@pytest.fixture
def fused_tree(monkeypatch):
    """grow_tree's greedy bookkeeping in forerun/kernels/eagle_tree.py's Triton kernels (CUDA's default; on the CPU
    under Triton's interpreter)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():  # these trees live on the CPU: the interpreter is off beside a GPU
        pytest.skip("CPU trees through the kernels need the interpreter; on CUDA: tests/test_gpu.py")
    monkeypatch.setenv("FORERUN_EAGLE_FUSED", "1")
    import forerun.drafters.eagle as E

    calls = []
    real = E._grow_tree_fused
    monkeypatch.setattr(E, "_grow_tree_fused", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    buffers = E._tree_buffers

    def poisoned(lay, root_out, anc_dtype, init=True):  # the fused path's empty state filled with garbage: a read
        out = buffers(lay, root_out, anc_dtype, init)  # of anything not written first changes the tree
        if not init:
            for x in out:
                x.fill_(float("nan") if x.is_floating_point() else 77)
        return out

    monkeypatch.setattr(E, "_tree_buffers", poisoned)
    return calls


@pytest.mark.parametrize("topk,steps,nodes", [(3, 3, 8), (4, 4, 16), (2, 5, 12), (1, 4, 5), (3, 1, 4)])
def test_fused_tree_kernels_equal_host_tree(topk, steps, nodes, fused_tree):
    """(fused_tree starts every tree's state from garbage: nothing may be read before it is written.)"""
    _device_tree_equals_host_tree(topk, steps, nodes, 3, 3)
    assert fused_tree  # the kernels grew the trees


@pytest.mark.parametrize("topk,steps,nodes", [(3, 3, 8), (4, 2, 30)])
def test_fused_tree_kernels_capped_trees(topk, steps, nodes, fused_tree):
    """Per-request depth and node caps through the fused kernels. (Exact ties are checked on the kernels alone,
    tests/test_eagle_tree_kernels.py: torch's log_softmax rounds equal rows differently by shape, so the host
    oracle's "ties" are not ties for kernels that round every equal row alike.)"""
    _capped_trees(topk, steps, nodes, "greedy")
    assert fused_tree


def _device_tree_equals_host_tree(topk, steps, nodes, version, batch):
    hf = hf_model("qwen2")
    target = ours_from_hf(hf, num_blocks=512)
    head = random_head(target.model, version, draft_vocab=50 if version == 3 else None)
    twin = _twins(target, head, topk, steps, nodes)
    prompts = [[5, 6, 7, 8, 9], [11, 3, 90, 2, 2, 2, 40, 41], [60, 61]][:batch]
    reqs = [_request(i, p) for i, p in enumerate(prompts)]
    run_rounds(target, twin, reqs, 12, tree=True)
    assert twin.trees >= 3 * batch
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == plain_greedy(target, p, 12)


@pytest.mark.parametrize("topk,steps,nodes", [(3, 3, 8), (4, 3, 12), (2, 4, 9), (3, 2, 13)])
@pytest.mark.parametrize("q", [[0.5, 0.25, 0.125, 0.0625], [0.4, 0.2, 0.2, 0.1]])
def test_device_tree_ties_are_the_host_ones(topk, steps, nodes, q):
    """Exact ties everywhere (every node's children have the same probabilities; the second q also ties two
    siblings): frontier and final choices must break them as the host tree did (the lower node id first)."""
    hf = hf_model("qwen2")
    target = ours_from_hf(hf, num_blocks=512)
    head = random_head(target.model, 3, draft_vocab=50)
    calibrate(head, q[:topk])
    twin = _twins(target, head, topk, steps, nodes)
    prompts = [[5, 6, 7, 8, 9], [11, 3, 90, 2, 2, 2, 40, 41]]
    reqs = [_request(i, p) for i, p in enumerate(prompts)]
    run_rounds(target, twin, reqs, 10, tree=True)
    assert twin.trees >= 4


@pytest.mark.parametrize("topk,steps,nodes", [(3, 2, 6), (2, 3, 7), (3, 3, 20), (1, 3, 3)])
def test_device_sampled_tree_equals_host_tree(topk, steps, nodes):
    """Sampled (and mixed) batches: the same i.i.d. draws from each request's generator, the same children counts,
    the same q rows; verified by the exact rule along the way."""
    hf = hf_model("qwen2")
    target = ours_from_hf(hf, num_blocks=512)
    head = random_head(target.model, 3, draft_vocab=50)
    twin = _twins(target, head, topk, steps, nodes)
    prompts = [[5, 6, 7, 8, 9], [11, 3, 90, 2, 2, 2, 40, 41], [60, 61]]
    reqs = [_request(0, prompts[0], temperature=1.0, seed=3), _request(1, prompts[1], temperature=0.7, seed=4),
            _request(2, prompts[2])]
    run_rounds(target, twin, reqs, 10, tree=True)
    assert twin.trees >= 6
    lay = TreeLayout.get(topk, steps, nodes)
    assert len(lay.s_nodes) <= nodes


@pytest.mark.parametrize("topk,steps,nodes", [(3, 3, 8), (4, 4, 16), (2, 5, 12), (4, 2, 30)])
@pytest.mark.parametrize("kind", ["greedy", "mixed", "sharp"])
def test_capped_trees_equal_host_tree(topk, steps, nodes, kind):
    """Trees cut to fit each request (issue 13, session 10): requests near their max_tokens (depth <= remaining - 1)
    and node caps that vary round to round (the engine's context room), different in one batch, so one layout
    serves trees of several depths and sizes (grow_tree's caps) and some rounds give a request its root alone:
    the device trees equal the host oracle's, node for node (draws and q rows of sampled trees too), and greedy
    output stays plain greedy."""
    _capped_trees(topk, steps, nodes, kind)


def _capped_trees(topk, steps, nodes, kind):
    hf = hf_model("qwen2")
    target = ours_from_hf(hf, num_blocks=512)
    head = random_head(target.model, 3, draft_vocab=50)
    if kind == "sharp":  # a confident head: deep candidates outrank shallow siblings, so the per-request depth
        calibrate(head, [0.9, 0.06, 0.03][:topk])  # cap inside grow_tree decides which nodes a tree keeps
    twin = _twins(target, head, topk, steps, nodes)
    prompts = [[5, 6, 7, 8, 9], [11, 3, 90, 2, 2, 2, 40, 41], [60, 61]]
    new = 11
    sampled = kind == "mixed"
    # different max_tokens: requests at different distances from their ends share a batch (per-request depth caps)
    maxes = (new, 7, 4)
    reqs = [_request(0, prompts[0], max_tokens=maxes[0]), _request(1, prompts[1], max_tokens=maxes[1],
                                                                   temperature=0.8 if sampled else 0.0, seed=5),
            _request(2, prompts[2], max_tokens=maxes[2])]
    run_rounds(target, twin, reqs, new, tree=True, max_drafts=lambda r: 1 + (r.num_tokens * 7 + r.req_id) % (nodes + 2))
    assert twin.trees >= 6
    assert len(set(twin.sizes)) >= 3  # trees of several sizes
    for r, p, m in zip(reqs, prompts, maxes):
        if r.params.temperature == 0:
            assert r.output_token_ids == plain_greedy(target, p, m)


@pytest.mark.parametrize("topk,steps,nodes,conf", [(3, 3, 8, 0.5), (3, 4, 16, 0.05), (2, 5, 12, 0.02)])
def test_confidence_cut_trees_equal_host_tree(topk, steps, nodes, conf):
    """tree_confidence c: each greedy tree keeps only its nodes of cumulative draft probability >= c (at most
    `nodes`, under the per-request caps too; a sampled request keeps its static slots): the device trees equal
    the host oracle's, node for node, the kept nodes' probabilities are all >= c, trees come in several sizes
    (some cut below the full tree, some to the root alone), and greedy output stays plain greedy."""
    hf = hf_model("qwen2")
    target = ours_from_hf(hf, num_blocks=512)
    head = random_head(target.model, 3, draft_vocab=50)
    calibrate(head, [0.9, 0.06, 0.03][:topk])  # path probabilities 0.9, 0.81, .., 0.06, 0.054, ..: some pass
    twin = _twins(target, head, topk, steps, nodes, tree_confidence=conf)
    prompts = [[5, 6, 7, 8, 9], [11, 3, 90, 2, 2, 2, 40, 41], [60, 61]]
    reqs = [_request(0, prompts[0]), _request(1, prompts[1], temperature=0.8, seed=5), _request(2, prompts[2])]
    run_rounds(target, twin, reqs, 10, tree=True, max_drafts=lambda r: 1 + (r.num_tokens * 7 + r.req_id) % (nodes + 2))
    assert twin.trees >= 6
    full = TreeLayout.get(topk, steps, nodes).greedy_nodes
    greedy_sizes = [n for n, r in zip(twin.sizes, twin.owners) if r == 0 or r == 2]
    assert min(greedy_sizes) < max(greedy_sizes) <= full
    tree = twin.d.last_tree
    assert tree.kept is not None and twin.d.tree_confidence == conf
    for r, p in zip(reqs, prompts):
        if r.params.temperature == 0:
            assert r.output_token_ids == plain_greedy(target, p, 10)


def test_confidence_cut_keeps_only_confident_nodes():
    """The cut on one greedy tree: with c above every draft's probability the tree is its root alone (a plain
    round); otherwise exactly the nodes whose path probability reaches c (c = 0.3: 0.7, 0.49, 0.343 along the top-1
    chain, not 0.2401 or the rank-2 child 0.2; c = 0.19: those two too; c = 0.1: also 0.7 * 0.2 and 0.2 * 0.7, not
    0.098); c must be in [0, 1). Growing stops at the first level with nothing at or above c (on the CPU): the
    head runs the extend alone at c = 0.75, the extend and 2 of the 3 tree steps at c = 0.45 (level 3's best is
    0.343), all of them below."""
    hf = hf_model("qwen2")
    target = ours_from_hf(hf, num_blocks=512)
    head = random_head(target.model, 3, draft_vocab=50)
    calibrate(head, [0.7, 0.2, 0.06])
    calls = []
    forward = head.forward
    head.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    for conf, want, steps in [(0.75, 1, 1), (0.45, 3, 3), (0.3, 4, 4), (0.19, 6, 4), (0.1, 8, 4)]:
        d = EagleDrafter(target, head, cache=CacheConfig(block_size=4, num_blocks=512), tree_topk=3, tree_steps=4,
                         tree_nodes=12, tree_confidence=conf)
        r = _request(0, [5, 6, 7, 8, 9])
        target.kv.add_sequence(0)
        out, _ = target.forward([Chunk(0, r.all_tokens)], hidden_layers=d.target_hidden_layers)
        r.output_token_ids.append(int(out.logits[-1].argmax()))
        d.observe_target([r], [out.hidden_states], [0])
        calls.clear()
        prop = d.propose_tree([r])
        assert len(prop.tokens[0]) == want, (conf, prop.parents[0])
        assert len(calls) == steps, conf
        target.kv.free(0)
        d.release(r)
    with pytest.raises(ValueError, match="tree_confidence"):
        EagleDrafter(target, head, tree_confidence=1.0)


def test_capped_tree_depth_and_size():
    """A request with 3 tokens left drafts a tree of depth 2 (not none, and not deeper); a node cap of 2 keeps 3
    nodes; one token left: the root alone."""
    hf = hf_model("qwen2")
    target = ours_from_hf(hf, num_blocks=512)
    head = random_head(target.model, 3, draft_vocab=50)
    d = EagleDrafter(target, head, cache=CacheConfig(block_size=4, num_blocks=512), tree_topk=3, tree_steps=4,
                     tree_nodes=12)
    r = _request(0, [5, 6, 7, 8, 9], max_tokens=4)
    target.kv.add_sequence(0)
    out, _ = target.forward([Chunk(0, r.all_tokens)], hidden_layers=d.target_hidden_layers)
    r.output_token_ids.append(int(out.logits[-1].argmax()))
    d.observe_target([r], [out.hidden_states], [0])
    # (node cap, tokens left) -> (levels grown, nodes kept); 11 of the 12 candidates of depth <= 2 reach depth 2
    for max_drafts, remaining, levels, nodes in [(None, 3, 2, 12), (None, 4, 3, 12), ([2], 4, 2, 3),
                                                 ([1], 4, 1, 2), (None, 1, 0, 1), ([0], 4, 0, 1)]:
        r.params = SamplingParams(temperature=0, max_tokens=len(r.output_token_ids) + remaining)
        prop = d.propose_tree([r], max_drafts)
        depth = max(_depths(prop.parents[0]))
        assert len(prop.tokens[0]) == nodes and depth <= levels, (max_drafts, remaining)
        if levels:
            assert d.last_tree.steps_run == levels - 1  # no head step below the cap
        if (max_drafts, remaining) in ((None, 3), ([1], 4)):
            assert depth == levels


def test_tree_layout_sampled_budget():
    """The sampled trees' static structure: the root's min(k, n - 1) children, then k children per frontier node
    while the budget lasts; node ids in the order the host tree added them."""
    lay = TreeLayout.get(3, 3, 8)
    assert lay.num_slots == 1 + 3 + 9 + 9
    assert lay.s_nodes == [0, 1, 2, 3, 4, 5, 6, 7]  # root, 3 children, then 3 + 1 children of two frontier nodes
    assert lay.s_front == [1, 3, 0]
    assert lay.s_children[1] == [3, 1, 0]
    assert TreeLayout.get(2, 2, 3).s_nodes == [0, 1, 2]


def test_bucketed_drafting_on_cpu(monkeypatch):
    """The CUDA path's bucket padding (extend and tree over padding sequences in block 0), run eagerly on the CPU:
    trees equal the host ones and greedy output stays plain greedy."""
    hf = hf_model("qwen2")
    target = ours_from_hf(hf, num_blocks=512)
    head = random_head(target.model, 3, draft_vocab=50)
    twin = _twins(target, head, 3, 3, 8, cuda_graphs=True)
    monkeypatch.setattr(EagleDrafter, "_graphs_on", lambda self: True)
    # extend rows 1..5 and the tree of 3, 2 and 1 steps (requests near their end), each tree also in its variant
    # capped per request, buckets 1 and 4
    assert twin.d.capture_graphs([1, 3]) == 2 * (5 + 3 + 3)
    prompts = [[5, 6, 7, 8, 9], [11, 3, 90, 2, 2, 2, 40, 41], [60, 61]]
    reqs = [_request(i, p) for i, p in enumerate(prompts)]
    run_rounds(target, twin, reqs, 14, tree=True)
    st = twin.d.static
    assert any(k[0] == "tree" and k[1] == 4 for k in st.graphs)  # 3 requests ran in the bucket of 4
    assert any(k[0] == "extend" for k in st.graphs) and st.replays > 0
    assert st.kv.num_free_blocks == st.kv.num_blocks - 1
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == plain_greedy(target, p, 14)



class _MetaHead:
    """Shapes only: a head whose forward returns meta tensors (records what it was called with)."""

    vocab_size = 1000

    def __init__(self, vd: int, hid: int, feat: int) -> None:
        from types import SimpleNamespace

        self.draft_to_target = torch.arange(vd, device="meta")
        self.eagle = SimpleNamespace(feature_size=feat)
        self.config = SimpleNamespace(hidden_size=hid)
        self.draft_vocab_size, self.hid = vd, hid
        self.calls = []

    def __call__(self, ids, feats, positions, meta, kv, from_target, rows=None):
        self.calls.append((ids.shape[0], feats.shape, meta.max_query_len, rows.shape[0]))
        return torch.empty(rows.shape[0], self.hid, device="meta"), torch.empty(rows.shape[0], self.draft_vocab_size,
                                                                                device="meta")


@pytest.mark.parametrize("topk,steps,nodes,batch", [(4, 4, 16, 1), (4, 4, 16, 64), (2, 5, 12, 4), (1, 4, 5, 8),
                                                    (8, 8, 64, 2)])
def test_drafting_bodies_are_shape_static(topk, steps, nodes, batch):
    """What the CUDA graphs capture (the extend and the whole greedy tree over the static buffers) runs on the
    meta device: any host read (.item(), .tolist(), nonzero) or data-dependent shape would raise there."""
    from types import SimpleNamespace

    from forerun.drafters.eagle import _StaticDrafting

    head = _MetaHead(50, 8, 24)
    runner = SimpleNamespace(kv=SimpleNamespace(block_size=16), device=torch.device("meta"),
                             buffers=SimpleNamespace(max_seqs=64, max_blocks=30))
    st = _StaticDrafting(SimpleNamespace(cache=runner, head=head, head_dtype=torch.float32, tree_confidence=0.0))
    st._extend_body(batch, 3)()
    assert head.calls[-1] == (batch * 3, (batch * 3, 24), 3, batch)
    lay = TreeLayout.get(topk, steps, nodes)
    out = st._tree_body(lay, batch)()
    assert len(head.calls) == steps  # the extend + steps - 1 tree steps
    assert [c[2] for c in head.calls[1:]] == [topk * t for t in range(1, steps)]
    n = min(nodes, lay.num_slots)
    assert out["tokens"].shape == (batch, n)
    from forerun.drafters.eagle import tree_mask_and_depth

    assert tree_mask_and_depth(out["parents"], steps)[0].shape == (batch, n, n)
    assert out["packed"].shape == (batch, 3 * n + 2 * lay.num_slots)
    capped = st._tree_body(lay, batch, capped=True)()  # per-request depth / node caps (their own graph)
    assert {k: v.shape for k, v in capped.items() if v is not None} == {k: v.shape for k, v in out.items() if v is not None}
    st.drafter.tree_confidence = 0.1  # the confidence cut: the kept counts too, packed's last column
    cut = st._tree_body(lay, batch, capped=True)()
    assert cut["kept"].shape == (batch,) and cut["packed"].shape == (batch, 3 * n + 2 * lay.num_slots + 1)


# -- the real SmolLM2 ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm():
    from forerun.models.registry import load_model

    model, tok, _ = load_model("smollm2-135m-instruct", "cpu", torch.float32)
    model.requires_grad_(False)
    return model, tok


# written for this test (not benchmark prompts)
REAL_PROMPTS = ("def gcd(a, b):\n    \"\"\"Greatest common divisor.\"\"\"\n", "The three primary colours are")


@pytest.mark.slow
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_is_lossless_real_smollm2(smollm, tree):
    model, tok = smollm
    target = ModelRunner(model, CacheConfig(block_size=16, num_blocks=64), "cpu", torch.float32)
    head = random_head(model, 3, draft_vocab=4096)
    drafter = EagleDrafter(target, head, cache=CacheConfig(block_size=16, num_blocks=64), tree_topk=3,
                           tree_steps=3, tree_nodes=10)
    prompts = [tok(p)["input_ids"] for p in REAL_PROMPTS]
    reqs = [_request(i, p) for i, p in enumerate(prompts)]
    run_rounds(target, drafter, reqs, 20, k=3, tree=tree)
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == plain_greedy(target, p, 20)


@pytest.mark.slow
def test_training_raises_heldout_acceptance_smollm2(smollm, tmp_path):
    """A short run of the recipe (features over the offline corpus, EAGLE-3 head, training-time test) must
    lift the held-out acceptance clearly above the untrained head's. Measured on the 2-core machine under load
    (see docs/eagle.md): untrained acc_len 1.024, after 150 steps 1.566 (step accuracies 0.31, 0.50, 0.32);
    asserted: +0.25, under half the measured gain."""
    from forerun.eagle import data as D
    from forerun.eagle import train as T

    model, tok = smollm
    cfg = EagleConfig.for_target(model.config, version=3, intermediate_size=768)
    layers = D.feature_layers(model.config.num_layers, cfg.aux_layers)
    D.extract(model, tok, tmp_path, layers, "train", 2500, max_len=160, progress=False)
    D.extract(model, tok, tmp_path, layers, "heldout", 800, max_len=160, progress=False)
    ids = T.choose_draft_vocab(D.token_counts(tmp_path, model.config.vocab_size), 4096, model.config.eos_token_ids)
    cfg = EagleConfig.for_target(model.config, version=3, draft_vocab_size=4096, intermediate_size=768)
    head = T.init_head(model, cfg, ids)
    teacher = T.Teacher(model, head)
    res = T.train(head, teacher, D.load_split(tmp_path, "train"), D.load_split(tmp_path, "heldout"), steps=150,
                  minutes=None, ttt=2, lr=1e-3, max_len=160, accum=1, eval_every=150, eval_k=3, out=tmp_path / "head",
                  save_every=150, progress=False, log=lambda s: None)
    before, after = res["history"][0]["acc_len"], res["acc_len"]
    print(f"held-out acc_len {before:.3f} -> {after:.3f}; step accuracy {res['step_acc']}")
    assert after >= before + 0.25
    # the checkpoint it wrote loads and drafts the same tokens
    again = load_eagle_head(tmp_path / "head", model)
    seq = D.load_split(tmp_path, "heldout")[0]
    with torch.no_grad():
        a = head.logits(T.unrolled_outputs(head, seq, 1)[0]).argmax(-1)
        b = again.logits(T.unrolled_outputs(again, seq, 1)[0]).argmax(-1)
    assert torch.equal(a, b)


# -- training data recipes (forerun/eagle/data.py) ------------------------------------------------------------
def test_mix_corpus_kinds_and_no_bench_prompts():
    """The "mix" recipe yields code chat turns, code-then-prose turns, other languages' files and docs prose;
    nothing in it is a benchmark prompt."""
    import itertools

    from forerun.bench_prompts import CODE_PROMPTS
    from forerun.eagle import data as D

    samples = list(itertools.islice(D.mixed_samples(False), 70))
    users = [s.messages[0]["content"] for s in samples if s.messages]
    answers = [s.messages[1]["content"] for s in samples if s.messages]
    assert any("```python" in a and not a.rstrip().endswith("```") for a in answers)  # code, then prose
    assert any(f"```{lang}" in a for a in answers for lang in ("c\n", "cpp", "javascript", "bash"))
    assert any(s.text is not None for s in samples)
    assert not set(users) & set(CODE_PROMPTS)
    texts = " ".join(s.text or " ".join(m["content"] for m in s.messages) for s in samples)
    assert not any(p in texts for p in CODE_PROMPTS)


def test_feature_folder_refuses_another_layout_or_corpus(tmp_path):
    """One feature folder never mixes target weight layouts or corpus recipes (older folders: fp32, code)."""
    from forerun.eagle import data as D

    d = tmp_path / "train"
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"layers": [0, 1], "max_len": 64, "seed": 0, "heldout_fraction": 0.05}))
    for kw in ({"quantize": "int4"}, {"corpus": "mix"}):
        with pytest.raises(ValueError, match="other settings"):
            D.extract(None, None, tmp_path, (0, 1), "train", 10, max_len=64, progress=False, **kw)
