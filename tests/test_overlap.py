"""Overlapped plain decoding (forerun/engine/overlap.py) gives exactly the outputs of ordinary rounds.

The overlap only pays on CUDA, but its bookkeeping (one step in flight, finishing requests, limits, block
tables, coins drawn in the same order) is device-independent, so it is checked here on the CPU with an eager
GraphRunner; tests/test_gpu.py checks it on CUDA graphs.
"""
from __future__ import annotations

import pytest

import forerun.engine.llm as llm_module
from forerun.engine.cuda_graph import GraphRunner
from forerun.sampling_params import SamplingParams
from tiny import hf_model, sharpen, tiny_llm

PROMPTS = [[5, 9, 13, 22, 40, 7], [3], list(range(10, 60, 3)), [70, 71, 72, 70, 71], [8, 8, 8], [1, 2, 3, 4]]


def make(overlap: bool, **kw):
    llm = tiny_llm(sharpen(hf_model("llama"), 2.0), overlap=overlap, check_invariants=True, **kw)
    sizes = tuple(b for b in (1, 2, 4, 8) if b < llm.max_num_seqs) + (min(8, llm.max_num_seqs),)
    llm.runner.graphs = GraphRunner(llm.runner, batch_sizes=sizes, max_q_len=1, use_graphs=False)
    return llm


@pytest.fixture
def steps(monkeypatch):
    """Counts the steps run overlapped and the tokens they committed."""
    count = {"steps": 0, "tokens": 0}
    real = llm_module.overlapped_decode

    def spy(*args, **kwargs):
        for produced in real(*args, **kwargs):
            count["steps"] += 1
            count["tokens"] += produced
            yield produced

    monkeypatch.setattr(llm_module, "overlapped_decode", spy)
    return count


def same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    assert [o.stats.emitted for o in a] == [len(o.token_ids) for o in a]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_overlapped_equals_rounds_with_ragged_max_tokens(temperature, steps):
    params = [SamplingParams(temperature=temperature, max_tokens=n, seed=i, ignore_eos=True)
              for i, n in enumerate((2, 5, 17, 30, 9, 12))]
    ref = make(False).generate(PROMPTS, params)
    got = make(True).generate(PROMPTS, params)
    same(got, ref)
    total = sum(len(o.token_ids) for o in got)
    assert steps["tokens"] >= 0.7 * total  # most tokens came from overlapped steps (not prefills, not the last)


def test_overlapped_stop_tokens_strings_and_continuous_batching(steps):
    """Requests finish at stop tokens / strings (known only after their step); more requests than slots."""
    base = make(False).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    params = []
    for i, o in enumerate(base):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(o.token_ids[7],), ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0, max_tokens=24, stop=[o.text.split()[4]], ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.7, max_tokens=20 + i, seed=i, ignore_eos=True))
    ref = make(False, max_num_seqs=3).generate(PROMPTS, params)
    got = make(True, max_num_seqs=3).generate(PROMPTS, params)
    same(got, ref)
    assert any(o.finish_reason == "stop" for o in got)
    assert steps["tokens"] >= 0.5 * sum(len(o.token_ids) for o in got)


def test_overlap_stays_off_where_it_does_not_apply(steps):
    """top-k sampling and logprobs go through ordinary rounds (the fused sampler has neither)."""
    params = [SamplingParams(temperature=0.8, top_k=5, max_tokens=10, seed=1),
              SamplingParams(temperature=0, max_tokens=10, logprobs=2)]
    ref = make(False).generate(PROMPTS[:2], params)
    got = make(True).generate(PROMPTS[:2], params)
    same(got, ref)
    assert steps["steps"] == 0


def test_overlapped_decoding_stops_at_the_context_limit(steps):
    """No step is launched past the model's context, even with a step in flight."""
    prompt = [(7 * i) % 90 + 2 for i in range(500)]  # the tiny model has 512 positions
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    ref = make(False).generate([prompt, PROMPTS[0]], params)
    got = make(True).generate([prompt, PROMPTS[0]], params)
    same(got, ref)
    assert len(got[0].token_ids) == 512 - 500 and got[0].finish_reason == "length" and steps["steps"] > 5


def test_adaptive_k_at_zero_runs_overlapped_and_still_probes(steps):
    """A draft model that never agrees with the target makes adaptive k choose 0; those plain rounds run
    overlapped in sessions that end where the scheduler probes again (it must keep probing), and greedy output
    is the plain output."""
    from forerun.config import SpecConfig
    from tiny import ours_from_hf, tiny_tokenizer

    target = sharpen(hf_model("llama"), 2.0)
    other = ours_from_hf(sharpen(hf_model("llama", seed=5), 2.0)).model  # unrelated weights: ~1/97 agreement
    spec = SpecConfig(method="draft", draft_model=(other, tiny_tokenizer()), adaptive=True, k_max=4)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    prompts = [list(range(20, 60)), [5, 9, 13]]
    plain = make(False).generate(prompts, params)

    llm = tiny_llm(target, spec=spec, overlap=True, check_invariants=True)
    llm.runner.graphs = GraphRunner(llm.runner, batch_sizes=(1, 2), max_q_len=5, use_graphs=False)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert steps["tokens"] >= 0.5 * sum(len(o.token_ids) for o in got)
    for o in got:  # probes (rounds of exactly one draft) after 16, then 32, 64 ... rounds of k = 0 (rejected
        # probes back off), overlapped rounds counted: over ~75 rounds at k = 0, two probes
        one_draft_rounds = o.stats.drafted_at[0] - (o.stats.drafted_at[1] if len(o.stats.drafted_at) > 1 else 0)
        assert one_draft_rounds == 2, o.stats
