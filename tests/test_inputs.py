"""Input validation that must answer clearly before anything runs (issue 10: 10, 13, 15)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from forerun.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from forerun.inputs import normalize_prompt
from forerun.sampling_params import SamplingParams

ACCEPTED = "a prompt must be a str, or a 1-D sequence of token ids"


# ---------------------------------------------------------------- prompts


@pytest.mark.parametrize("prompt, want", [
    ("hello", "hello"), ("", ""), ([1, 2, 3], [1, 2, 3]), ((4, 5), [4, 5]), ([], []),
    (np.array([6, 7], dtype=np.int32), [6, 7]), (np.array([8], dtype=np.uint16), [8]),
    (torch.tensor([9, 10]), [9, 10]), (torch.tensor([11], dtype=torch.int32), [11]),
    ([np.int64(12), 13], [12, 13]),
])
def test_accepted_prompts(prompt, want):
    got = normalize_prompt(prompt)
    assert got == want and type(got) is type(want)
    if isinstance(got, list):
        assert all(type(t) is int for t in got)


@pytest.mark.parametrize("prompt, detail", [
    (None, "None"), (b"hello", "bytes"), (bytearray(b"hi"), "bytearray"), ([1.0, 2.0], "float"),
    ([[1, 2], [3]], "nested"), (np.array([[1, 2]]), "1-D"), (np.array([1.5]), "integers"),
    (torch.tensor([1.0]), "integers"), (torch.tensor(3), "1-D"), (torch.ones(2, 2, dtype=torch.long), "1-D"),
    (5, "int"), ({1: 2}, "dict"), ([True, False], "bool"), (torch.tensor([True]), "integers"),
])
def test_refused_prompts_say_what_is_accepted(prompt, detail):
    with pytest.raises(ValueError) as ei:
        normalize_prompt(prompt)
    msg = str(ei.value)
    assert msg.startswith(ACCEPTED) and detail in msg and "\n" not in msg


# ---------------------------------------------------------------- SamplingParams ranges


@pytest.mark.parametrize("kw, match", [
    (dict(top_k=2**70), r"top_k must be in \[-1, 9223372036854775807\]"),
    (dict(seed=2**64), "seed must be in"), (dict(seed=-2**63 - 1), "seed must be in"),
    (dict(max_tokens=2**63), "max_tokens must be in"), (dict(max_tokens=0), "max_tokens must be in"),
    (dict(max_tokens=1.5), "max_tokens must be an integer"), (dict(top_k=2.0), "top_k must be an integer"),
    (dict(seed="1"), "seed must be an integer"), (dict(temperature="0.5"), "temperature must be a number"),
    (dict(temperature=float("inf")), "finite"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("nan")), "top_p"), (dict(logprobs=-1), "logprobs"), (dict(logprobs=2**40), "logprobs"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"), (dict(stop_token_ids=(2**64,)), "stop_token_ids"),
    (dict(stop=[1]), "stop must be a string"), (dict(max_tokens=True), "max_tokens must be an integer"),
])
def test_sampling_params_refuse_out_of_range_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_sampling_params_edges_that_are_fine():
    p = SamplingParams(top_k=-1, seed=2**63 - 1, max_tokens=2**63 - 1, logprobs=20, stop="x",
                       stop_token_ids=[np.int64(3)])
    assert p.top_k == 0 and p.stop == ("x",) and p.stop_token_ids == (3,)
    assert SamplingParams(seed=-5, top_k=np.int32(4)).seed == -5


# ---------------------------------------------------------------- EngineConfig


@pytest.mark.parametrize("kw, match", [
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"), (dict(max_num_seqs=-3), "max_num_seqs must be >= 1"),
    (dict(max_num_seqs=2.0), "max_num_seqs must be an integer"),
    (dict(max_model_len=-5), "max_model_len must be a positive integer or None"),
    (dict(max_model_len=0), "max_model_len must be a positive integer or None"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
    (dict(max_num_batched_tokens=True), "max_num_batched_tokens must be an integer"),
])
def test_engine_config_names_the_bad_value(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_engine_config_defaults_and_frozen():
    c = EngineConfig()
    assert (c.max_num_seqs, c.max_model_len, c.max_num_batched_tokens) == (64, None, 8192)
    assert EngineConfig(max_num_seqs=1, max_model_len=16, max_num_batched_tokens=1).max_model_len == 16
    with pytest.raises(Exception):
        c.max_num_seqs = 3


# ---------------------------------------------------------------- SpecConfig: flags that would do nothing (issue 10: 10)


@pytest.mark.parametrize("kw, match", [
    (dict(method="draft", draft_model="x", tree=(2, 2), rule="greedy"), "does nothing with a tree"),
    (dict(method="draft", draft_model="x", tree=(2, 2), rule="penalty"), "does nothing with a tree"),
    (dict(method="draft", draft_model="x", tree=(2,), confidence_threshold=0.3), "does nothing with a tree"),
    (dict(method="ngram", tree=(2,)), "tree drafting needs method 'draft'"),
    (dict(method="early-exit", early_exit_layers=2, tree=(2,)), "tree drafting needs method 'draft'"),
    (dict(method="ngram", confidence_threshold=0.5), "does nothing with method 'ngram'"),
])
def test_spec_config_refuses_meaningless_combinations(kw, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig(**kw)


def test_rule_greedy_with_temperature_is_refused():
    spec = SpecConfig(method="ngram", rule="greedy")
    spec.check_sampling(SamplingParams(temperature=0))
    with pytest.raises(ValueError, match="rule 'greedy' decodes greedily and would ignore temperature=0.7"):
        spec.check_sampling(SamplingParams(temperature=0.7))
    SpecConfig(method="ngram").check_sampling(SamplingParams(temperature=0.7))  # auto: fine


@pytest.mark.parametrize("args, match", [
    (("ngram", None, None, None, 3, "2,2"), "--tree works with a draft model only"),
    (("early-exit:2", None, None, None, 3, "2"), "--tree works with a draft model only"),
    (("m", None, None, "greedy", 3, "2,2"), "--rule greedy does nothing with --tree"),
    (("m", None, 0.4, None, 3, "2,2"), "--confidence does nothing with --tree"),
    (("m", "3", None, None, 3, "2,2"), "--k does nothing with --tree"),
    (("m", None, None, None, 3, "2,0"), "--tree must be comma-separated positive integers"),
    (("m", None, None, None, 3, "a,b"), "--tree must be comma-separated positive integers"),
    (("ngram", None, 0.5, None, 3, None), "--confidence does nothing with --draft ngram"),
    (("m", "x", None, None, 3, None), "--k must be a non-negative integer or 'auto'"),
    (("m", "-1", None, None, 3, None), "--k must be a non-negative integer or 'auto'"),
    (("m", None, 1.5, None, 3, None), r"--confidence must be in \[0, 1\)"),
    (("early-exit:x", None, None, None, 3, None), "early-exit:N needs a positive layer count"),
    (("none", None, None, None, 3, "2"), "need"),
])
def test_from_flags_refuses_with_one_line(args, match):
    with pytest.raises(ValueError, match=match) as ei:
        SpecConfig.from_flags(*args[:4], ngram_max=args[4], tree=args[5])
    assert "\n" not in str(ei.value)


def test_from_flags_defaults_are_not_refused():
    """What generate / serve / bench pass when the user gave nothing: auto rule, confidence 0."""
    assert SpecConfig.from_flags("ngram", "auto", 0.0, "auto").method == "ngram"
    assert SpecConfig.from_flags("m", "auto", 0.0, "auto", tree="2,2,1").tree == (2, 2, 1)
    assert SpecConfig.from_flags("none", "auto", 0.0, "auto").rule == "auto"
    assert not SpecConfig.from_flags(None, None, None, None).enabled
    with pytest.raises(ValueError, match="need"):  # a verification rule with nothing to verify is refused
        SpecConfig.from_flags("none", "auto", 0.0, "greedy")


# ---------------------------------------------------------------- the default KV pool (issue 10: 15)


SMOL = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                   num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
QWEN_15 = ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                      num_heads=12, num_kv_heads=2, head_dim=128, max_position_embeddings=32768)
QWEN_05 = ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                      num_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=32768)


def _pool_bytes(cache: CacheConfig, model: ModelConfig, dtype) -> int:
    from forerun.kvcache.pool import KVPool

    pool = KVPool(model, cache, dtype, "meta")  # shapes only, no memory
    return pool.k.numel() * pool.k.element_size() * 2


def test_default_pool_follows_the_model_and_memory():
    from forerun.kvcache.sizing import MIN_TOKENS, default_cache_config, kv_bytes_per_token

    gib = 1 << 30
    old = _pool_bytes(CacheConfig(), SMOL, torch.float32)
    assert old >= 2 * gib - 16 * kv_bytes_per_token(SMOL, torch.float32)  # the old fixed default
    smol = default_cache_config(SMOL, torch.float32, "cpu", weight_bytes=540_000_000, available_bytes=16 * gib)
    assert smol.num_blocks is not None
    assert _pool_bytes(smol, SMOL, torch.float32) <= 600_000_000  # about the weights' size, not 2 GiB
    assert (smol.num_blocks - 1) * smol.block_size >= 8192  # one full-context sequence still fits
    tiny_mem = default_cache_config(SMOL, torch.float32, "cpu", weight_bytes=540_000_000, available_bytes=gib // 4)
    assert (tiny_mem.num_blocks - 1) * 16 >= MIN_TOKENS and tiny_mem.num_blocks < smol.num_blocks
    one = default_cache_config(SMOL, torch.float32, "cpu", max_num_seqs=1, max_model_len=256,
                               available_bytes=64 * gib)
    assert (one.num_blocks - 1) * 16 >= 257 and one.num_blocks <= 256 // 16 + 3  # never more than can be used
    gpu = default_cache_config(QWEN_15, torch.bfloat16, "cuda", available_bytes=10 * gib)  # 80% of free GPU memory
    assert 0.79 * 10 * gib <= _pool_bytes(gpu, QWEN_15, torch.bfloat16) <= 0.81 * 10 * gib
    big = default_cache_config(QWEN_15, torch.bfloat16, "cuda", available_bytes=1000 * gib)  # capped at the use
    assert (big.num_blocks - 1) * 16 == -(-64 * 32769 // 16) * 16


def test_draft_pool_is_budgeted_with_the_target_and_gets_the_same_blocks():
    from forerun.kvcache.sizing import default_cache_config, describe_pool

    gib = 1 << 30
    alone = default_cache_config(QWEN_15, torch.float32, "cpu", weight_bytes=6 * gib, available_bytes=16 * gib)
    pair = default_cache_config(QWEN_15, torch.float32, "cpu", weight_bytes=6 * gib, available_bytes=16 * gib,
                                draft=QWEN_05, draft_dtype=torch.bfloat16)
    assert pair.num_blocks < alone.num_blocks
    both = _pool_bytes(pair, QWEN_15, torch.float32) + _pool_bytes(pair, QWEN_05, torch.bfloat16)
    assert both <= 0.1 * 16 * gib * 1.01
    line = describe_pool(pair, QWEN_15, torch.float32, draft=QWEN_05, draft_dtype=torch.bfloat16)
    assert line.startswith(f"KV pool: {pair.num_blocks:,} blocks x 16") and "draft" in line and "free" in line
    with pytest.raises(ValueError, match="max_num_seqs"):
        default_cache_config(SMOL, torch.float32, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len"):
        default_cache_config(SMOL, torch.float32, max_model_len=-1)


def test_available_memory_is_read_without_psutil():
    from forerun.kvcache.sizing import available_memory_bytes

    got = available_memory_bytes("cpu")
    assert 0 < got <= 1 << 50
