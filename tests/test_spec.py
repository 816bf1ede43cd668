"""Speculative generation: greedy identity for every drafter, exact sampling, rollback, stops, adaptive k."""
from __future__ import annotations

import random
import time
from collections import deque

import numpy as np
import pytest
import torch
from scipy import stats

from forerun.config import SpecConfig
from forerun.drafters.ngram import ngram_propose
from forerun.runtime.runner import Chunk
from forerun.engine.k_policy import AcceptanceEstimate, CostModel, KPolicy, choose_k
from forerun.engine.round import RoundItem
from forerun.sampling_params import SamplingParams
from tiny import hf_model, ours_from_hf, sharpen, tiny_llm, tiny_tokenizer

PROMPTS = [[5, 9, 13, 22, 40, 7, 5, 9, 13], [3], list(range(10, 60, 3)), [70, 71, 72, 70, 71, 72, 70]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def draft_spec(draft_hf, **kw):
    runner = ours_from_hf(draft_hf)
    return SpecConfig(method="draft", draft_model=(runner.model, tiny_tokenizer(draft_hf.config.vocab_size)), **kw)


def spec_variants(target_hf):
    return {
        "ngram": SpecConfig(method="ngram", k=3),
        "early-exit": SpecConfig(method="early-exit", early_exit_layers=1, k=3),
        "draft-other": draft_spec(hf_model("llama", seed=7, num_hidden_layers=1), k=4),
        "draft-vocab": draft_spec(hf_model("llama", seed=7, num_hidden_layers=1), k=4, draft_vocab=40),
        "draft-self": draft_spec(target_hf, k=4),
        "draft-auto": draft_spec(target_hf, adaptive=True, k_max=6),
        "early-exit-confident": SpecConfig(method="early-exit", early_exit_layers=2, k=4, confidence_threshold=0.3),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_speculative_is_token_identical_to_plain(arch):
    target = sharpen(hf_model(arch), 3.0) if arch == "llama" else hf_model(arch)
    plain = tiny_llm(target).generate(PROMPTS, GREEDY)
    for name, spec in spec_variants(target).items():
        llm = tiny_llm(target, spec=spec, check_invariants=True)
        outs = llm.generate(PROMPTS, GREEDY)
        for p, o in zip(plain, outs):
            assert o.token_ids == p.token_ids, name
        agg = llm.aggregate_stats(outs)
        if name == "draft-self":
            assert agg.acceptance_rate == 1.0 and agg.tokens_per_target_call > 3
        if name in ("draft-other", "draft-vocab", "early-exit", "ngram"):
            assert agg.drafted > 0, name
        assert llm.runner.kv.num_free_blocks == llm.runner.kv.num_blocks - 1  # everything freed


def _manual_rounds(target_hf, spec, prompt, rounds, ks):
    """Drive the engine's chain round directly and check the caches against a fresh prefill after every round."""
    llm = tiny_llm(target_hf, spec=spec)
    (req,) = llm._requests([prompt], GREEDY, False)
    llm.runner.kv.add_sequence(req.req_id)
    for i in range(rounds):
        feed = req.num_tokens - llm.runner.kv.length(req.req_id)
        res = llm.engine.round.run([RoundItem(req, feed, True, ks[i % len(ks)])])
        req.output_token_ids.extend(res.emitted[0])
        kv = llm.runner.kv
        committed = req.all_tokens[:-1]
        assert kv.length(req.req_id) == len(committed)  # rollback invariant: all but the newest token
        fresh = ours_from_hf(target_hf)
        fresh.kv.add_sequence(0)
        fresh.forward([Chunk(0, committed, logits="none")])
        got = kv.k.flatten(1, 2)[:, kv.slots(req.req_id, 0, len(committed))]  # [L, n, Hkv, D]
        want = fresh.kv.k.flatten(1, 2)[:, fresh.kv.slots(0, 0, len(committed))]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        d = llm.drafter.cached_length(req)
        assert d is None or d <= len(committed)
    return req


def test_rollback_invariant_after_every_round_draft_model():
    target = sharpen(hf_model("llama"), 3.0)
    _manual_rounds(target, draft_spec(target, k=4), PROMPTS[0], 6, [4])  # self-draft: all accepted
    other = hf_model("llama", seed=9, num_hidden_layers=1)
    _manual_rounds(target, draft_spec(other, k=3), PROMPTS[2], 6, [3, 0, 5, 1])


def test_rollback_invariant_after_every_round_early_exit():
    target = sharpen(hf_model("qwen3"), 3.0)
    _manual_rounds(target, SpecConfig(method="early-exit", early_exit_layers=2, k=3), PROMPTS[3], 6, [3, 2, 0])


def test_stop_string_inside_accepted_draft_matches_plain():
    target = sharpen(hf_model("llama"), 3.0)
    tok = tiny_tokenizer()
    ref = tiny_llm(target).generate([PROMPTS[2]], GREEDY)[0].token_ids
    # k = 4 with a perfect draft: round 1 emits tokens 0..4, round 2 emits 5..9 as 4 accepted drafts + bonus.
    j = next(i for i in range(6, 9) if ref[i] not in ref[:i])
    stop = f"t{ref[j]}"
    sp = SamplingParams(temperature=0, max_tokens=24, stop=(stop,), ignore_eos=True)
    plain = tiny_llm(target).generate([PROMPTS[2]], sp)[0]
    llm = tiny_llm(target, spec=draft_spec(target, k=4), check_invariants=True)
    spec = llm.generate([PROMPTS[2]], sp)[0]
    assert spec.stats.acceptance_rate == 1.0
    assert spec.text == plain.text and spec.finish_reason == plain.finish_reason == "stop"
    assert spec.token_ids == plain.token_ids == ref[: j + 1]
    assert stop not in spec.text and spec.text == tok.decode(ref[: j + 1])[: len(spec.text)]


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 6, 11])
def test_max_tokens_exact_with_speculation(max_tokens):
    target = sharpen(hf_model("llama"), 3.0)
    llm = tiny_llm(target, spec=draft_spec(target, k=4), check_invariants=True)
    o = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    assert len(o.token_ids) == max_tokens and o.finish_reason == "length"


def _exact_two_token_distribution(hf, prompt, temperature):
    """P(first) [V] and P(first, second) [V, V] of plain sampling from the target, by enumeration."""
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        batch = torch.tensor([prompt + [x] for x in range(hf.config.vocab_size)])
        p2 = torch.softmax(hf(batch).logits[:, -1] / temperature, -1)
    return p1.double(), (p1[:, None] * p2).double()


def _sampling_pvalues(method: str, seeded: bool, n: int = 6000) -> tuple[float, float]:
    """Chi-square p-values of the first emitted token and of the two-token prefix of n sampled requests (one batch)
    against the target's own distribution (transformers' forward, by enumeration). Seeded requests take the
    position-keyed coupling (verify/coupling.py); unseeded ones the rejection rule (draft) or plain sampling."""
    temperature = 1.3
    target = sharpen(hf_model("llama"), 8.0)
    # prompt [5, 9, X, 5, 9]: the n-gram drafter proposes X; pick the X the target itself likes most
    cands = torch.tensor([[5, 9, x, 5, 9] for x in range(97)])
    with torch.no_grad():
        px = torch.softmax(target(cands).logits[:, -1] / temperature, -1)[torch.arange(97), torch.arange(97)]
    prompt = [5, 9, int(px.argmax()), 5, 9]
    spec = {"none": None, "draft": draft_spec(sharpen(hf_model("llama", seed=3, num_hidden_layers=1), 4.0), k=3),
            # the draft ranks ids 0..39 only (q = 0 on the rest; the target's mass there comes back as residual)
            "draft-vocab": draft_spec(sharpen(hf_model("llama", seed=3, num_hidden_layers=1), 4.0), k=3,
                                      draft_vocab=40),
            "ngram": SpecConfig(method="ngram", k=3),
            "early-exit": SpecConfig(method="early-exit", early_exit_layers=1, k=3)}[method]
    llm = tiny_llm(target, spec=spec, max_num_seqs=2048)
    torch.manual_seed(0)  # (unseeded requests draw from torch's default generator)
    sp = [SamplingParams(temperature=temperature, max_tokens=2, seed=1000 + i if seeded else None, ignore_eos=True)
          for i in range(n)]
    outs = llm.generate([prompt] * n, sp)
    if spec is not None:
        assert llm.aggregate_stats(outs).accepted > 0.03 * n  # speculation really took part
    p1, p12 = _exact_two_token_distribution(target, prompt, temperature)
    first = np.bincount([o.token_ids[0] for o in outs], minlength=97)
    # the two-token prefix jointly (V * V cells, rare ones pooled)
    pairs = np.bincount([o.token_ids[0] * 97 + o.token_ids[1] for o in outs], minlength=97 * 97)
    return _chi2_p(first, p1.numpy(), n), _chi2_p(pairs, p12.flatten().numpy(), n)


@pytest.mark.parametrize("method, seeded", [("draft", True), ("ngram", True), ("early-exit", True),
                                            ("draft", False), ("draft-vocab", False), ("none", False)])
def test_sampling_distribution_equals_plain_sampling(method, seeded):
    """chi-square: the first two emitted tokens of speculative sampling (and of plain sampling, "none") follow the
    target's distribution, through the whole engine (SamplingParams -> tensors -> rule -> commit)."""
    p_first, p_pairs = _sampling_pvalues(method, seeded)
    assert min(p_first, p_pairs) > 1e-3, (p_first, p_pairs)


def test_the_engine_sampling_test_rejects_a_residual_without_subtraction(monkeypatch):
    """Power of the test above on the rejection path: a rejected draft's replacement drawn from p instead of
    max(p - q, 0) (the classic bug) is caught at the same n."""
    import forerun.verify.chain as chain_module

    monkeypatch.setattr(chain_module, "residual_weights", lambda p, q, alpha=1.0: p)
    assert min(_sampling_pvalues("draft", seeded=False)) < 1e-6


def test_the_engine_sampling_test_rejects_a_miscoupled_seed(monkeypatch):
    """Power on the coupled (seeded) path: Gumbel noise scaled by 0.8 (the argmax then samples a sharper
    distribution, as a temperature 20% too low would) is caught at the same n (measured: p ~ 5e-28; at 0.85
    6e-11, at 0.9 only 2e-3: this end-to-end test guards the wiring, the rule-level tests the 1% biases)."""
    import forerun.engine.sampler as sampler_module
    from forerun.verify.coupling import gumbel_noise

    monkeypatch.setattr(sampler_module, "coupled_scores",
                        lambda probs, keys: probs.float().log() + 0.8 * gumbel_noise(keys, probs.shape[-1]))
    assert min(_sampling_pvalues("draft", seeded=True)) < 1e-6


def _chi2_ok(counts, probs, n, alpha=1e-3):
    p = _chi2_p(counts, probs, n)
    assert p > alpha, f"chi2 p={p:.2e}"


def _chi2_p(counts, probs, n) -> float:
    expected = probs * n
    big = expected >= 5  # pool the rare cells
    assert big.sum() >= 10, "test has no power: too few well-populated cells"
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def test_ngram_propose():
    assert ngram_propose([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert ngram_propose([1, 2, 3, 9, 2, 3, 7, 2, 3], 2, 2, 2) == [7, 2]  # latest match wins
    assert ngram_propose([1, 2, 3], 4) == []
    assert ngram_propose([5, 5], 3, 1, 1) == [5]


def test_adaptive_k_choice():
    cheap, flat = CostModel(), CostModel()
    for tokens in (1, 2, 5, 9):
        flat.record_target(tokens, 0.010)  # verification is free (memory-bound)
    flat.record_draft_step(0.0005)
    assert choose_k(0.9, 8, 1, flat) >= 6
    assert choose_k(0.05, 8, 1, flat) <= 1
    expensive = CostModel(flat.target_obs, type(flat.draft_obs)([0.02]))  # drafting costs 2 target steps
    assert choose_k(0.8, 8, 1, expensive) == 0
    for tokens in (1, 2, 5, 9, 64, 128):  # compute-bound: every verified token costs
        cheap.record_target(tokens, 0.001 * tokens)
    cheap.record_draft_step(0.0001)
    assert choose_k(0.6, 8, 64, cheap) == 0
    est = AcceptanceEstimate()
    for _ in range(30):
        est.update(4, 0)
    assert est.alpha < 0.1


def test_adaptive_k_turns_speculation_off_for_a_useless_draft():
    target = sharpen(hf_model("llama"), 3.0)
    useless = hf_model("llama", seed=11, num_hidden_layers=3)  # as costly as the target, disagrees with it
    llm = tiny_llm(target, spec=draft_spec(useless, adaptive=True, k_max=4), check_invariants=True)
    # costs fixed (a cheap drafter: with the prior acceptance 0.6 it would draft k = 2..3): wall-clock timings on a loaded 2-core
    # machine swing 30x between calls; what is tested here is that the acceptance estimate turns drafting off
    cost = llm.engine.k_policy.cost
    cost.record_target = cost.record_draft_step = lambda *args: None
    for tokens in (1, 5):
        cost.target_obs.append((tokens, 0.01 + 0.001 * tokens))
    cost.draft_obs.append(0.001)
    outs = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert outs[0].token_ids == tiny_llm(target).generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].token_ids
    s = outs[0].stats
    assert s.drafted < s.rounds / 2, s  # it mostly stopped drafting (with the prior alone: k = 2 every round)


def test_probes_back_off_while_rejected_and_reset_when_accepted():
    """With k = 0 chosen, the scheduler drafts one token after 16 idle rounds; each rejected probe doubles the
    wait (up to PROBE_MAX), an accepted one brings it back to 16."""
    from forerun.engine.k_policy import KPolicy

    sched = KPolicy(SpecConfig(method="ngram", adaptive=True, k_max=4))
    for tokens in (2, 5):
        sched.cost.record_target(tokens, 0.01 * tokens)  # verification costs: with acceptance 0, k = 0 wins
    sched.cost.record_draft_step(0.005)
    for _ in range(10):
        sched.observe(7, 4, 0)

    def probe_gaps(n_probes, accept):
        gaps, idle = [], 0
        while len(gaps) < n_probes:
            (k,) = sched.ks([7], [100])
            idle += 1
            if k:
                assert k == 1
                gaps.append(idle)
                idle = 0
            sched.observe(7, k, int(accept and k > 0))
        return gaps

    assert probe_gaps(4, accept=False) == [16, 32, 64, 128]  # rounds from one probe to the next, inclusive
    assert probe_gaps(1, accept=False) == [256]
    assert probe_gaps(1, accept=True) == [256]  # the cap; accepted, so the next wait is 16 again (or k > 0)
    assert probe_gaps(1, accept=False)[0] <= 16


def test_adaptive_k_learns_from_empty_proposals():
    """An n-gram drafter that finds nothing when asked for k drafts counts as rejected: k falls to 0."""
    from forerun.engine.k_policy import KPolicy

    pol = KPolicy(SpecConfig(method="ngram", adaptive=True, k_max=4))
    for tokens in (1, 2, 5):  # (1: the plain step is timed, `test_adaptive_k_times_the_plain_step_it_is_weighed_against`)
        pol.cost.record_target(tokens, 0.01 + 0.002 * tokens)
    pol.cost.record_draft_step(0.0001)
    assert pol.ks([3], [100]) != [0]
    for _ in range(30):
        (k,) = pol.ks([3], [100])
        pol.observe(3, 0, 0, wanted=k)  # asked, proposed nothing
    assert pol.ks([3], [100]) == [0]
    before = pol.estimates[3].rate(0)
    pol.observe(3, 0, 0, wanted=0)  # k = 0 asked nothing: no evidence
    assert pol.estimates[3].rate(0) == before


def test_adaptive_k_times_the_plain_step_it_is_weighed_against():
    """Without CUDA graphs (KPolicy.ks): a k > 0 decision is weighed against a plain step the cost model may never
    have timed at this batch size, only extrapolated from verify forwards (on the CPU with int4 weights: 59 ms
    extrapolated, 37 ms real). Then one round decodes plainly to time it; once timed, the model decides; an unanswered
    check is not asked again for PLAIN_RECHECK rounds; and the corrected plain step turns a drafter that only looked
    worth it off."""
    from forerun.engine.k_policy import KPolicy

    pol = KPolicy(SpecConfig(method="ngram", adaptive=True, k_max=4))  # (the drafter's kind does not matter here)
    for tokens in (3, 6):  # verify forwards of 2 requests only: plain (2 tokens) extrapolated from their slope
        pol.cost.record_target(tokens, 0.059 + 0.001 * (tokens - 3))
    pol.cost.record_draft_step(0.012)
    for i in range(20):  # acceptance 0.5
        pol.observe(1, 1, i % 2)
        pol.observe(2, 1, i % 2)
    assert pol.cost.target_time(2) > 0.055  # the extrapolation
    assert pol.ks([1, 2], [50, 50]) == [0, 0] and pol.plain_checks == {2: 1}  # the plain check
    assert pol.ks([1, 2], [50, 50]) != [0, 0]  # unanswered (its round not timed): not asked again at once
    assert all(pol.ks([1, 2], [50, 50]) != [0, 0] for _ in range(KPolicy.PLAIN_RECHECK - 2))
    assert pol.ks([1, 2], [50, 50]) == [0, 0] and pol.plain_checks == {2: 2}  # asked again after PLAIN_RECHECK
    pol.cost.record_target(2, 0.037)  # the plain round, timed: a draft step of 12 ms now costs a third of it
    assert pol.plain_checks == {2: 2} and pol.ks([1, 2], [50, 50]) == [0, 0] and pol.plain_checks == {2: 2}
    for _ in range(3):  # (k = 0 by the model now, not a check)
        assert pol.ks([1, 2], [50, 50]) == [0, 0]
    assert pol.plain_checks == {2: 2}
    cheap = KPolicy(SpecConfig(method="ngram", adaptive=True, k_max=4))  # the same, with a cheap draft: it drafts
    for tokens, sec in ((2, 0.037), (3, 0.059), (6, 0.062)):
        cheap.cost.record_target(tokens, sec)
    cheap.cost.record_draft_step(0.001)
    for _ in range(10):
        cheap.observe(1, 2, 2)
        cheap.observe(2, 2, 2)
    assert all(k > 0 for k in cheap.ks([1, 2], [50, 50])) and not cheap.plain_checks


def test_mismatched_tokenizers_raise():
    target = hf_model("llama")
    other = hf_model("llama", vocab_size=99)
    with pytest.raises(ValueError, match="tokenizers differ"):
        tiny_llm(target, spec=SpecConfig(method="draft", draft_model=(ours_from_hf(other).model, tiny_tokenizer(99))))


def test_nan_logits_raise_naming_the_request():
    target = hf_model("llama")
    with torch.no_grad():
        target.lm_head.weight[5] = float("nan")
    llm = tiny_llm(target)
    with pytest.raises(ValueError, match="request"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.7, max_tokens=3))


def test_confidence_stopping_shortens_drafts_and_keeps_output():
    target = sharpen(hf_model("llama"), 8.0)  # top probabilities spread over ~0.05 .. 0.25
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = tiny_llm(target).generate(PROMPTS, sp)
    free = tiny_llm(target, spec=draft_spec(target, k=4)).generate(PROMPTS, sp)
    llm = tiny_llm(target, spec=draft_spec(target, k=4, confidence_threshold=0.12), check_invariants=True)
    outs = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    drafted = llm.aggregate_stats(outs).drafted
    assert 0 < drafted < 0.8 * tiny_llm(target).aggregate_stats(free).drafted


# -- tree drafting ------------------------------------------------------------------------------------------
def test_tree_shape():
    from forerun.drafters.tree_drafter import TreeShape

    t = TreeShape.from_branching((2, 2, 1))
    assert t.num_nodes == 11 and t.parents[:7] == (-1, 0, 0, 1, 1, 2, 2) and t.depth[-1] == 3
    assert SpecConfig(method="draft", draft_model="x", tree=(2, 2, 1)).max_draft_tokens == 10
    m = t.mask()
    assert m[10].nonzero().flatten().tolist() == [0, 2, 6, 10]  # root, depth-1, depth-2 ancestors, itself


@pytest.mark.parametrize("tree", [(2, 2, 1), (3, 1), (1, 1, 1, 1)])
def test_tree_greedy_identical_to_plain(tree):
    target = sharpen(hf_model("llama"), 3.0)
    plain = tiny_llm(target).generate(PROMPTS, GREEDY)
    for draft in (hf_model("llama", seed=7, num_hidden_layers=1), target):
        llm = tiny_llm(target, spec=draft_spec(draft, tree=tree), check_invariants=True)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        if draft is target:  # the draft's top-1 path is the target's greedy path: every level accepted
            assert llm.aggregate_stats(outs).position_acceptance_rate > 0.8


def test_tree_round_keeps_the_cache_exact():
    """After each tree round the target cache equals a fresh prefill of the committed tokens (path compaction)."""
    target = sharpen(hf_model("llama"), 3.0)
    other = sharpen(hf_model("llama"), 3.0)  # a noisy copy of the target: it agrees often, not always first
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * p.std() * 0.3)
    llm = tiny_llm(target, spec=draft_spec(other, tree=(3, 2)))
    (req,) = llm._requests([PROMPTS[2]], GREEDY, False)
    llm.runner.kv.add_sequence(req.req_id)
    accepted = []
    for _ in range(8):
        feed = req.num_tokens - llm.runner.kv.length(req.req_id)
        res = llm.engine.round.run([RoundItem(req, feed, True, llm.spec.max_draft_tokens)])
        req.output_token_ids.extend(res.emitted[0])
        accepted.append(res.num_accepted[0])
        kv, committed = llm.runner.kv, req.all_tokens[:-1]
        assert kv.length(req.req_id) == len(committed)
        fresh = ours_from_hf(target)
        fresh.kv.add_sequence(0)
        fresh.forward([Chunk(0, committed, logits="none")])
        for cache, fcache in ((kv.k, fresh.kv.k), (kv.v, fresh.kv.v)):
            got = cache.flatten(1, 2)[:, kv.slots(req.req_id, 0, len(committed))]
            want = fcache.flatten(1, 2)[:, fresh.kv.slots(0, 0, len(committed))]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert max(accepted) == 2  # depth-2 nodes (indices 4..9) accepted: their keys were moved to root + 2


def test_tree_sampling_distribution_equals_plain_sampling():
    """chi-square: exact multi-draft tree sampling keeps the first two tokens distributed as the target's."""
    temperature, n = 1.3, 6000
    target = sharpen(hf_model("llama"), 8.0)
    draft = sharpen(hf_model("llama", seed=3, num_hidden_layers=1), 4.0)
    llm = tiny_llm(target, spec=draft_spec(draft, tree=(3, 2)), max_num_seqs=2048)
    prompt = [5, 9, 13, 5, 9]
    sp = [SamplingParams(temperature=temperature, max_tokens=3, seed=7000 + i, ignore_eos=True) for i in range(n)]
    outs = llm.generate([prompt] * n, sp)
    assert llm.aggregate_stats(outs).accepted > 0.05 * n
    p1, p12 = _exact_two_token_distribution(target, prompt, temperature)
    _chi2_ok(np.bincount([o.token_ids[0] for o in outs], minlength=97), p1.numpy(), n)
    pairs = np.bincount([o.token_ids[0] * 97 + o.token_ids[1] for o in outs], minlength=97 * 97)
    _chi2_ok(pairs, p12.flatten().numpy(), n)


def test_per_position_acceptance_estimate():
    est = AcceptanceEstimate(decay=1.0, prior_weight=1e-9)
    for _ in range(20):  # first draft accepted 3 times in 4; after that, always
        est.update(4, 4)
        est.update(4, 4)
        est.update(4, 4)
        est.update(4, 0)
    assert est.rate(0) == pytest.approx(0.75) and est.rate(1) == pytest.approx(1.0)
    assert est.expected_tokens(4) == pytest.approx(1 + 4 * 0.75)
    flat = CostModel()
    for tokens in (1, 2, 5, 9):
        flat.record_target(tokens, 0.010)
    flat.record_draft_step(0.002)
    assert choose_k(est, 8, 1, flat) >= 4
    geometric = AcceptanceEstimate(decay=1.0, prior_weight=1e-9)
    for _ in range(40):
        geometric.update(1, 1)
        geometric.update(1, 0)
    assert geometric.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)  # unseen positions use the last prior


def test_batch_k_speculates_small_batches_and_stops_where_verify_rows_are_dear():
    """batch_k (one k per batch, CUDA graphs): with acceptance 0.8 and a target whose cost grows with the tokens
    it verifies (compute-bound at large batch), batch 1 speculates and batch 64 decodes plainly; after
    PROBE_EVERY plain rounds the batch probes with k = 1, and a probe that still leaves k = 0 doubles the wait."""
    from forerun.engine.k_policy import KPolicy

    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=6))
    for tokens in (1, 4, 64, 128, 320):  # 4 ms flat up to ~64 tokens, then 0.05 ms per token
        pol.cost.record_target(tokens, 0.004 + 0.00005 * max(0, tokens - 64))
    pol.cost.record_draft_step(0.0008)
    rng = np.random.default_rng(0)
    for rid in range(64):
        for _ in range(30):  # each draft accepted with probability 0.8 until the first miss
            m = 0
            while m < 4 and rng.random() < 0.8:
                m += 1
            pol.observe(rid, 4, m, wanted=4)
    assert pol.batch_k([0], [100]) >= 3
    pol.batch_idle = 0
    ids = list(range(64))
    # a probe's catch-up covers every request: at 64 requests the batch waits 64 / PROBE_BATCH times as long
    wait = KPolicy.PROBE_EVERY * 64 // KPolicy.PROBE_BATCH
    ks = [pol.batch_k(ids, [100] * 64) for _ in range(wait)]
    assert ks[:-1] == [0] * (wait - 1) and ks[-1] == 1  # the probe
    assert pol.batch_k(ids, [100] * 64) == 0  # still not worth drafting: the next probe waits twice as long
    assert pol.batch_probe_every == 2 * KPolicy.PROBE_EVERY
    assert pol.rounds_before_probe(ids) == 2 * wait - 1
    assert pol.rounds_before_probe(ids[:KPolicy.PROBE_BATCH]) == 2 * KPolicy.PROBE_EVERY - 1  # (small batches)
    assert pol.batch_k([0], [100]) >= 3 and pol.batch_idle == 0  # a batch where drafting pays


def test_a_probe_does_not_record_the_drafters_catch_up_as_a_draft_step(virtual_sleep):
    """A k = 1 probe after k = 0 rounds first feeds the draft model every token it missed; that catch-up is not
    the cost of a draft step. Recording it as one (as the whole drafting phase per draft token) made the CPU
    pair's adaptive k see 50-100 ms steps instead of 20 ms and stay at k = 0 (0.2x plain in eagle_cpu.json)."""
    target = hf_model("llama")
    llm = tiny_llm(target, spec=draft_spec(hf_model("llama", seed=3, num_hidden_layers=1), adaptive=True, k_max=4))
    eng = llm.engine
    seen = []
    eng.k_policy.cost.record_draft_step = lambda s, batch=None: seen.append(s)
    feed = eng.drafter.feed

    def slow_feed(*args, **kw):
        virtual_sleep(30.0)  # a catch-up that looks 30 s long to the timers
        return feed(*args, **kw)

    eng.drafter.feed = slow_feed
    rounds = iter(range(10 ** 6))
    # a 3-draft round every 5th (steps past the first are timed), each after a 4-token backlog fed by drafter.feed
    eng.k_policy.ks = lambda ids, room, plain_check=True, **kw: [min(3, r) if next(rounds) % 5 == 4 else 0 for r in room]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], sp)[0]
    assert out.stats.drafted >= 6  # the drafting rounds ran
    assert seen and all(s < 10.0 for s in seen), seen  # (a real step: milliseconds)
    assert out.token_ids == tiny_llm(target).generate([PROMPTS[0]], sp)[0].token_ids


def test_choose_k_tries_k1_where_its_cost_is_a_guess_that_loses_narrowly():
    """choose_k: forwards of 1 and 5 tokens timed (40 / 86 ms, a 13 ms draft step), the line between them prices 2
    tokens at 51.5 ms and k = 1 at a = 0.55 loses to plain by ~4 %: k = 1 is tried (the round times 2 tokens). Timed
    at 45 ms (what they cost on the Zen 3), k = 1 wins on the model; timed at 60 ms, plain. Far below plain
    (a = 0.1: it loses even at the guess's floor, 40 ms), no try."""
    cost = CostModel()
    for tokens, sec in ((1, 0.040), (5, 0.086)):
        cost.record_target(tokens, sec)
    cost.record_draft_step(0.013)
    assert not cost.timed(2) and cost.timed(5)
    est = AcceptanceEstimate(prior=0.55, prior_weight=1e9)
    rate = [est.expected_tokens(k) / cost.round_seconds(k + 1, k, 1) for k in (0, 1)]
    assert 0.95 < rate[1] / rate[0] < 1.0  # plain wins on paper
    assert choose_k(est, 4, 1, cost) == 1
    assert choose_k(AcceptanceEstimate(prior=0.1, prior_weight=1e9), 4, 1, cost) == 0
    cost.record_target(2, 0.045)
    assert choose_k(est, 4, 1, cost) == 1
    cost.target_obs.clear()
    for tokens, sec in ((1, 0.040), (2, 0.060), (5, 0.086)):
        cost.record_target(tokens, sec)
    assert choose_k(est, 4, 1, cost) == 0


def test_a_catch_up_is_paid_for_only_where_drafting_repays_it():
    """KPolicy.catch_up_pays: drafting for a request whose draft cache lacks `lag` tokens (its prompt, or a plain
    stretch) must save more over its remaining tokens than the draft's read of them costs (its measured seconds
    per fed token). Here a plain round of 2 requests costs 40 ms, a k = 2 round 80 ms for 2.44 tokens each at
    a = 0.8 (32.8 ms a token: 7.2 ms saved per token), and the draft reads 1.5 ms a token: a 100-token prompt
    (150 ms) is repaid by a 32-token answer (230 ms saved), not by a 16-token one (115 ms). Not while the batch
    size sits out a veto, and not where the rounds at this batch size measured drafting no faster than plain."""
    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=2))
    pol.cost.record_target(2, 0.040)
    pol.cost.record_target(6, 0.060)
    for _ in range(3):
        pol.cost.record_draft_step(0.010, 2)
    for _ in range(400):
        pol.observe(7, 2, 1, wanted=2)  # position 1: 1.0 of reached, position 2: 0.5 ... (the pool follows)
    pol.estimates[7] = AcceptanceEstimate(prior=0.8, prior_weight=1e9)  # a = 0.8 exactly at every position
    assert pol.catch_up_pays(7, 100, 32, 2)  # no feed timed yet: drafting as before
    pol.cost.record_draft_feed(100, 0.150)
    assert pol.cost.draft_feed_per_token() == pytest.approx(0.0015)
    for _ in range(5):  # short catch-ups (~a forward's fixed cost each) weigh by their tokens, not one ratio each
        pol.cost.record_draft_feed(2, 0.028)
    assert pol.cost.draft_feed_per_token() == pytest.approx((0.150 + 5 * 0.028) / 110)  # (a median: 14 ms)
    pol.cost.feed_obs.clear()
    pol.cost.record_draft_feed(100, 0.150)
    assert pol.catch_up_pays(7, 100, 32, 2, k=2) and not pol.catch_up_pays(7, 100, 16, 2, k=2)
    assert pol.catch_up_pays(7, pol.spec.max_draft_tokens + 2, 1, 2)  # what a round leaves behind: never priced
    # ks drops k for the request whose catch-up does not pay, keeps it for the one that does
    ks = pol.ks([7, 7], [2, 2], plain_check=False, lags=[100, 100], remaining=[32, 16])
    assert ks == [2, 0], ks
    # while the batch size sits out a veto nothing drafts: no read pays
    pol._held[pol._bucket(2)] = [3, 16]
    assert not pol.catch_up_pays(7, 100, 32, 2, k=2)
    pol._held.clear()
    # what the rounds measured overrules the model where it is less favourable to drafting: rounds at 2 requests
    # that realized 1.2 tokens per request in 50 ms (41.7 ms a token), plain rounds of 40 ms: a 1000-token answer
    # would not repay the read; drafting that realizes 2 tokens in 50 ms (25 ms a token) still does
    for _ in range(3):
        pol.record_plain_round(2, 0.040)
    assert pol.catch_up_pays(7, 100, 32, 2, k=2)
    for _ in range(KPolicy.REALIZED_MIN):
        pol.record_realized(2, 2.4, 0.050)
    assert not pol.catch_up_pays(7, 100, 1000, 2, k=2)
    pol.realized.clear()
    for _ in range(KPolicy.REALIZED_MIN):
        pol.record_realized(2, 4, 0.050)
    assert pol.catch_up_pays(7, 100, 32, 2, k=2)
    # a round that carried a prompt's prefill (0.7 s for 1 token a request, plain's equivalent 0.66 s) prices
    # nothing here: the raw rate (15 tokens in 1.05 s: 70 ms a token) is not drafting's cost per token (session 38)
    pol.realized.clear()
    pol.record_realized(2, 2, 0.7, plain=(2, 0.66))
    for _ in range(KPolicy.REALIZED_MIN - 1):
        pol.record_realized(2, 4, 0.050)
    assert pol.realized_rate(2) < 1 / 0.040 < pol.realized_rate(2, pure=True) == pytest.approx(40.0)
    assert pol.catch_up_pays(7, 100, 32, 2, k=2)
    # a probe (optimistic: a typical draft's acceptance, 0.6) is weighed against the plain rounds timed too: k = 1
    # at 37.5 ms a token against the model's 40 ms plain step repays a 100-token read over 100 tokens, not
    # against plain rounds timed at 35 ms
    pol.realized.clear()
    pol.plain_rounds.clear()
    assert pol.catch_up_pays(7, 100, 100, 2, k=1, optimistic=True)
    for _ in range(3):
        pol.record_plain_round(2, 0.035)
    assert not pol.catch_up_pays(7, 100, 100, 2, k=1, optimistic=True)


def _zen2_int4_pair_policy() -> KPolicy:
    """A policy with the costs the Zen 2 int4 Qwen2.5-Coder pair had timed after two k = 4 rounds (session 59):
    forwards of 1 and 5 tokens (46.8 / 103.7 ms; the line prices 2 at 61 ms, they cost ~55), a 16.4 ms draft step,
    plain rounds of 48.2 ms, the draft reading 4.6 ms a token."""
    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=4))
    pol.cost.record_target(1, 0.0468)
    pol.cost.record_target(5, 0.1037)
    for _ in range(3):
        pol.cost.record_draft_step(0.0164, 1)
        pol.cost.record_round_overhead(0.0014)
        pol.record_plain_round(1, 0.0482)
    pol.cost.record_draft_feed(43, 43 * 0.0046)
    return pol


def test_choose_k_tries_k1_where_it_wins_at_its_guessed_costs_floor():
    """choose_k on the Zen 2 pair's costs: after a warm-up's rejected draft, a first round rejected at once and a
    second fully accepted, the request's rates are 0.44 / 0.84. On the line's 61 ms for 2 tokens k = 1 loses to plain
    by 12 % (session 38's 10 % margin did not try it, and adaptive k ran at 0.96x plain where k = 1 ran at 1.20x); at
    the guess's floor (a forward of 1 token) it wins: tried. Timed at the line's 61 ms, plain."""
    pol = _zen2_int4_pair_policy()
    pol.observe(0, 1, 0)  # the warm-up request of 2 tokens (`forerun generate --compare-plain`): rejected
    pol.observe(1, 4, 0)
    pol.observe(1, 4, 4)
    est = pol._estimate(1)
    assert [round(r, 2) for r in est.rates(2)] == [0.44, 0.84]  # as logged in that run
    cost = pol.cost
    rate = [est.expected_tokens(k) / cost.round_seconds(k + 1, k, 1) for k in (0, 1)]
    assert 0.85 < rate[1] / rate[0] < 0.9  # plain wins on the line by more than session 38's margin
    assert cost.target_floor(2) == 0.0468 and cost.target_floor(7) == 0.1037  # the largest count timed below
    assert choose_k(est, 4, 1, cost) == 1
    cost.record_target(2, 0.061)
    assert choose_k(est, 4, 1, cost) == 0


def test_a_probe_priced_on_a_guessed_verify_cost_is_not_shut_out_for_good():
    """A probe (k = 1) whose verify forward of 2 tokens a request was never timed is priced at GUESS_MARGIN of the
    line's guess. On the Zen 2 pair's costs with this request's drafts mostly rejected (choose_k: k = 0 even at the
    guess's floor), the probe due 16 rounds later, at a typical draft's a = 0.6, does not repay the draft's catch-up
    over the 17 plain tokens on the line's 61 ms; as every plain round adds to the catch-up and takes from the tokens
    left, no later probe would either (before session 59: 2 drafting rounds in 96 tokens, 0.96x plain)."""
    pol = _zen2_int4_pair_policy()
    pol.observe(0, 1, 0)
    pol.observe(1, 4, 0)
    pol.observe(1, 4, 0)
    assert choose_k(pol._estimate(1), 4, 1, pol.cost) == 0
    rounds, probe = 0, None
    for lag in range(2, 94):  # the same request, round after round
        ks = pol.ks([1], [4], plain_check=False, lags=[lag], remaining=[92 - lag])
        rounds += 1
        if ks[0]:
            probe = (rounds, ks[0], lag)
            break
    assert probe is not None and probe[:2] == (KPolicy.PROBE_EVERY, 1), probe  # it probes when due, with k = 1
    assert pol.catch_up_pays(1, 17, 75, 1, k=1, optimistic=True)
    pol.GUESS_MARGIN = 1.0  # priced on the line itself (power check: the trap)
    assert not pol.catch_up_pays(1, 17, 75, 1, k=1, optimistic=True)
    pol.GUESS_MARGIN = KPolicy.GUESS_MARGIN
    # once a forward of 2 tokens is timed, the probe is priced on it: at the line's 61 ms it does not repay the
    # catch-up (the margin is for the guess only), at the ~55 ms measured it does
    pol.cost.record_target(2, 0.061)
    assert not pol.catch_up_pays(1, 17, 75, 1, k=1, optimistic=True)
    pol.cost.target_obs.clear()
    for tokens, sec in ((1, 0.0468), (2, 0.055), (5, 0.1037)):
        pol.cost.record_target(tokens, sec)
    assert pol.catch_up_pays(1, 17, 75, 1, k=1, optimistic=True)


def test_the_cpu_path_prices_the_drafts_prompt_reads():
    """Engine, CPU path (adaptive k per request, a separate draft model): the draft's reads of prompt chunks are
    timed (KPolicy.cost.record_draft_feed) and a prompt is read by the draft only where drafting repays it
    (Engine._feed_pays -> catch_up_pays). With the read priced out, no prompt is fed and the lagging requests
    decode plainly; outputs equal plain greedy either way."""
    target = hf_model("llama")
    draft = hf_model("llama", seed=3, num_hidden_layers=1)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in tiny_llm(target).generate(prompts, sp)]
    for priced_out in (False, True):
        llm = tiny_llm(target, spec=draft_spec(draft, adaptive=True, k_max=3), max_num_batched_tokens=8)
        eng, timed, chunks, in_round = llm.engine, [], [], [False]
        real_record, real_feed, real_pass = eng.k_policy.cost.record_draft_feed, eng.drafter.feed, eng.round._feed_drafter
        eng.k_policy.cost.record_draft_feed = lambda t, s: (timed.append(t), real_record(t, s))

        def feed(requests, upto):  # prompt chunks the round passes on (not the drafting's own catch-ups)
            if in_round[0]:
                chunks.append(len(requests))
            return real_feed(requests, upto)

        def pass_on(items):
            in_round[0] = True
            try:
                return real_pass(items)
            finally:
                in_round[0] = False

        eng.drafter.feed, eng.round._feed_drafter = feed, pass_on
        if priced_out:
            eng.k_policy.catch_up_pays = lambda *a, **kw: False
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == want
        # every read of the draft's own cache is timed (prompt chunks passed on, catch-ups inside drafting)
        assert timed and all(t > 0 for t in timed) and eng.k_policy.cost.draft_feed_per_token() > 0
        if priced_out:  # no prompt chunk passed on; drafting only before the policy had timed two forwards
            assert not chunks, chunks
            # the plain rounds are timed, by their batch size: the step the veto weighs drafting against
            timed_plain = eng.k_policy.plain_rounds
            assert timed_plain and set(timed_plain) <= {1, 2, 3} and sum(map(len, timed_plain.values())) >= 20
        else:  # (prompts longer than the 8-token budget are read in chunks, the draft reading along)
            assert len(chunks) >= 3, chunks


def test_the_cpu_path_leaves_the_drafts_priced_reads_out_of_the_realized_rounds():
    """Engine, CPU path: the draft's reads longer than a round leaves behind (a prompt), which catch_up_pays priced
    before they ran, are left out of the wall time each speculative round records for the veto
    (KPolicy.record_realized): counted there, one prompt read in the first rounds of every request realized less
    than plain and turned drafting off (session 38). Reads made slow here (0.3 s): no recorded round holds one."""
    target = hf_model("llama")
    llm = tiny_llm(target, spec=draft_spec(hf_model("llama", seed=3, num_hidden_layers=1), adaptive=True, k_max=3))
    eng, reads, recorded = llm.engine, [], []
    forward, record = eng.drafter.runner.forward, eng.k_policy.record_realized

    def slow_reads(chunks, **kw):
        if sum(len(c.token_ids) for c in chunks) > eng.spec.max_draft_tokens + 2:
            reads.append(chunks)
            time.sleep(0.3)
        return forward(chunks, **kw)

    eng.drafter.runner.forward = slow_reads
    eng.k_policy.record_realized = lambda n, tokens, seconds, plain=None: (recorded.append(seconds),
                                                                           record(n, tokens, seconds, plain))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for p in (PROMPTS[2], PROMPTS[0]):
        assert llm.generate([p], sp)[0].token_ids == tiny_llm(target).generate([p], sp)[0].token_ids
    assert reads and recorded and max(recorded) < 0.25, (len(reads), recorded)


def test_the_cpu_path_prices_a_prompts_read_at_the_batch_it_will_decode_in():
    """Engine._decode_batch: a prompt's last chunk is decided alone (the scheduler's k_for([r]) at admission), but its
    draft read is priced at the batch it will decode in: running, these, and the waiting requests (at most
    max_num_seqs). Two prompts arriving together were read at a batch of one, where drafting paid, and decoded at
    two, where the veto had stopped drafting."""
    llm = tiny_llm(hf_model("llama"), spec=draft_spec(hf_model("llama", seed=3, num_hidden_layers=1), adaptive=True,
                                                     k_max=3))
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for p in PROMPTS[:3]:
        eng.add_request(p, sp)
    first = eng.scheduler.waiting[0]
    assert eng._decode_batch([first]) == 3
    eng.scheduler.max_num_seqs = 2
    assert eng._decode_batch([first]) == 2
    eng.scheduler.max_num_seqs = 8
    asked, real = [], eng.k_policy.ks
    eng.k_policy.ks = lambda ids, *a, **kw: (asked.append((len(ids), kw.get("batch"))), real(ids, *a, **kw))[1]
    while eng.has_unfinished():
        eng.step()
    assert asked and all(b is not None and b >= n for n, b in asked), asked
    assert any(n == 1 and b == 3 for n, b in asked), asked  # (a prompt admitted alone, two others queued or running)


def test_draft_step_time_and_spec_overhead_are_medians():
    cost = CostModel()
    for s in (0.02, 0.02, 0.021, 0.1, 0.12):
        cost.record_draft_step(s)
    assert cost.draft_step_time() == 0.021
    for s in (0.0005, 0.0004, 1.13, 0.0004, 1.17, 0.0005, 0.0003):  # two rounds that waited on a compile
        cost.record_spec_overhead(s)
    assert cost.spec_overhead() == 0.0005


def test_draft_step_time_follows_the_batch_size():
    """A draft step's cost depends on the batch it drafts for (on the H200 the 0.6B draft: ~1 ms for one request,
    ~2 ms for 64). The cost model keeps steps by batch-size bucket and prices a round with its own batch's (the
    nearest bucket timed when its own was not), so a stretch at 64 requests does not make drafting look twice as
    dear at one request; batch_k follows: k > 0 at one request, 0 at 64, from the same observations."""
    cost = CostModel()
    for _ in range(5):
        cost.record_draft_step(0.001, 1)
        cost.record_draft_step(0.002, 64)
    assert cost.draft_step_time(1) == 0.001 and cost.draft_step_time(2) == 0.001
    assert cost.draft_step_time(40) == 0.002 and cost.draft_step_time(64) == 0.002
    assert cost.draft_step_time(3) == 0.001  # (bucket 4: nearer to 1 than to 64)
    assert cost.draft_step_time(8) == 0.002  # (bucket 8: as far from 1 as from 64; a tie takes the dearer one)
    assert cost.round_seconds(2, 1, 1) < cost.round_seconds(2, 1, 64)
    cost.record_draft_step(0.05, 16)  # one step in a bucket of its own does not price it (an outlier)
    assert cost.draft_step_time(16) == 0.002
    before = cost.draft_step_time()
    cost.record_draft_step(0.5)  # without a batch: the pooled record only
    assert cost.draft_step_time(1) == 0.001 and cost.draft_step_time() >= before

    # the decision: forwards of 1-128 tokens all cost 4.4 ms, acceptance ~0.35. At one request a round of k = 1
    # takes 4.4 + 1.0 ms for 1.35 tokens (0.25 per ms against plain's 0.227): draft. At 64 it takes 4.4 + 2.0 ms
    # (0.21 per ms): do not. Priced with every step pooled (median 2 ms) both would decode plainly.
    cost = CostModel()
    for n in (1, 2, 64, 128):
        for _ in range(3):
            cost.record_target(n, 0.0044)
    for _ in range(5):
        cost.record_draft_step(0.002, 64)
    for _ in range(3):
        cost.record_draft_step(0.001, 1)
    assert cost.draft_step_time() == 0.002
    overall = AcceptanceEstimate(decay=0.99)
    for i in range(200):
        overall.update(1, int(i % 20 < 7))
    assert 0.3 < overall.rates(1)[0] < 0.4

    def decide(n: int) -> int:
        pol = KPolicy(SpecConfig(method="ngram", adaptive=True, k_max=1))
        pol.cost, pol.overall = cost, overall
        return pol.batch_k(list(range(n)), [1] * n)

    assert decide(1) == 1 and decide(64) == 0


def test_adaptive_k_at_zero_leaves_new_prompts_to_the_drafters_catch_up():
    """While adaptive k sits at 0, a new prompt is not fed to the draft model on arrival (an eager draft prefill
    per arrival cost 13-17 % of plain throughput at 8-64 requests on the H200); if drafting resumes, the catch-up
    feeds it, and the drafts are as good as ever (the draft is the target here: every draft accepted)."""
    target = hf_model("llama")
    prompt = list(range(10, 90, 2))  # 40 tokens in 8-token chunks: 4 prefill chunks before the final one
    llm = tiny_llm(target, spec=draft_spec(target, adaptive=True, k_max=4), max_num_batched_tokens=8)
    eng = llm.engine
    state = {"round": 0}
    calls = []
    feed = eng.drafter.feed

    def spy(reqs, upto):
        calls.append(state["round"])
        return feed(reqs, upto)

    def ks(ids, room, plain_check=True, **kw):
        state["round"] += 1
        return [0 if state["round"] <= 6 else min(3, r) for r in room]

    eng.drafter.feed = spy
    eng.k_policy.ks = ks
    eng.k_policy.idle = lambda: state["round"] < 6
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    out = llm.generate([prompt], sp)[0]
    assert calls and min(calls) >= 6, calls  # fed first when drafting resumed (not with the prefill chunks)
    assert out.stats.drafted > 0 and out.stats.accepted == out.stats.drafted
    assert out.token_ids == tiny_llm(target).generate([prompt], sp)[0].token_ids


def test_batch_probe_counts_as_accepted_only_when_drafting_lasts():
    """A probe whose drafting stops again within PROBE_HOLD rounds is a failed probe (the wait doubles): each
    switch to drafting pays the draft's catch-up, so flipping every few rounds costs more than either mode."""
    from forerun.engine.k_policy import KPolicy

    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=4))
    for rid in range(2):
        for _ in range(20):
            pol.observe(rid, 4, 4, wanted=4)  # acceptance ~1
    cheap, dear = CostModel(), CostModel()
    for tokens in (2, 4, 10):
        cheap.record_target(tokens, 0.004)
        dear.record_target(tokens, 0.004 * tokens)
    cheap.record_draft_step(0.0005)
    dear.record_draft_step(0.01)
    ids, room = [0, 1], [100, 100]

    def run(cost, rounds):
        pol.cost = cost
        return [pol.batch_k(ids, room) for _ in range(rounds)]

    assert run(dear, KPolicy.PROBE_EVERY)[-1] == 1  # the probe
    assert all(run(cheap, 3)) and run(dear, 1) == [0]  # drafting lasted 3 rounds only
    assert pol.batch_probe_every == 2 * KPolicy.PROBE_EVERY
    ks = run(dear, 2 * KPolicy.PROBE_EVERY - 1)  # (the failed round counted as the first idle one)
    assert ks[-1] == 1 and not any(ks[:-1])
    assert all(run(cheap, KPolicy.PROBE_HOLD)) and pol.batch_probe_every == KPolicy.PROBE_EVERY  # it lasted


def test_failed_batch_probes_back_off_to_batch_probe_max():
    """Each failed batch probe doubles the plain rounds before the next, up to BATCH_PROBE_MAX (above the per-request
    PROBE_MAX: a batch probe ends the overlapped session and catches the draft up, 8-17 ms on the H200)."""
    from forerun.engine.k_policy import KPolicy

    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=4))
    for rid in range(2):
        for _ in range(20):
            pol.observe(rid, 4, 0, wanted=4)  # a useless draft
    for tokens in (2, 4, 10):
        pol.cost.record_target(tokens, 0.004 * tokens)
    pol.cost.record_draft_step(0.01)
    ids, room, ks = [0, 1], [100, 100], []
    while sum(ks) < 9:
        ks.append(pol.batch_k(ids, room))  # every probe fails: the next call decodes plainly again
    probes = [i for i, k in enumerate(ks) if k]
    waits = [probes[0] + 1] + [b - a for a, b in zip(probes, probes[1:])]  # calls from one probe to the next
    assert KPolicy.BATCH_PROBE_MAX > KPolicy.PROBE_MAX
    assert waits[-1] == KPolicy.BATCH_PROBE_MAX and waits[-2] == KPolicy.BATCH_PROBE_MAX, waits
    assert waits[:3] == [KPolicy.PROBE_EVERY, 2 * KPolicy.PROBE_EVERY, 4 * KPolicy.PROBE_EVERY], waits


def test_round_overhead_counts_once_per_round_for_plain_and_speculative_alike():
    """Without overlapped decoding every round pays the host work (scheduling, sampling, commit) once: plain
    decoding per token, a speculative round once for several. With it in the model, drafting wins where the
    forward costs alone say k = 0 (the CPU pair: k = 4 ran 1.20x plain while adaptive k chose 0)."""
    cost = CostModel()
    cost.record_target(1, 0.026)
    cost.record_target(5, 0.032)
    cost.record_draft_step(0.030)
    assert choose_k(0.8, 6, 1, cost) == 0
    for s in (0.04, 0.041, 0.5, 0.039):
        cost.record_round_overhead(s)
    assert cost.round_overhead() == 0.041
    assert choose_k(0.8, 6, 1, cost) > 0
    # the engine records it on the CPU (no CUDA graphs), for plain and speculative rounds
    target = hf_model("llama")
    llm = tiny_llm(target, spec=draft_spec(hf_model("llama", seed=3, num_hidden_layers=1), adaptive=True, k_max=4))
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    cost = llm.engine.k_policy.cost
    assert len(cost.round_obs) >= 3 and not cost.overhead_obs


def test_one_rejected_draft_does_not_switch_a_new_request_off():
    """A new request's acceptance estimate starts from the engine-wide one with the weight of 4 observations:
    with the weight of 1, one rejected first draft halved it and turned the request to k = 0 until a probe 16
    rounds later (the CPU int4 pair: 78 of 160 decisions k = 0, adaptive 0.95x plain while k = 4 ran 1.06x)."""
    from forerun.engine.k_policy import KPolicy

    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=4))
    for tokens, s in ((1, 0.023), (2, 0.024), (3, 0.027), (5, 0.032)):
        pol.cost.record_target(tokens, s)
    pol.cost.record_draft_step(0.0126)
    for rid in range(10):  # earlier requests: ~0.89 of first drafts accepted
        for i in range(9):
            pol.observe(rid, 2, 2 if i % 9 else 0, wanted=2)
    assert pol.ks([100], [40]) != [0]
    pol.observe(100, 1, 0, wanted=1)  # the new request's first draft is rejected
    assert pol.ks([100], [40]) != [0]


def test_the_answers_first_token_has_its_own_acceptance_estimate():
    """ks (no CUDA graphs): a request's first round drafts the answer's first token from the prompt, where draft and
    target disagree more than after (the Qwen2.5-Coder pair on the bench prompts: the 0.5B opens with "Here" or
    "To", the 1.5B with "```", every time). Those drafts go to `KPolicy.first`, which decides the first round's k,
    and not into the request's or the engine-wide estimate; once they are seen to fail, a first round drafts
    nothing, save every PROBE_EVERY-th (one token) in case the draft now agrees."""
    from forerun.engine.k_policy import KPolicy

    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k=4, k_max=4))
    # before the cost model is warm: the configured k, but one draft in a first round (it can only learn whether
    # the first token is guessed)
    assert pol.ks([50], [40]) == [1]
    pol.observe(50, 1, 1, wanted=1)
    assert pol.ks([50], [40]) == [4]
    pol.forget(50)
    pol.first = AcceptanceEstimate(decay=KPolicy.FIRST_DECAY)
    for tokens, s in ((1, 0.023), (2, 0.024), (3, 0.027), (5, 0.032)):
        pol.cost.record_target(tokens, s)
    pol.cost.record_draft_step(0.0126)
    firsts = []
    for rid in range(12):  # each request: a first round whose drafts fail, then 8 rounds fully accepted
        k = pol.ks([rid], [40])[0]
        firsts.append(k)
        pol.observe(rid, k, 0, wanted=k)
        assert pol.ks([rid], [40])[0] > 0  # the rounds after the first draft as before
        for _ in range(8):
            pol.observe(rid, 2, 2, wanted=2)
        pol.forget(rid)
    assert firsts[0] > 0 and firsts[-1] == 0, firsts  # (the prior's 0.6 drafts; after a failure, not)
    assert pol.first.rate(0) <= 0.3 and pol.overall.rate(0) > 0.95
    skips = firsts.index(0)
    for rid in range(12, 12 + 2 * KPolicy.PROBE_EVERY):  # the first rounds that follow: one in PROBE_EVERY drafts 1
        k = pol.ks([rid], [40])[0]
        firsts.append(k)
        pol.observe(rid, k, 0, wanted=k)
        pol.forget(rid)
    later = firsts[12:]
    assert sum(k > 0 for k in later) == 2 and max(later) == 1, (skips, later)
    # power check: counted with the request's own drafts (the policy before session 61), the same first rounds
    # would have pulled the engine-wide first-position rate down
    old = AcceptanceEstimate(decay=0.99)
    for _ in range(12):
        old.update(2, 0)
        for _ in range(8):
            old.update(2, 2)
    assert old.rate(0) < 0.9


def test_a_veto_needs_a_measured_plain_step():
    """KPolicy.plain_step: the realized-rate veto compares drafting with plain decoding's measured step (a plain
    session's steady step at this batch size, or a forward of no more tokens), never with the cost model's
    extrapolation below the verify forwards it has seen (on the H200 at 64 requests it put a 52-request step at
    3.75 ms against 6.24 ms measured, and the vetoes sent a = 0.8 to plain decoding at 0.79-0.96x plain)."""
    from forerun.engine.k_policy import KPolicy

    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=4))
    for tokens, seconds in ((32, 0.008), (40, 0.012)):  # 8 requests verifying 4-5 tokens; a steep local slope
        for _ in range(3):
            pol.cost.record_target(tokens, seconds)
    pol.cost.record_draft_step(0.0005)
    for rid in range(8):
        for _ in range(20):
            pol.observe(rid, 4, 3, wanted=4)
    ids, room = list(range(8)), [100] * 8
    assert pol.plain_step(8) is None and pol.cost.target_time(8) == 0.004  # (extrapolated: half the 32-token time)
    assert pol.batch_k(ids, room) >= 1
    for _ in range(KPolicy.REALIZED_MIN):  # 2 tokens per request in 8.5 ms: 235 tok/s, the extrapolation says 250
        pol.record_realized(8, 16, 0.0085)
    assert pol.plain_rate(8) > pol.realized_rate(8)
    assert pol.batch_k(ids, room) >= 1 and pol.vetoes == 0  # no plain step measured: no veto
    pol.record_session(False, 8, 0.009, 0.006, 100, same_mode=False)  # plain sessions at 8 requests: 6 ms a step
    assert pol.plain_step(8) == 0.006 and pol.batch_k(ids, room) >= 1 and pol.vetoes == 0  # 235 > 167 tok/s
    pol.record_session(False, 8, 0.005, 0.003, 100, same_mode=False)  # 3 ms a step: 333 tok/s beats drafting
    assert pol.batch_k(ids, room) == 0 and pol.vetoes == 1
    assert pol.veto_log[-1]["plain_step"] == 0.003 and pol.veto_log[-1]["forward"] == 0.004


def test_batch_k_prices_plain_decoding_at_its_measured_step():
    """batch_k weighs drafting against plain decoding's measured step (a plain session's steady step, `plain_step`),
    not against the cost model's forward of n tokens, whose median also holds ordinary rounds' slower forwards. On
    the H200 at 64 requests the model's 7.1-7.6 ms against plain sessions' 5.9 ms made a = 0.6 draft at a predicted
    1.17x that realized 0.75x (runs 63-69)."""
    from forerun.engine.k_policy import KPolicy

    def policy(accept_every: int):
        pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=4))
        for tokens, seconds in ((64, 0.0076), (128, 0.0076), (192, 0.0078), (256, 0.0080), (320, 0.0082)):
            for _ in range(3):
                pol.cost.record_target(tokens, seconds)  # (64 tokens: ordinary rounds, host launches included)
        for _ in range(3):
            pol.cost.record_draft_step(0.0019, 64)
        for rid in range(64):
            for j in range(40):
                pol.observe(rid, 1, int(j % accept_every == 0), wanted=1)
        return pol

    ids, room = list(range(64)), [100] * 64
    for accept_every, drafts_with_steady in ((2, False), (1, True)):  # acceptance 0.5: plain wins at 5.9 ms; 1.0: not
        pol = policy(accept_every)
        assert pol.plain_step(64) == pytest.approx(0.0076)  # (no plain session yet: the model's forward)
        assert pol.batch_k(ids, room) >= 1  # 1.5 tokens in 9.5 ms beat 1 in 7.6
        pol.record_session(False, 64, 0.007, 0.0059, 640, same_mode=False)  # plain sessions: 5.9 ms a step
        assert pol.plain_step(64) == 0.0059
        assert (pol.batch_k(ids, room) >= 1) == drafts_with_steady and pol.vetoes == 0  # the model, not a veto


def test_a_batch_veto_is_remembered_past_the_next_probe():
    """batch_k: a probe clears the rounds' record, but the shortfall of the trial the veto ended (realized over
    predicted gain) keeps pricing drafting at that batch size until a trial passes or VETO_MEMORY probe waits pass.
    Forgotten, each wave of 64 new requests on the H200 at a = 0.6 started drafting again and ran 8 rounds at
    0.67x plain before the next veto (0.87-0.95x plain, runs 63-70). A draft that got better still drafts."""
    from forerun.engine.k_policy import KPolicy

    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=4))
    for tokens, seconds in ((8, 0.005), (16, 0.006), (24, 0.0065), (32, 0.007), (40, 0.0075)):
        for _ in range(3):
            pol.cost.record_target(tokens, seconds)
    for _ in range(3):
        pol.cost.record_draft_step(0.001, 8)
    pol.record_session(False, 8, 0.006, 0.005, 100, same_mode=False)  # plain decoding: 5 ms a step, 200 tok/s
    for rid in range(8):
        for j in range(40):
            pol.observe(rid, 1, int(j % 5 < 3), wanted=1)  # 60 % accepted
    ids, room = list(range(8)), [100] * 8
    assert pol.batch_k(ids, room) >= 1  # the model: ~1.15x plain
    for _ in range(KPolicy.REALIZED_MIN):  # the trial realizes 140 tok/s per request: 0.7x plain
        pol.record_realized(8, 13, 13 / 8 / 140)
    assert pol.batch_k(ids, room) == 0 and pol.vetoes == 1
    remembered = pol._batch_remembered(8)
    assert remembered is not None and 0.55 < remembered < 0.65  # 0.7 / ~1.15
    ks = []
    while not pol.batch_probing:  # plain decoding until the probe, which clears the rounds' record
        ks.append(pol.batch_k(ids, room))
    assert ks[-1] == 1 and not any(ks[:-1]) and pol.realized_rate(8) is None
    wait = pol.batch_probe_every
    vetoes = pol.vetoes
    assert pol.batch_k(ids, room) == 0 and pol.vetoes == vetoes + 1  # remembered: no new trial
    assert pol.batch_probe_every == 2 * wait  # (the probe failed: the next waits twice as long)
    assert pol._batch_remembered(6) == remembered and pol._batch_remembered(4) is None  # (per bucket: 5-8)
    _, at, span = pol._batch_vetoed[8]
    pol._bk_calls = at + span + 1  # VETO_MEMORY probe waits later: forgotten, the model decides again
    assert pol._batch_remembered(8) is None and pol.batch_k(ids, room) >= 1
    pol._bk_calls = at + 1
    for rid in range(8):  # the draft got better: every draft accepted, the model's gain outgrows the shortfall
        for _ in range(40):
            pol.observe(rid, 4, 4, wanted=4)
    assert pol._batch_remembered(8) == remembered and pol.batch_k(ids, room) >= 1
    for _ in range(KPolicy.REALIZED_MIN):  # ... and its trial passes: nothing is remembered any more
        pol.record_realized(8, 32, 4 / 300)
    assert pol.batch_k(ids, room) >= 1 and pol._batch_remembered(8) is None


def test_batch_k_is_overruled_when_speculative_rounds_realize_less_than_plain():
    """The cost model sees only pure verify rounds; the rounds the engine really runs (prefill chunks of joining
    requests, which a drafter makes dearer, stalls) can deliver less. batch_k compares what speculative rounds
    realized at this batch size with plain decoding's predicted step and decodes plainly when drafting loses (the
    H200 at 64 requests: the model kept k = 2-3 at 0.46-0.75x plain); a probe re-measures; a batch where
    drafting delivers keeps drafting; a compile-length stall does not count."""
    from forerun.engine.k_policy import KPolicy

    def policy():
        pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=4))
        for tokens in (1, 4, 8, 16, 40):
            pol.cost.record_target(tokens, 0.005)  # a flat 5 ms forward: drafting looks free
        pol.cost.record_draft_step(0.0005)
        for rid in range(8):
            for _ in range(20):
                pol.observe(rid, 4, 3, wanted=4)
        return pol

    ids, room = list(range(8)), [100] * 8
    pol = policy()
    assert pol.batch_k(ids, room) >= 3 and pol.realized_rate(8) is None
    for _ in range(KPolicy.REALIZED_MIN - 1):  # 3 tokens per request in 30 ms: 100 tok/s, plain makes 200
        pol.record_realized(8, 24, 0.030)
    assert pol.batch_k(ids, room) >= 3  # too few rounds to judge
    pol.record_realized(8, 24, 0.030)
    assert abs(pol.realized_rate(8) - 100.0) < 1e-9
    assert pol.batch_k(ids, room) == 0 and pol.vetoes == 1
    (log,) = pol.veto_log  # what the veto compared (benchmarks/online.py reports it)
    assert log["requests"] == 8 and abs(log["realized"] - 100.0) < 1e-9 and abs(log["plain"] - 200.0) < 1e-6
    assert pol.batch_probe_every == 2 * KPolicy.PROBE_EVERY
    ks = [pol.batch_k(ids, room) for _ in range(2 * KPolicy.PROBE_EVERY - 1)]
    assert ks[-1] == 1 and not any(ks[:-1])  # vetoed (once doubled) until the probe, a fresh measurement
    assert pol.batch_probe_every == 2 * KPolicy.PROBE_EVERY and pol.vetoes == 2 * KPolicy.PROBE_EVERY
    # the probe cleared the rounds' record; the trial's shortfall is remembered (test_a_batch_veto_is_remembered_...)
    assert pol.realized_rate(8) is None and pol.batch_k(ids, room) == 0
    pol._bk_calls += pol._batch_vetoed[8][2]  # ... until VETO_MEMORY probe waits have passed: a fresh trial
    assert pol.realized_rate(8) is None and pol.batch_k(ids, room) >= 3
    assert pol.realized_rate(1) is None  # another batch size has its own record

    pol = policy()  # drafting that realizes 0.95x plain (190 tok/s against 200) is overruled too
    for _ in range(KPolicy.REALIZED_MIN):
        pol.record_realized(8, 24, 3 / 190)
    assert pol.batch_k(ids, room) == 0 and pol.vetoes == 1

    pol = policy()  # rounds that prefill a new prompt: compared with the same round without drafting
    for _ in range(KPolicy.REALIZED_MIN):  # 3 tokens per request in 30 ms, where plain would give 1 in 20 ms and
        pol.record_realized(8, 24, 0.030, plain=(8, 0.020))  # the other 2 in two 5 ms steps
    assert abs(pol.plain_rate(8) - 100.0) < 1e-9  # (not plain's bare 5 ms step: 200 tok/s)
    assert pol.batch_k(ids, room) >= 3 and pol.vetoes == 0

    pol = policy()  # one prefill round among pure ones weighs as much in plain's time as in drafting's: 31 pure
    for _ in range(31):  # rounds at 0.97x plain (3 tokens per request in 3 x 5 ms / 0.97) and one round that
        pol.record_realized(8, 24, 0.015 / 0.97)  # prefilled a prompt (190 ms plain, 200 ms drafting)
    pol.record_realized(8, 24, 0.200, plain=(8, 0.190))
    # plain would give the same 96 tokens per request in 93 steps + the prefill round + 2 steps. (Counted as one
    # plain step per pure round, plain's rate was 32 / 0.345 s = 93 tok/s against drafting's 141: not vetoed)
    assert abs(pol.plain_rate(8) - 96 / (93 * 0.005 + 0.190 + 2 * 0.005)) < 1e-9
    assert pol.realized_rate(8) < pol.plain_rate(8)
    assert pol.batch_k(ids, room) == 0 and pol.vetoes == 1
    pol = policy()  # ... while 1.5 tokens per request in 40 ms loses to it
    for _ in range(KPolicy.REALIZED_MIN):
        pol.record_realized(8, 12, 0.040, plain=(8, 0.020))
    assert pol.batch_k(ids, room) == 0 and pol.vetoes == 1

    pol = policy()  # drafting that delivers: 3 tokens per request in 10 ms (300 tok/s against plain's 200)
    for _ in range(KPolicy.REALIZED_WINDOW):
        pol.record_realized(8, 24, 0.010)
    pol.record_realized(8, 24, 0.9)  # a round that waited on a kernel compile: left out
    assert abs(pol.realized_rate(8) - 300.0) < 1e-9
    assert min(pol.batch_k(ids, room) for _ in range(5)) >= 3 and pol.vetoes == 0


def test_engine_records_realized_speculative_rounds_with_graphs_or_a_separate_draft_on_the_cpu():
    """The realized rate feeds batch_k's veto (CUDA graphs) and, since the sixteenth session, ks's on the CPU path
    with a separate draft model (Engine._catch_up_priced); a drafter without its own cache (n-gram) records
    nothing there."""
    target = hf_model("llama")
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = tiny_llm(target, spec=draft_spec(hf_model("llama", seed=3, num_hidden_layers=1), adaptive=True, k_max=4))
    llm.generate([PROMPTS[0]], sp)
    assert llm.engine.runner.graphs is None and llm.engine.k_policy.realized
    llm = tiny_llm(target, spec=SpecConfig(method="ngram", adaptive=True, k_max=4))
    llm.generate([PROMPTS[0]], sp)
    assert not llm.engine.k_policy.realized


def test_ks_vetoes_drafting_that_realizes_less_than_plain():
    """ks (the CPU path, with lags: a separate draft model) overrules the model when the drafting rounds it ran
    realized less than plain decoding's measured step gives (on this CPU at 2 requests the model predicted ~7 %
    over plain while the rounds realized ~6 % less). The batch size then decodes plainly, probes included, for a
    wait that doubles at every veto (PROBE_EVERY, 2x, ...); a trial that realizes what plain does resets it."""
    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=2))
    pol.cost.record_target(2, 0.040)
    pol.cost.record_target(6, 0.060)
    for _ in range(3):
        pol.cost.record_draft_step(0.010, 2)
    for rid in (0, 1):
        pol.estimates[rid] = AcceptanceEstimate(prior=0.8, prior_weight=1e9)
    args = dict(plain_check=False, lags=[1, 1], remaining=[100, 100])

    def ks():
        return pol.ks([0, 1], [2, 2], **args)

    def rounds(tokens_each):  # REALIZED_MIN drafting rounds of 80 ms
        for _ in range(KPolicy.REALIZED_MIN):
            pol.record_realized(2, 2 * tokens_each, 0.080)

    assert ks() == [2, 2]  # the model: 2.44 tokens per 80 ms round against 1 per 40 ms
    for wait in (KPolicy.PROBE_EVERY, 2 * KPolicy.PROBE_EVERY):
        rounds(1.6)  # 20 tok/s per request against plain's 25: vetoed
        assert ks() == [0, 0] and not pol.realized.get(pol._bucket(2))
        pol.probe_every = {0: 1, 1: 1}  # probes due: the wait holds them off too
        assert all(ks() == [0, 0] for _ in range(wait))
        assert ks() == [2, 2]  # the trial
    assert pol.vetoes == 2
    rounds(2.4)  # 30 tok/s: drafting stands, and the wait starts over
    assert ks() == [2, 2] and not pol._held
    rounds(1.0)
    assert ks() == [0, 0] and pol._held[pol._bucket(2)] == [KPolicy.PROBE_EVERY, KPolicy.PROBE_EVERY]


def test_the_veto_weighs_drafting_against_the_measured_plain_rounds():
    """On the path without CUDA graphs the veto's plain step is the mean of the plain rounds timed at that batch
    size (scheduling to commit), once there are PLAIN_ROUNDS_MIN of them, not the cost model's forward plus the
    median overhead of every round (drafting rounds' host work included). On this CPU the model put a 2-request
    plain round at 57 ms where they took 51: drafting that realized less than plain passed the veto."""
    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=2))
    pol.cost.record_target(2, 0.040)
    pol.cost.record_target(6, 0.060)
    pol.cost.record_round_overhead(0.017)
    for _ in range(3):
        pol.cost.record_draft_step(0.010, 2)
    for rid in (0, 1):
        pol.estimates[rid] = AcceptanceEstimate(prior=0.8, prior_weight=1e9)

    def ks():
        return pol.ks([0, 1], [2, 2], plain_check=False, lags=[1, 1], remaining=[100, 100])

    assert pol.plain_step(2) == pytest.approx(0.057)  # no plain round timed: the model's
    assert ks() == [2, 2]
    for _ in range(KPolicy.REALIZED_MIN):  # 18.5 tokens a second per request: more than 1 / 57 ms ...
        pol.record_realized(2, 4, 0.108)
    assert ks() == [2, 2] and pol.vetoes == 0
    for t in (0.050, 0.050, 0.053):  # ... less than 1 / 51 ms, plain's timed rounds (other sizes apart)
        pol.record_plain_round(2, t)
    pol.record_plain_round(3, 0.5)
    assert pol.plain_step(2) == pytest.approx(0.051) and pol.plain_step(3) != 0.5
    assert ks() == [0, 0] and pol.vetoes == 1
    # on this path drafting must beat plain by REALIZED_MARGIN_LAGGED (its trials' catch-ups and prompt reads are
    # not in its rounds): 1.02x plain is overruled, 1.1x is not
    pol._held.clear()
    for _ in range(KPolicy.REALIZED_MIN):
        pol.record_realized(2, 2 * 1.02 * 0.108 / 0.051, 0.108)
    assert ks() == [0, 0] and pol.vetoes == 2
    pol._held.clear()
    for _ in range(KPolicy.REALIZED_MIN):
        pol.record_realized(2, 2 * 1.1 * 0.108 / 0.051, 0.108)
    assert ks() == [2, 2] and pol.vetoes == 2


def test_the_vetos_plain_step_is_a_mean_as_drafting_s_realized_rate_is():
    """Drafting's realized rate is total tokens over total seconds (a mean); the plain step it is set against must be
    a mean too, rounds over OUTLIER x the median left out as realized_rate leaves them out. Plain rounds' times lean
    right (on the Zen 2 at one request their mean was 1.04-1.05x their median), and against their median, k = 1
    drafting that gave 1.07x plain per prompt was vetoed at a measured 1.0499x (session 60's adaptive 0.98x plain)."""
    def policy():
        pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=1))
        pol.cost.record_target(1, 0.040)
        pol.cost.record_target(2, 0.048)
        for _ in range(3):
            pol.cost.record_draft_step(0.012, 1)
        pol.estimates[0] = AcceptanceEstimate(prior=0.95, prior_weight=1e9)
        # 30 plain rounds: median 40 ms, a right tail (mean of the kept ones 44.1 ms); one 20x outlier left out
        for t in [0.040] * 20 + [0.050] * 6 + [0.060] * 3 + [2.0]:
            pol.record_plain_round(1, t)
        return pol

    pol = policy()
    assert pol.plain_step(1) == pytest.approx((20 * 0.040 + 6 * 0.050 + 3 * 0.060) / 29)
    # drafting that realizes a token in 40.4 ms: 1.09x plain's mean step, 0.99x its median
    for _ in range(KPolicy.REALIZED_MIN):
        pol.record_realized(1, 2, 2 * 0.0404)
    assert pol.ks([0], [1], plain_check=False, lags=[1], remaining=[40]) == [1] and pol.vetoes == 0
    old = policy()  # power check: against the median, the same rounds are vetoed
    old.PLAIN_STEP_STAT = "median"
    assert old.plain_step(1) == pytest.approx(0.040)
    for _ in range(KPolicy.REALIZED_MIN):
        old.record_realized(1, 2, 2 * 0.0404)
    assert old.ks([0], [1], plain_check=False, lags=[1], remaining=[40]) == [0] and old.vetoes == 1


def test_a_veto_keeps_pricing_the_drafts_reads_at_the_trial_it_ended():
    """The path without CUDA graphs (a separate draft): after a veto, the draft's reads are priced at the realized rate
    of the trial the veto ended, after its wait too, for VETO_MEMORY rounds (the wait running out changes nothing
    about what drafting realizes; priced by the model again, every arrival's prompt was read and drafted a round or
    two before the next veto). And a prompt's read is priced at the batch it will decode in (`batch`), not at the
    one request k_for([r]) asks about."""
    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=2))
    for tokens, t in ((1, 0.030), (2, 0.040), (6, 0.060)):
        pol.cost.record_target(tokens, t)
    for b in (1, 2):
        for _ in range(3):
            pol.cost.record_draft_step(0.010, b)
    for rid in (0, 1, 7):
        pol.estimates[rid] = AcceptanceEstimate(prior=0.8, prior_weight=1e9)
    pol.cost.record_draft_feed(100, 0.150)  # 1.5 ms a token
    for _ in range(3):
        pol.record_plain_round(2, 0.040)
    # the model: k = 2 at 2 requests gives 2.44 tokens in 80 ms (32.8 ms a token against 40): a 100-token read pays
    assert pol.catch_up_pays(7, 100, 100, 2, k=2)
    for _ in range(KPolicy.REALIZED_MIN):  # the trial realizes 1.2 tokens per request in 50 ms (41.7 ms a token)
        pol.record_realized(2, 2.4, 0.050)

    def ks(ids=(0, 1), lags=(1, 1), batch=None):
        return pol.ks(list(ids), [2] * len(ids), plain_check=False, lags=list(lags), remaining=[100] * len(ids),
                      batch=batch)

    assert ks() == [0, 0] and pol.vetoes == 1
    for _ in range(KPolicy.PROBE_EVERY):  # the wait
        assert ks() == [0, 0]
    assert pol._held[2][0] == 0 and pol.realized_rate(2) is None  # waited out, the next trial measured afresh
    assert not pol.catch_up_pays(7, 100, 100, 2, k=2)  # ... and a read still priced at the trial's 41.7 ms
    assert ks() == [2, 2]  # (requests the draft has caught up with draft again: that is the next trial)
    # a prompt decided alone: priced at one request it pays (26.6 ms a token against 30), at the 2 it will decode in
    # it does not
    assert ks(ids=[7], lags=[100]) == [2]
    assert ks(ids=[7], lags=[100], batch=2) == [0]
    # the memory lapses (VETO_MEMORY waits): the model prices reads again (a new trial can start)
    vetoed_at = pol._vetoed_rate[2][1]
    pol._ks_calls = vetoed_at + KPolicy.VETO_MEMORY * KPolicy.PROBE_EVERY
    assert not pol.catch_up_pays(7, 100, 100, 2, k=2)
    pol._ks_calls += 1
    assert pol.catch_up_pays(7, 100, 100, 2, k=2)
    # a veto that follows doubles the wait and the memory
    for _ in range(KPolicy.REALIZED_MIN):
        pol.record_realized(2, 2.4, 0.050)
    assert ks() == [0, 0] and pol.vetoes == 2 and pol._held[2] == [2 * KPolicy.PROBE_EVERY] * 2
    pol._ks_calls += 2 * KPolicy.VETO_MEMORY * KPolicy.PROBE_EVERY
    pol._held[2][0] = 0  # (the wait, counted by ks calls, is over)
    assert not pol.catch_up_pays(7, 100, 100, 2, k=2)
    pol._ks_calls += 1
    assert pol.catch_up_pays(7, 100, 100, 2, k=2)


def test_batch_k_drafts_until_a_draft_step_is_timed():
    """Until a draft step has been timed, batch_k drafts at the configured k, and at least 2: with no draft cost
    measured drafting would look free, and k = 0 / 1 rounds time no draft step (ModelDrafter times steps 1..),
    so a configured k of 0 or 1 would never learn the cost and never adapt."""
    from forerun.engine.k_policy import KPolicy

    for k, k_max, want in ((0, 4, 2), (1, 4, 2), (4, 8, 4), (4, 1, 1)):
        pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k=k, k_max=k_max))
        for tokens in (1, 4):
            pol.cost.record_target(tokens, 0.005)
        assert pol.batch_k([0, 1], [100, 100]) == want, (k, k_max)
        pol.cost.record_draft_step(0.004)  # timed: the cost model decides (a dear draft: plain decoding)
        for rid in (0, 1):
            for _ in range(20):
                pol.observe(rid, 4, 0, wanted=4)
        assert pol.batch_k([0, 1], [100, 100]) == 0


def test_cost_model_memo_and_batched_expectations_equal_the_direct_computation():
    """CostModel caches its medians and piecewise-linear points, and the k policy computes E[tokens] for every k in
    one pass: both must give exactly what computing from scratch gives, after every new observation (also ones
    appended to the deques directly, as tests do) and at every position, pooled or not."""
    rng = random.Random(5)
    cost = CostModel()
    for step in range(300):
        what = rng.randrange(5)
        if what == 0:
            cost.record_target(rng.choice([1, 4, 8, 16, 40]), rng.uniform(0.004, 0.02))
        elif what == 1:
            cost.record_draft_step(rng.uniform(0.0005, 0.002))
        elif what == 2:
            cost.record_spec_overhead(rng.uniform(0, 0.001))
        elif what == 3:
            cost.record_round_overhead(rng.uniform(0, 0.001))
        else:
            cost.target_obs.append((rng.choice([2, 5]), rng.uniform(0.004, 0.02)))
        fresh = CostModel(deque(cost.target_obs, maxlen=64), deque(cost.draft_obs, maxlen=64),
                          deque(cost.overhead_obs, maxlen=64), deque(cost.round_obs, maxlen=64))
        for tokens in (1, 3, 8, 33, 100):
            for k in (0, 2):
                assert cost.round_seconds(tokens, k) == fresh.round_seconds(tokens, k)
    # a full deque of equal values, then another value: evicting an equal first value keeps length, first and last
    cost = CostModel()
    for _ in range(64):
        cost.record_spec_overhead(-1.0)  # (clipped to 0.0)
    for i in range(41):
        cost.record_spec_overhead(0.002)
        assert cost.spec_overhead() == (0.002 if i >= 31 else 0.0)
    def rate(e, i):  # the per-position definition, written out on its own (a reference apart from `rates`)
        prior = rate(e.pool, i) if e.pool is not None else e.prior
        if i >= len(e.tested):  # never drafted this far: the pool's rate, else like the deepest position seen
            return rate(e, len(e.tested) - 1) if e.tested and e.pool is None else prior
        return (e.accepted[i] + prior * e.prior_weight) / (e.tested[i] + e.prior_weight)

    pool = AcceptanceEstimate(decay=0.99)
    est = AcceptanceEstimate(prior_weight=4.0, pool=pool)
    alone = AcceptanceEstimate()
    for _ in range(200):
        d = rng.randint(1, 6)
        a = rng.randint(0, d)
        for e in (pool, est, alone):
            e.update(d, a)
            for i in range(10):
                assert e.rate(i) == pytest.approx(rate(e, i), rel=1e-12)
            for k in range(10):
                direct, reach = 1.0, 1.0
                for i in range(k):
                    reach *= rate(e, i)
                    direct += reach
                assert e.expected_tokens_upto(9)[k] == pytest.approx(direct, rel=1e-12)
                assert e.expected_tokens(k) == pytest.approx(direct, rel=1e-12)


def test_an_unmeasured_drafting_start_is_priced_as_a_plain_one():
    """batch_k adds each mode's session start cost per token. A drafting session's start not measured yet at this
    batch size (a probe forgets them) is priced as plain's measured one, not as free: on the H200 a useless draft
    (acceptance ~1 %) at 39 requests, with the verify rows' forward priced flat, won k = 1 by 0.3 % against plain's
    measured starts and drafted 162 tokens at 0.93x plain (run 51). Measured, the drafting start counts as is."""
    from forerun.engine.k_policy import KPolicy

    n = 39
    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=8))
    for rid in range(n):
        for j in range(30):
            pol.observe(rid, 1, int(j == 0), wanted=1)  # ~3 % of drafts accepted, decayed: ~1 % now
    for tokens in (20, n):
        pol.cost.record_target(tokens, 0.0076)  # flat up to 39 rows: 78 rows extrapolate flat
    for _ in range(3):
        pol.cost.record_draft_step(0.0012, n)
        pol.record_session(False, n, 0.0076 + 0.00113, 0.0076, n, same_mode=True)  # plain starts: 29 us per token
    ids, room = list(range(n)), [100] * n
    pol.batch_idle = 1  # decoding plainly, no probe due
    assert not pol._starts_measured(True, n)
    assert pol.batch_k(ids, room) == 0
    for _ in range(3):  # drafting starts measured cheap: they count as measured (k = 1 by the model again)
        pol.record_session(True, n, 0.0076, 0.0076, n, same_mode=True)
    assert pol.restart_per_token(True, n) == 0.0 and pol._starts_measured(True, n)
    assert pol.batch_k(ids, room) == 1


def _k1_policy(gain: float):
    """A batch_k policy for 4 requests, k_max = 1, every draft accepted, costs measured so that k = 1 (2 tokens per
    round for 2 / gain plain steps) is `gain` x plain's rate by the model."""
    from forerun.engine.k_policy import KPolicy

    pol = KPolicy(SpecConfig(method="draft", draft_model="x", adaptive=True, k_max=1))
    for tokens in (4, 8):
        pol.cost.record_target(tokens, 0.005)
    pol.cost.record_draft_step(0.005 * (2 / gain - 1))
    for rid in range(4):
        for _ in range(50):
            pol.observe(rid, 1, 1, wanted=1)
    return pol


@pytest.mark.parametrize("gain,margin,switches_on", [(1.1, 0.0, True), (1.1, 0.2, False), (1.5, 0.2, True)])
def test_switch_margin_keeps_plain_decoding_where_drafting_barely_pays(gain, margin, switches_on):
    """batch_k with SWITCH_MARGIN: from plain decoding (and right after a probe) drafting starts only when the model
    predicts more than (1 + margin) x plain's rate; a batch already drafting keeps the model's k."""
    pol = _k1_policy(gain)
    pol.SWITCH_MARGIN = margin
    ids = list(range(4))
    assert pol.batch_k(ids, [100] * 4) == 1  # drafting already (the start): the model's k
    pol.batch_idle = 1  # plain decoding
    assert pol.batch_k(ids, [100] * 4) == int(switches_on)
    pol.batch_idle, pol.batch_probing = 0, True  # the call after a probe
    assert pol.batch_k(ids, [100] * 4) == int(switches_on)


def test_session_start_costs_per_token_steer_batch_k():
    """batch_k weighs what overlapped sessions' starts cost per token they gave (KPolicy.record_session): k = 1 that
    the model rates 1.3x plain stays on when drafting sessions start cheaply or last long, and goes to 0 when each
    start costs ~20 ms for a session of ~40 tokens (the H200 at 64 requests with spread joins). Starts after a
    switch of mode are not counted (their catch-up spans the whole plain stretch); plain sessions' own starts
    count against k = 0 the same way."""
    def policy():
        return _k1_policy(1.3)

    ids, room = list(range(4)), [100] * 4
    pol = policy()
    assert pol.restart_per_token(True, 4) == 0.0 and pol.batch_k(ids, room) == 1
    for _ in range(4):  # long drafting sessions: 5 ms more at the start, 400 tokens each
        pol.record_session(True, 4, 0.012, 0.007, 400, same_mode=True)
    assert pol.restart_per_token(True, 4) == pytest.approx(0.005 / 400)
    assert pol.batch_k(ids, room) == 1
    pol = policy()
    pol.record_session(True, 4, 0.027, 0.007, 40, same_mode=False)  # a switch from plain: not counted
    pol.record_session(True, 4, 0.027, None, 40, same_mode=False)
    assert not pol.sessions and pol.batch_k(ids, room) == 1
    for _ in range(3):  # short sessions, dear starts (a one-step session: the last steady step stands in)
        pol.record_session(True, 4, 0.027, None, 40, same_mode=True)
    assert pol.restart_per_token(True, 4) == pytest.approx(0.020 / 40)
    assert pol.batch_k(ids, room) == 0
    assert pol.restart_per_token(True, 16) == 0.0 and pol.batch_k(list(range(16)), [100] * 16) == 1  # per batch size
    # the same costs for plain sessions' starts weigh against k = 0 alike
    for _ in range(3):
        pol.record_session(False, 3, 0.027 + 0.005, 0.005, 40 / 2.6, same_mode=True)  # (bucket 4)
    assert pol.batch_k(ids, room) == 1
    # a probe forgets the drafting starts of its batch size (recorded only between drafting sessions, they would
    # never refresh while the batch decodes plainly)
    pol = policy()
    for _ in range(3):
        pol.record_session(True, 4, 0.027, 0.007, 40, same_mode=True)
    assert pol.batch_k(ids, room) == 0
    pol.batch_idle = pol._batch_probe_wait(4) - 1
    assert pol.batch_k(ids, room) == 1 and pol.batch_probing and (True, 4) not in pol.sessions
    # one start that waited on a capture or a compile (OUTLIER x the median cost per token) is left out
    pol = policy()
    for first in (0.012, 0.012, 0.012, 1.5):
        pol.record_session(True, 4, first, 0.007, 400, same_mode=True)
    assert pol.restart_per_token(True, 4) == pytest.approx(0.005 / 400)
