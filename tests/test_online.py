"""The online engine: requests joining and leaving mid-run, preemption, chunked prefill, aborts, threads,
seeded outputs independent of k / trees / neighbours, and the async front."""
from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest
import torch
from scipy import stats as sstats

from forerun.config import CacheConfig, SpecConfig
from forerun.engine.async_engine import AsyncEngine
from forerun.engine.engine import Engine, stop_holdback
from forerun.engine.llm import LLM, RequestError
from forerun.sampling_params import SamplingParams
from forerun.verify.coupling import coupled_scores, keys_for
from tiny import hf_model, ours_from_hf, sharpen, tiny_llm, tiny_tokenizer

PROMPTS = [[5, 9, 13, 22, 40, 7], [3], list(range(10, 60, 3)), [70, 71, 72, 70, 71], [8, 8, 8], [1, 2, 3, 4]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return sharpen(hf_model("llama"), 3.0)


def draft_spec(draft_hf, **kw):
    runner = ours_from_hf(draft_hf)
    return SpecConfig(method="draft", draft_model=(runner.model, tiny_tokenizer(draft_hf.config.vocab_size)), **kw)


def engine(hf, spec=None, **kw) -> Engine:
    runner = ours_from_hf(hf)
    kw.setdefault("cache", CacheConfig(block_size=4, num_blocks=2048))
    return Engine.from_model(runner.model, tiny_tokenizer(hf.config.vocab_size), spec=spec, device="cpu",
                             check_invariants=True, **kw)


def run_all(eng: Engine, max_steps: int = 10_000) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not eng.has_unfinished():
            break
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert not eng.has_unfinished()
    return out


def alone(hf, prompt, params, spec=None) -> list[int]:
    return tiny_llm(hf, spec=spec).generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("split", [False, True])
def test_request_added_while_others_run_gives_its_alone_output(target, split):
    """split: mixed rounds (prefill chunks + verify rows) as two forwards, as on CUDA graphs."""
    spec = draft_spec(hf_model("llama", seed=7, num_hidden_layers=1), k=3)
    eng = engine(target, spec, max_num_batched_tokens=24)
    eng.round.split_mixed = split
    want = {i: alone(target, p, GREEDY) for i, p in enumerate(PROMPTS)}
    got: dict[str, list[int]] = {}
    eng.add_request(PROMPTS[0], GREEDY, request_id="0")
    eng.add_request(PROMPTS[1], GREEDY, request_id="1")
    step = 0
    while eng.has_unfinished() or step < 8:
        if 2 + step // 2 < len(PROMPTS) and step % 2 == 1:  # one more joins every other step
            i = 2 + step // 2
            eng.add_request(PROMPTS[i], GREEDY, request_id=str(i))
        for d in eng.step():
            got.setdefault(d.request_id, []).extend(d.new_token_ids)
        step += 1
    assert {int(k): v for k, v in got.items()} == want
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks - 1
    assert (eng.round.split_rounds > 0) == split


def test_abort_mid_generation_frees_every_block(target):
    spec = draft_spec(hf_model("llama", seed=7, num_hidden_layers=1), k=3)
    eng = engine(target, spec)
    free0, dfree0 = eng.runner.kv.num_free_blocks, eng.drafter.kv.num_free_blocks
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), request_id=str(i))
    for _ in range(3):
        eng.step()
    assert eng.runner.kv.num_free_blocks < free0
    for i in range(len(PROMPTS)):
        assert eng.abort(str(i))
    assert not eng.abort("0")  # already gone
    assert not eng.has_unfinished()
    assert eng.runner.kv.num_free_blocks == free0 and eng.drafter.kv.num_free_blocks == dfree0


@pytest.mark.parametrize("which", ["target", "draft"])
def test_small_pool_completes_every_request_by_preemption(target, which):
    """A pool too small for all requests at once (the target's, or a draft pool smaller than the target's)."""
    spec = draft_spec(hf_model("llama", seed=7, num_hidden_layers=1), k=3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    big = tiny_llm(target, spec=spec).generate(PROMPTS, params)
    small = CacheConfig(block_size=4, num_blocks=24)  # ~92 tokens: one or two requests at a time
    kw = {"cache": small} if which == "target" else {"draft_cache": small}
    llm = tiny_llm(target, spec=spec, check_invariants=True, **kw)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in big]
    assert llm.engine.stats().num_preemptions > 0
    assert llm.runner.kv.num_free_blocks == llm.runner.kv.num_blocks - 1


def test_chunked_prefill_gives_the_same_output(target):
    long_prompt = [(7 * i) % 90 + 2 for i in range(120)]
    want = alone(target, long_prompt, GREEDY)
    llm = tiny_llm(target, max_num_batched_tokens=16, check_invariants=True)
    outs = llm.generate([long_prompt, PROMPTS[0]], GREEDY)
    assert outs[0].token_ids == want
    assert outs[1].token_ids == alone(target, PROMPTS[0], GREEDY)


def test_a_request_that_can_never_fit_is_refused_before_anything_runs(target):
    llm = tiny_llm(target, cache=CacheConfig(block_size=4, num_blocks=16))
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate([PROMPTS[0], PROMPTS[1]], [GREEDY, SamplingParams(temperature=0, max_tokens=500)])
    assert llm.runner.kv.num_free_blocks == llm.runner.kv.num_blocks - 1
    assert llm.generate([PROMPTS[0]], GREEDY)[0].token_ids == alone(target, PROMPTS[0], GREEDY)


def random_ops(eng: Engine, rng: random.Random, ops: int, p_add: float, p_abort: float, params, drain: int = 0,
               max_prompt: int = 30, reference=None) -> int:
    """`ops` random operations: add a random prompt (params(rng) -> SamplingParams) with probability p_add, abort a
    live request with p_abort, else step. Then abort what is left, step up to `drain` times (an abort inside an
    overlapped session frees the request when the session ends), and check that every block came back.
    Returns what was done: {"adds", "aborts", "steps", "finished", "in_session" (steps inside overlapped sessions)}."""
    live, in_session, steps, done, aborted, sent, outs = [], 0, 0, set(), set(), {}, {}
    free0 = eng.runner.kv.num_free_blocks
    dkv = eng.drafter.kv if eng.drafter is not None else None
    dfree0 = dkv.num_free_blocks if dkv is not None else None
    for _ in range(ops):
        op = rng.random()
        if op < p_add:
            p = [rng.randrange(2, 96) for _ in range(rng.randrange(1, max_prompt))]
            sp = params(rng)
            rid = eng.add_request(p, sp)
            live.append(rid)
            sent[rid] = (p, sp)
        elif op < p_add + p_abort and live:
            rid = live.pop(rng.randrange(len(live)))
            eng.abort(rid)
            done.add(rid)
            aborted.add(rid)
        else:
            steps += 1
            for d in eng.step():
                assert d.request_id not in done, d  # (nothing reported after a request's finish or abort)
                outs.setdefault(d.request_id, []).extend(d.new_token_ids)
                if d.finished:
                    done.add(d.request_id)
                if d.finished and d.request_id in live:
                    live.remove(d.request_id)
            in_session += eng._overlap is not None
    for rid in list(live):
        eng.abort(rid)
    for _ in range(drain):
        if not eng.has_unfinished():
            break
        eng.step()
    assert not eng.has_unfinished()
    assert eng.runner.kv.num_free_blocks == free0
    if dfree0 is not None:
        assert dkv.num_free_blocks == dfree0
    assert not eng._arrived  # (the join wait's arrival steps: none kept for a request that is gone)
    assert not eng.requests  # (every request reported finished or aborted is forgotten)
    if reference is not None:  # every request that finished (not aborted) has its own output, as if alone
        finished = [rid for rid in done if rid not in aborted]
        assert finished
        for rid in finished:
            assert outs.get(rid, []) == reference(*sent[rid]), rid
    return dict(adds=len(sent), aborts=len(aborted), steps=steps, finished=len(done - aborted), in_session=in_session)


def test_random_add_abort_step_sequences_never_leak(target):
    """>= 1000 random operations over several engines: no block leaks, invariant checked every round."""
    rng = random.Random(0)

    def params(rng):
        return SamplingParams(temperature=rng.choice([0.0, 0.9]), max_tokens=rng.randrange(1, 25),
                              seed=rng.choice([None, 5]), ignore_eos=True)

    specs = (None, SpecConfig(method="ngram", k=3), draft_spec(hf_model("llama", seed=7, num_hidden_layers=1), k=2))
    totals = {}
    for spec in specs:
        eng = engine(target, spec, cache=CacheConfig(block_size=4, num_blocks=40), max_num_batched_tokens=24)
        did = random_ops(eng, rng, 400, 0.3, 0.1, params)
        for key in ("adds", "aborts", "steps", "finished"):
            totals[key] = totals.get(key, 0) + did[key]
    assert sum(totals[k] for k in ("adds", "aborts", "steps")) >= 1000 and min(totals.values()) >= 50, totals


def test_random_add_abort_step_sequences_with_overlapped_sessions_never_leak(target):
    """The same with CUDA-graph stand-ins (eager GraphRunners), so overlapped plain and speculative sessions run,
    begin and end under random arrivals, aborts and a small pool (sessions that found no block used to spin or
    raise OutOfBlocks: this test raised it on the old code), nothing leaks, the invariant holds, and sessions ran."""
    from forerun.runtime.cuda_graph import GraphRunner

    rng = random.Random(1)
    draft = hf_model("llama", seed=7, num_hidden_layers=1)

    def params(rng):  # greedy requests (sessions run for greedy batches; sampled ones: the test above)
        return SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 40), ignore_eos=True)

    configs = ((None, {}), (draft_spec(draft, k=2), {}), (draft_spec(draft, adaptive=True, k_max=3), {}),
               (draft_spec(draft, k=2), dict(mixed_prefill=True)), (draft_spec(draft, k=2), dict(in_session=True)),
               (draft_spec(draft, adaptive=True, k_max=3), dict(in_session=True)))
    joins, plain, seen, totals = 0, engine(target), {}, {}

    def alone_out(prompt, sp):  # greedy output of the prompt alone (no drafter, no session)
        key = (tuple(prompt), sp.max_tokens)
        if key not in seen:
            plain.add_request(prompt, sp, request_id="ref")
            seen[key] = run_all(plain)["ref"]
        return seen[key]

    for spec, kw in configs:
        kw = dict(kw)
        in_session = kw.pop("in_session", False)  # (Engine.JOIN_IN_SESSION: arrivals join sessions running)
        eng = engine(target, spec, cache=CacheConfig(block_size=4, num_blocks=30), max_num_batched_tokens=48, **kw)
        eng.JOIN_IN_SESSION = in_session
        q = eng.spec.max_draft_tokens + 1 if spec is not None else 2
        for runner in {id(r): r for r in (eng.runner, getattr(eng.drafter, "runner", None)) if r}.values():
            runner.graphs = GraphRunner(runner, batch_sizes=(1, 2, 4), max_q_len=q, use_graphs=False)
        eng.scheduler.draft_prefill = False
        did = random_ops(eng, rng, 300, 0.15, 0.05, params, drain=10, max_prompt=70, reference=alone_out)
        assert did["in_session"] > 0, spec
        for key in ("adds", "aborts", "steps", "finished"):
            totals[key] = totals.get(key, 0) + did[key]
        joins += eng.session_joins  # (prompts up to 70 tokens against a 48-token budget: some read in chunks)
    assert sum(totals[k] for k in ("adds", "aborts", "steps")) >= 1000 and min(totals.values()) >= 20, totals
    assert joins > 0  # arrivals joined sessions running (the in_session configs)


def test_seeded_sampling_does_not_depend_on_k_tree_or_neighbours(target):
    draft = hf_model("llama", seed=7, num_hidden_layers=1)
    params = SamplingParams(temperature=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    ref = alone(target, PROMPTS[2], params)
    variants = {
        "k0": None, "k2": draft_spec(draft, k=2), "k4": draft_spec(draft, k=4),
        "auto": draft_spec(draft, adaptive=True, k_max=5), "tree": draft_spec(draft, tree=(2, 2)),
        "self": draft_spec(target, k=4), "ngram": SpecConfig(method="ngram", k=3),
    }
    for name, spec in variants.items():
        llm = tiny_llm(target, spec=spec)
        neighbours = [SamplingParams(temperature=0.7, max_tokens=9, ignore_eos=True)] * 3
        outs = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[4]], [neighbours[0], params] + neighbours[1:])
        assert outs[1].token_ids == ref, name
    # the self-draft proposes the target's own coupled tokens: everything accepted
    llm = tiny_llm(target, spec=draft_spec(target, k=4))
    o = llm.generate([PROMPTS[2]], params)[0]
    assert o.stats.acceptance_rate == 1.0 and o.token_ids == ref


def test_coupled_tokens_are_distributed_as_p_chi_square():
    """Gumbel-max with position-keyed noise: over 10^6 seeds, argmax(log p + g) ~ p; power: the same noise on a p
    with 1% of its mass moved onto its most likely token is rejected (measured p ~ 1e-12)."""
    from forerun.verify.coupling import row_key

    torch.manual_seed(0)
    v, n = 12, 1_000_000
    p = torch.softmax(torch.randn(v, dtype=torch.float64) * 1.5, -1)
    keys = torch.tensor([row_key(s, 17) for s in range(n)])
    expect = p.numpy() / p.numpy().sum() * n
    toks = coupled_scores(p.float().expand(n, v), keys).argmax(-1).numpy()
    counts = np.bincount(toks, minlength=v)
    assert sstats.chisquare(counts, expect).pvalue > 1e-3
    biased = 0.99 * p + 0.01 * torch.nn.functional.one_hot(p.argmax(), v).double()
    bcounts = np.bincount(coupled_scores(biased.float().expand(n, v), keys).argmax(-1).numpy(), minlength=v)
    assert sstats.chisquare(bcounts, expect).pvalue < 1e-6
    # positions are independent: tokens at positions 17 and 18 of the same seeds are uncorrelated
    keys2 = torch.cat([keys_for(s, 18, 1) for s in range(4000)])
    t2 = coupled_scores(p.float().expand(4000, v), keys2).argmax(-1).numpy()
    table = np.zeros((v, v))
    for a, b in zip(toks[:4000], t2):
        table[a, b] += 1
    nz = table[table.sum(1) > 0][:, table.sum(0) > 0]
    assert sstats.chi2_contingency(nz + 1e-9)[1] > 1e-4


def test_coupled_speculative_sampling_matches_plain_distribution(target):
    """Coupled spec decoding (draft model) vs the target's own first-token distribution, chi-square."""
    draft = hf_model("llama", seed=7, num_hidden_layers=1)
    llm = tiny_llm(target, spec=draft_spec(draft, k=3), max_num_seqs=512)
    n = 3000
    prompt = [5, 9, 13]
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, max_tokens=2, seed=s, ignore_eos=True)
                                       for s in range(n)])
    runner = ours_from_hf(target)
    from forerun.runtime.runner import Chunk

    runner.kv.add_sequence(0)
    out, _ = runner.forward([Chunk(0, prompt)])
    p = torch.softmax(out.logits[0].double(), -1).numpy()
    counts = np.bincount([o.token_ids[0] for o in outs], minlength=len(p))
    keep = p * n >= 5
    obs, exp = counts[keep], p[keep] * n
    if (~keep).any():
        obs, exp = np.append(obs, counts[~keep].sum()), np.append(exp, p[~keep].sum() * n)
    exp = exp / exp.sum() * obs.sum()
    assert sstats.chisquare(obs, exp).pvalue > 1e-3


def test_threads_share_one_llm_and_get_their_own_outputs(target):
    llm = tiny_llm(target, spec=SpecConfig(method="ngram", k=3))
    want = {i: alone(target, p, GREEDY) for i, p in enumerate(PROMPTS[:4])}
    for _ in range(20):
        results, errors = {}, []

        def work(t):
            try:
                order = [(t + j) % 4 for j in range(4)]
                outs = llm.generate([PROMPTS[i] for i in order], GREEDY)
                results[t] = {i: o.token_ids for i, o in zip(order, outs)}
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors
        assert all(results[t] == want for t in range(4))
    assert llm.runner.kv.num_free_blocks == llm.runner.kv.num_blocks - 1


def test_stream_never_shows_text_a_stop_string_cuts(target):
    llm = tiny_llm(target)
    full = llm.generate([PROMPTS[0]], GREEDY)[0].text
    words = full.split(" ")
    stop = " ".join(words[3:5]) + " XX"  # never matches, but its prefix does: must be held back and then shown
    stop2 = " ".join(words[4:6])  # matches: cut
    pieces = list(llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=(stop, stop2))))
    final = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=(stop, stop2)))[0].text
    assert "".join(pieces) == final
    assert stop_holdback("abc Par", ("Paris",)) == 3 and stop_holdback("abc", ("x",)) == 0


def test_stream_closed_early_aborts_and_frees(target):
    llm = tiny_llm(target)
    s = llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    next(s)
    outs = llm.generate([PROMPTS[1]], GREEDY)  # a stream held open while generate runs
    assert outs[0].token_ids == alone(target, PROMPTS[1], GREEDY)
    s.close()
    assert llm.runner.kv.num_free_blocks == llm.runner.kv.num_blocks - 1


def test_tree_logprobs_are_returned(target):
    llm = tiny_llm(target, spec=draft_spec(hf_model("llama", seed=7, num_hidden_layers=1), tree=(2, 1)))
    o = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True))[0]
    plain = tiny_llm(target).generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True))[0]
    assert len(o.logprobs) == len(o.token_ids) == 6
    for a, b in zip(o.logprobs, plain.logprobs):
        assert a["token_id"] == b["token_id"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
        assert list(a["top"]) == list(b["top"])


def test_async_engine_streams_and_cancels(target):
    eng = engine(target, SpecConfig(method="ngram", k=3))
    free0 = eng.runner.kv.num_free_blocks

    async def main():
        aeng = AsyncEngine(eng)
        await aeng.start()
        got = []
        async for d in aeng.generate(PROMPTS[0], GREEDY):
            got.extend(d.new_token_ids)
        agen = aeng.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()  # the client went away
        for _ in range(200):
            if eng.runner.kv.num_free_blocks == free0 and not eng.has_unfinished():
                break
            await asyncio.sleep(0.01)
        with pytest.raises(ValueError):
            async for _ in aeng.generate([], GREEDY):
                pass
        await aeng.shutdown()
        return got

    got = asyncio.run(main())
    assert got == alone(target, PROMPTS[0], GREEDY)
    assert eng.runner.kv.num_free_blocks == free0


def test_a_request_failing_later_fails_alone(target):
    """A draft pool too small for one long request: that request finishes with an error, the others complete."""
    spec = draft_spec(hf_model("llama", seed=7, num_hidden_layers=1), k=2)
    llm = tiny_llm(target, spec=spec, draft_cache=CacheConfig(block_size=4, num_blocks=8))
    long_prompt = [(3 * i) % 90 + 2 for i in range(60)]
    with pytest.raises(RequestError, match="KV blocks") as info:
        llm.generate([PROMPTS[0], long_prompt, PROMPTS[3]], GREEDY)
    outs = info.value.outputs
    assert outs[1].finish_reason == "error"
    assert outs[0].token_ids == alone(target, PROMPTS[0], GREEDY)
    assert outs[2].token_ids == alone(target, PROMPTS[3], GREEDY)
    assert llm.runner.kv.num_free_blocks == llm.runner.kv.num_blocks - 1


@pytest.mark.parametrize("tree", [None, (3, 3, 8)])
def test_eagle_through_the_engine_is_lossless(tmp_path, tree):
    """SpecConfig(method='eagle') end to end (a random EAGLE-1 head saved in the published layout and loaded by
    the engine): greedy output equals plain decoding, chain and dynamic tree, with requests joining mid-run."""
    from tiny import model_from_hf, random_eagle_head_dir

    hf = hf_model("qwen2")
    spec = SpecConfig(method="eagle", eagle_head=random_eagle_head_dir(model_from_hf(hf), tmp_path / "head"), k=3,
                      eagle_tree=tree)
    want = [alone(hf, p, GREEDY) for p in PROMPTS[:4]]
    eng = engine(hf, spec)
    got: dict[str, list[int]] = {}
    eng.add_request(PROMPTS[0], GREEDY, request_id="0")
    for i in range(1, 4):
        for d in eng.step():
            got.setdefault(d.request_id, []).extend(d.new_token_ids)
        eng.add_request(PROMPTS[i], GREEDY, request_id=str(i))
    for k, v in run_all(eng).items():
        got.setdefault(k, []).extend(v)
    assert [got[str(i)] for i in range(4)] == want
    assert eng.stats().spec_num_draft_tokens > 0
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks - 1


def test_async_add_cancelled_while_waiting_is_undone(target):
    """A caller that leaves while its add waits for the engine lock: the request must not run to the end."""
    eng = engine(target)
    free0 = eng.runner.kv.num_free_blocks

    async def main():
        aeng = AsyncEngine(eng)
        await aeng.start()
        aeng._lock.acquire()  # the loop thread is busy: the add waits
        task = asyncio.ensure_future(aeng.add(PROMPTS[0], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        aeng._lock.release()
        for _ in range(300):
            await asyncio.sleep(0.01)
            if not eng.has_unfinished() and not eng.requests:
                break
        await aeng.shutdown()

    asyncio.run(main())
    assert not eng.requests and eng.runner.kv.num_free_blocks == free0


@pytest.mark.parametrize("kw,name", [(dict(max_num_seqs=0), "max_num_seqs"), (dict(max_model_len=-5), "max_model_len"),
                                     (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
                                     (dict(join_wait=(-1, 4)), "join_wait"), (dict(join_wait=(0.3, 1.5)), "join_wait")])
def test_engine_limits_are_named(target, kw, name):
    runner = ours_from_hf(target)
    with pytest.raises(ValueError, match=name):
        Engine.from_model(runner.model, tiny_tokenizer(), device="cpu", **kw)


def test_join_wait_reaches_the_engine(target):
    runner = ours_from_hf(target)
    eng = Engine.from_model(runner.model, tiny_tokenizer(), device="cpu", join_wait=(0.3, 4))
    assert (eng.JOIN_WAIT_RATIO, eng.JOIN_WAIT_STEPS) == (0.3, 4)
    assert Engine.JOIN_WAIT_STEPS == 0  # (the class default is untouched)
    llm = LLM.from_model(ours_from_hf(target).model, tiny_tokenizer(), device="cpu", join_wait=(0.5, 2))
    assert (llm.engine.JOIN_WAIT_RATIO, llm.engine.JOIN_WAIT_STEPS) == (0.5, 2)


def test_prompt_longer_than_the_step_budget_is_prefilled_in_chunks(target):
    """An almost context-long prompt with a small step budget: chunked, not refused as 'too many tokens'."""
    llm = tiny_llm(target, max_num_batched_tokens=64)
    prompt = [(5 * i) % 90 + 2 for i in range(500)]  # the tiny model has 512 positions
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == alone(target, prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="context"):
        llm.generate([[3] * 512], GREEDY)
    with pytest.raises(ValueError, match="string or a list of token ids|prompt"):
        llm.generate([b"bytes"], GREEDY)


def test_quantize_reaches_the_loaded_model(tmp_path):
    """LLM(..., quantize='int8') on a checkpoint directory keeps the linears quantized (forerun/models/quant.py)."""
    from forerun.models.quant import Int8Linear, Q8Linear

    hf = hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), quantize="int8", device="cpu", cache=CacheConfig(block_size=4, num_blocks=256))
    assert any(isinstance(m, (Int8Linear, Q8Linear)) for m in llm.model.modules())  # Q8Linear: no VNNI here
    out = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens
    # speculation on the quantized path gives plain decoding's tokens, token for token (the same kernels both ways)
    spec = LLM(str(tmp_path), quantize="int8", device="cpu", cache=CacheConfig(block_size=4, num_blocks=256),
               spec=SpecConfig(method="ngram", k=3))
    assert spec.generate([PROMPTS[0]], GREEDY)[0].token_ids == out.token_ids


@pytest.mark.parametrize("kind", ["plain", "draft", "tree", "sampled"])
def test_forced_tokens_are_replayed_then_generation_continues(target, kind):
    """SamplingParams.forced_tokens (golden tokens): the output starts with them whatever the model prefers,
    each carries the target's teacher-forced logprob (transformers' own forward of prompt + forced tokens), and
    generation continues as it would from prompt + forced; a neighbour in the batch is untouched."""
    draft = hf_model("llama", seed=7, num_hidden_layers=1)
    spec = {"plain": None, "sampled": None, "draft": draft_spec(draft, k=3),
            "tree": draft_spec(draft, tree=(2, 2, 1))}[kind]
    prompt, forced = PROMPTS[0], [5, 17, 3, 60, 60]
    temp = 0.8 if kind == "sampled" else 0.0
    sp = SamplingParams(temperature=temp, seed=3, max_tokens=12, ignore_eos=True, forced_tokens=forced, logprobs=2)
    llm = tiny_llm(target, spec=spec, check_invariants=True)
    out = llm.generate([prompt, PROMPTS[2]], [sp, GREEDY])
    assert out[0].token_ids[:5] == forced
    assert out[1].token_ids == alone(target, PROMPTS[2], GREEDY)
    with torch.no_grad():
        lp = torch.log_softmax(target(torch.tensor([prompt + forced])).logits[0].double(), -1)
    for j, t in enumerate(forced):
        assert out[0].logprobs[j]["token_id"] == t
        assert abs(out[0].logprobs[j]["logprob"] - lp[len(prompt) - 1 + j, t].item()) < 1e-4
    if kind != "sampled":  # greedy: the rest is the greedy continuation of prompt + forced
        rest = alone(target, prompt + forced, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
        assert out[0].token_ids[5:] == rest
    with pytest.raises(ValueError, match="forced_tokens"):
        llm.generate([prompt], SamplingParams(forced_tokens=[10 ** 6]))
