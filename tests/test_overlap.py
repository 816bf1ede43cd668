"""Overlapped plain decoding (forerun/engine/overlap.py) gives exactly the outputs of ordinary rounds.

The overlap only pays on CUDA, but its bookkeeping (one step in flight, finishing requests, limits, block
tables, coins drawn in the same order) is device-independent, so it is checked here on the CPU with an eager
GraphRunner; tests/test_gpu.py checks it on CUDA graphs.
"""
from __future__ import annotations

import pytest

import forerun.engine.engine as llm_module
from forerun.runtime.cuda_graph import GraphRunner
from forerun.sampling_params import SamplingParams
from tiny import hf_model, sharpen, tiny_llm

PROMPTS = [[5, 9, 13, 22, 40, 7], [3], list(range(10, 60, 3)), [70, 71, 72, 70, 71], [8, 8, 8], [1, 2, 3, 4]]


def make(overlap: bool, **kw):
    llm = tiny_llm(sharpen(hf_model("llama"), 2.0), overlap=overlap, check_invariants=True, **kw)
    sizes = tuple(b for b in (1, 2, 4, 8) if b < llm.max_num_seqs) + (min(8, llm.max_num_seqs),)
    llm.runner.graphs = GraphRunner(llm.runner, batch_sizes=sizes, max_q_len=1, use_graphs=False)
    return llm


def freeze_costs(llm):
    """Adaptive k weighs acceptance against measured (wall-clock) costs; fixed costs make its choices, and so
    the coins drawn, depend on the tokens only, as the comparisons between runs here need. Every wall-clock
    observation is dropped: the forwards and draft steps (fixed below), the rounds' host overheads, the drafter's
    feeds, the overlapped sessions' starts, the realized rates and plain rounds (with only the first two frozen, a
    CI run on a loaded machine drafted at other rounds)."""
    cost, policy = llm.engine.k_policy.cost, llm.engine.k_policy
    for name in ("record_target", "record_draft_step", "record_spec_overhead", "record_round_overhead",
                 "record_draft_feed"):
        setattr(cost, name, lambda *args, **kwargs: None)
    for name in ("record_session", "record_realized", "record_plain_round"):
        setattr(policy, name, lambda *args, **kwargs: None)
    for tokens in (2, 5):
        cost.target_obs.append((tokens, 0.01 + 0.001 * tokens))
    cost.draft_obs.append(0.004)
    return llm


@pytest.fixture
def steps(monkeypatch):
    """Counts the steps run overlapped and the tokens they committed."""
    count = {"steps": 0, "tokens": 0}
    real = llm_module.overlapped_decode

    def spy(*args, **kwargs):
        inner = real(*args, **kwargs)
        while True:
            try:
                produced = next(inner)
            except StopIteration as done:
                return done.value  # the number of steps, which the engine uses
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
    overlapped in sessions that end where the scheduler probes again (rejected probes back off: after 16, then
    32 ... rounds). Tokens and the rounds that drafted are those of the run without overlap."""
    from forerun.config import SpecConfig
    from tiny import ours_from_hf, tiny_tokenizer

    def run(overlap: bool):
        other = ours_from_hf(sharpen(hf_model("llama", seed=5), 2.0)).model  # unrelated weights: ~1/97 agreement
        spec = SpecConfig(method="draft", draft_model=(other, tiny_tokenizer()), adaptive=True, k_max=4)
        llm = freeze_costs(tiny_llm(sharpen(hf_model("llama"), 2.0), spec=spec, overlap=overlap, check_invariants=True))
        llm.runner.graphs = GraphRunner(llm.runner, batch_sizes=(1, 2), max_q_len=5, use_graphs=False)
        return llm.generate([list(range(20, 60)), [5, 9, 13]], SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))

    ref = run(False)
    before = steps["tokens"]
    got = run(True)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.stats.drafted_at for o in got] == [o.stats.drafted_at for o in ref]
    assert steps["tokens"] - before >= 0.5 * sum(len(o.token_ids) for o in got)
    for o in got:  # rounds of exactly one draft: probes (and possibly the first round)
        one_draft_rounds = o.stats.drafted_at[0] - (o.stats.drafted_at[1] if len(o.stats.drafted_at) > 1 else 0)
        assert 2 <= one_draft_rounds <= 3, o.stats


def test_overlap_respects_the_greedy_rule(steps):
    """SpecConfig(rule='greedy') makes every request greedy whatever its temperature; the overlapped sampler
    (rule auto) must then stay out."""
    from forerun.config import SpecConfig

    params = SamplingParams(temperature=0.9, max_tokens=20, seed=3, ignore_eos=True)
    spec = SpecConfig(rule="greedy")
    ref = make(False, spec=spec).generate(PROMPTS[:2], params)
    got = make(True, spec=spec).generate(PROMPTS[:2], params)
    same(got, ref)
    assert steps["steps"] == 0


def test_probe_schedule_unchanged_when_a_request_stops_mid_session(monkeypatch):
    """Adaptive k at 0 with a useless draft; request 0 stops at a stop token inside an overlapped session (the
    step in flight then counts for the other request only). The other request must probe at the same rounds as
    without overlap."""
    from forerun.config import SpecConfig
    from forerun.stats import RequestStats
    from tiny import ours_from_hf, tiny_tokenizer

    drafting_rounds: dict[int, list[int]] = {}  # id(stats) -> indices of the rounds that drafted
    record = RequestStats.record

    def spy(self, drafted, accepted, emitted, nodes=None):
        if drafted:
            drafting_rounds.setdefault(id(self), []).append(self.rounds)
        record(self, drafted, accepted, emitted, nodes)

    monkeypatch.setattr(RequestStats, "record", spy)

    def run(overlap: bool, stop: tuple[int, ...]):
        drafting_rounds.clear()
        other = ours_from_hf(sharpen(hf_model("llama", seed=5), 2.0)).model
        spec = SpecConfig(method="draft", draft_model=(other, tiny_tokenizer()), adaptive=True, k_max=4)
        llm = freeze_costs(tiny_llm(sharpen(hf_model("llama"), 2.0), spec=spec, overlap=overlap, check_invariants=True))
        llm.runner.graphs = GraphRunner(llm.runner, batch_sizes=(1, 2), max_q_len=5, use_graphs=False)
        params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop_token_ids=stop),
                  SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)]
        outs = llm.generate([[5, 9, 13], list(range(20, 60))], params)
        return outs, [drafting_rounds.get(id(o.stats), []) for o in outs]

    stop = (run(False, ())[0][0].token_ids[8],)
    (ref, ref_rounds), (got, got_rounds) = run(False, stop), run(True, stop)
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) < 60
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert got_rounds == ref_rounds and len(got_rounds[1]) >= 3  # the first round and two probes
