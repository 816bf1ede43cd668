"""Sliding-window models (Mistral `sliding_window`, Qwen2 `use_sliding_window`): config parsing and refusals,
logits parity with transformers on tiny random models whose window is shorter than the sequence, tree masks,
KV blocks given back once outside the window, speculative greedy == plain greedy == transformers past the
window, and the Triton kernel's window (under Triton's interpreter, in a subprocess)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import transformers

from forerun.config import CacheConfig, ModelConfig, SpecConfig
from forerun.runtime.runner import Chunk
from tiny import COMMON, ours_from_hf, tiny_tokenizer

WINDOW = 8


def hf_windowed(arch: str, window: int | None = WINDOW, seed: int = 0, **over):
    torch.manual_seed(seed)
    if arch == "mistral":
        cfg = transformers.MistralConfig(**dict(COMMON, **over), sliding_window=window)
    else:
        cfg = transformers.Qwen2Config(**dict(COMMON, **over), use_sliding_window=window is not None,
                                       sliding_window=window or 4096, max_window_layers=0, tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# -- config -------------------------------------------------------------------------------------------------
def _cfg(arch, **kw):
    cls = transformers.MistralConfig if arch == "mistral" else transformers.Qwen2Config
    return ModelConfig.from_hf(cls(**COMMON, **kw).to_dict())


def test_config_reads_the_window_and_refuses_mixed_layers():
    assert _cfg("mistral", sliding_window=8).sliding_window == 8
    assert _cfg("mistral", sliding_window=None).sliding_window is None
    assert _cfg("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0).sliding_window == 8
    # Qwen2.5 checkpoints carry sliding_window with use_sliding_window false: full attention
    assert _cfg("qwen2", use_sliding_window=False, sliding_window=8).sliding_window is None
    assert _cfg("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=3).sliding_window is None
    with pytest.raises(ValueError, match="mixes sliding-window and full-attention layers"):
        _cfg("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    bad = transformers.MistralConfig(**COMMON, sliding_window=8).to_dict()
    bad["sliding_window"] = -3
    with pytest.raises(ValueError, match="positive integer"):
        ModelConfig.from_hf(bad)


# -- parity ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_logits_parity_with_transformers_past_the_window(arch):
    hf = hf_windowed(arch)
    full_attn = hf_windowed(arch, window=None)
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(1))
    more = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    seq = ids[0].tolist() + more
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
        unwindowed = full_attn(torch.tensor([seq])).logits[0]
    assert rel_err(unwindowed[20:], ref[20:]) > 1e-2, "the window must matter in this test"
    runner = ours_from_hf(hf)
    assert runner.model.config.sliding_window == WINDOW
    runner.kv.add_sequence(0)
    out, _ = runner.forward([Chunk(0, ids[0].tolist(), logits="all")])  # prefill (30 > window)
    assert rel_err(out.logits, ref[:30]) <= 1e-4
    got = [runner.forward([Chunk(0, more[:1])])[0].logits[0]]  # one decode step
    got.append(runner.forward([Chunk(0, more[1:5], logits="all")])[0].logits)  # a 4-token verify-like chunk
    runner.kv.truncate(0, 33)  # reject the last two of them, then feed the true continuation again
    got.append(runner.forward([Chunk(0, more[3:], logits="all")])[0].logits)
    assert rel_err(got[0], ref[30]) <= 1e-4
    assert rel_err(got[1], ref[31:35]) <= 1e-4
    assert rel_err(got[2], ref[33:]) <= 1e-4


def test_tree_mask_with_window_equals_each_branch():
    hf = hf_windowed("mistral")
    prefix = list(range(3, 23))  # 20 cached tokens, window 8
    parent = [-1, 0, 0, 1, 2, 2, 3]
    tokens = [20, 21, 22, 23, 24, 25, 26]
    n = len(parent)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
        depth[i] = 0 if parent[i] < 0 else depth[parent[i]] + 1
    runner = ours_from_hf(hf)
    runner.kv.add_sequence(0)
    runner.forward([Chunk(0, prefix, logits="none")])
    # two catch-up tokens before the tree (causal), as the tree round feeds them
    catch = [40, 41]
    c = len(catch)
    full = torch.zeros(c + n, c + n, dtype=torch.bool)
    full[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
    full[c:, :c] = True
    full[c:, c:] = mask
    root = len(prefix) + c
    out, _ = runner.forward([Chunk(0, catch + tokens, positions=list(range(len(prefix), root)) + [root + d for d in depth],
                                   tree_mask=full, logits="all")])
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parent[j]
        with torch.no_grad():
            ref = hf(torch.tensor([prefix + catch + path[::-1]])).logits[0, -1]
        assert rel_err(out.logits[c + i], ref) <= 1e-4, i


# -- KV blocks ------------------------------------------------------------------------------------------------
def test_blocks_outside_the_window_are_given_back_and_rollback_below_them_refused():
    hf = hf_windowed("mistral")
    runner = ours_from_hf(hf, block_size=4, num_blocks=64)
    kv = runner.kv
    kv.add_sequence(0)
    free0 = kv.num_free_blocks
    runner.forward([Chunk(0, list(range(3, 43)), logits="none")])  # 40 tokens = 10 blocks
    assert kv.num_free_blocks == free0 - 10
    kv.truncate(0, 40)  # committed: 40 - 8 = 32 -> blocks 0..7 are outside the window
    assert kv.num_free_blocks == free0 - 2
    assert kv.blocks(0)[:8] == [0] * 8
    with pytest.raises(ValueError, match="left the sliding window"):
        kv.truncate(0, 20)
    kv.free(0)
    assert kv.num_free_blocks == free0 and 0 not in kv._free


# -- engine: spec == plain == transformers past the window -------------------------------------------------------
@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_speculative_greedy_equals_plain_and_transformers_past_the_window(arch):
    from forerun.engine.llm import LLM
    from forerun.sampling_params import SamplingParams

    hf = hf_windowed(arch, seed=3)
    model = ours_from_hf(hf).model
    tok = tiny_tokenizer()
    prompts = [[5, 9, 5, 9, 5, 9, 12, 13, 5, 9, 5, 9], [20, 21, 22, 20, 21, 22, 20, 21]]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = dict(device="cpu", check_invariants=True, cache=CacheConfig(block_size=4, num_blocks=96))
    plain = LLM.from_model(model, tok, **small).generate(prompts, sp)
    for p, o in zip(prompts, plain):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, len(p):].tolist()
        assert o.token_ids == ref
    for spec in [SpecConfig(method="ngram", k=4), SpecConfig(method="draft", draft_model=(model, tok), k=3),
                 SpecConfig(method="early-exit", early_exit_layers=1, k=3)]:
        llm = LLM.from_model(model, tok, spec=spec, **small)
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], spec.method
        assert llm.aggregate_stats(outs).drafted > 0


# -- Triton kernel (interpreter) ----------------------------------------------------------------------------------
TRITON_CHECK = r"""
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, "tests")
from attention_cases import paged_case
from forerun.attention.reference import paged_attention_reference
from forerun.attention.triton_backend import TritonPagedAttention
d, window = 16, 7
q, k, v, meta = paged_case([1, 3, 5, 1], [0, 9, 30, 17], 4, 2, d, 4, "cpu", torch.float32)
ref = paged_attention_reference(q, k, v, meta, d ** -0.5, window)
full = paged_attention_reference(q, k, v, meta, d ** -0.5)
assert (ref - full).abs().max() > 1e-3
for splits in (1, 3):
    out = TritonPagedAttention(block_n=4, num_splits=splits).forward(q, k, v, meta, d ** -0.5, window=window)
    err = (out - ref).abs().max().item()
    assert err < 1e-4, (splits, err)
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the kernel itself is checked (..._on_cuda below); "
                    "the GPU machine's Triton 3.6 interpreter cannot run it")
def test_triton_kernel_window_matches_reference_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, cwd=root, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_triton_refuses_a_tree_with_a_window():
    from forerun.attention.metadata import AttnMetadata
    from forerun.attention.triton_backend import TritonPagedAttention

    meta = AttnMetadata(torch.tensor([0, 2]), torch.tensor([2]), torch.zeros(1, 1, dtype=torch.int64),
                        torch.tensor([1, 2]), 2, 2, tree_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="sliding-window"):
        TritonPagedAttention().forward(torch.zeros(2, 2, 4), torch.zeros(2, 4, 1, 4), torch.zeros(2, 4, 1, 4), meta,
                                       0.5, window=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [1, 16, 100, 4096])
def test_triton_kernel_window_matches_reference_on_cuda(window):
    from forerun.attention.reference import paged_attention_reference
    from forerun.attention.triton_backend import TritonPagedAttention

    from attention_cases import paged_case

    q, k, v, meta = paged_case([1, 5, 16, 3, 1], [0, 40, 700, 129, 2000], 32, 8, 128, 16, "cuda", torch.bfloat16)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), meta, 128 ** -0.5, window)
    for splits in (None, 1, 4):
        out = TritonPagedAttention(num_splits=splits).forward(q, k, v, meta, 128 ** -0.5, window=window)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (splits, err)
