"""TreeRound's device path (every request decoding, one tree size: ids, positions, mask, verification, KV move and
the committed rows' states on the device, one host read of the verdict) against its host path and plain decoding."""
from __future__ import annotations

import os

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from forerun.config import CacheConfig, SpecConfig
from forerun.engine.engine import Engine
from forerun.engine.round import TreeRound
from forerun.engine.sampler import RoundSampler
from forerun.sampling_params import SamplingParams

from tiny import hf_model, model_from_hf, ours_from_hf, random_eagle_head_dir, tiny_tokenizer

PROMPTS = [[5, 9, 13, 22, 40, 7], [3, 4], list(range(10, 60, 3)), [70, 71, 72, 70, 71]]


def _engine(hf, head_dir, tree=(3, 3, 8), budget: bool = True) -> Engine:
    runner = ours_from_hf(hf)
    spec = SpecConfig(method="eagle", eagle_head=head_dir, k=3, eagle_tree=tree)
    eng = Engine.from_model(runner.model, tiny_tokenizer(hf.config.vocab_size), spec=spec, device="cpu",
                            check_invariants=True, cache=CacheConfig(block_size=4, num_blocks=2048))
    if not budget:  # the configured tree every round (the budget follows measured times: not replayable)
        eng.drafter.budget = None
    return eng


def _drain(eng: Engine, after_step=None) -> dict[str, list[int]]:
    """Step the engine until every request has finished; each request's tokens by id. after_step(steps): called
    after every step (arrivals)."""
    out: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished():
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
        steps += 1
        if after_step is not None:
            after_step(steps)
    return out


def _run(eng: Engine, params: list[SamplingParams], host_only: bool = False) -> tuple[list[list[int]], dict]:
    calls = {"device": 0, "host": 0}
    run_device, run_host = TreeRound._run_device, TreeRound._run_host

    def dev(self, *a, **k):
        calls["device"] += 1
        return run_device(self, *a, **k)

    def host(self, *a, **k):
        calls["host"] += 1
        return run_host(self, *a, **k)

    eng.round._run_device = dev.__get__(eng.round)
    eng.round._run_host = host.__get__(eng.round)
    if host_only:  # the general path for every round: the proposal's device tree is ignored
        prop_async = eng.drafter.propose_tree_async

        def no_device(reqs, max_drafts=None):
            d = prop_async(reqs, max_drafts)
            d.device = None
            return d

        eng.drafter.propose_tree_async = no_device
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        eng.add_request(p, sp, request_id=str(i))
    out = _drain(eng)
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks - 1
    return [out[str(i)] for i in range(len(params))], calls


def _plain(hf, params: SamplingParams) -> list[list[int]]:
    """Plain greedy decoding of PROMPTS (the reference)."""
    plain = Engine.from_model(ours_from_hf(hf).model, tiny_tokenizer(hf.config.vocab_size), device="cpu",
                              cache=CacheConfig(block_size=4, num_blocks=2048))
    for i, p in enumerate(PROMPTS):
        plain.add_request(p, params, request_id=str(i))
    out = _drain(plain)
    return [out[str(i)] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf = hf_model("qwen2")
    return hf, random_eagle_head_dir(model_from_hf(hf), tmp_path_factory.mktemp("head") / "head")


@pytest.mark.parametrize("budget", [False, True])
def test_device_round_greedy_equals_plain(setup, budget):
    """budget: the engine's tree budget (shapes from measured costs: the drafter's budget bookkeeping runs too)."""
    hf, head = setup
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    got, calls = _run(_engine(hf, head, budget=budget), [greedy] * len(PROMPTS))
    assert got == _plain(hf, greedy)
    assert calls["device"] > 0 or budget


def test_confidence_cut_rounds_equal_plain_with_fewer_rows(setup):
    """SpecConfig.confidence_threshold on an EAGLE tree (the drafter's tree_confidence): greedy output still plain
    greedy through the device path, and the rounds verify fewer nodes than the full trees, yet some (this random
    head's depth-1 candidates reach 0.005 and none of the deeper ones: 4 nodes of 8); with 0.02 none (every round
    plain, still the same output); a sampled request beside greedy ones keeps its static tree and its output is the
    host path's. (Ragged cuts within one batch: tests/test_eagle.py's confidence tests.)"""
    hf, head = setup
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    full, _ = _run(_engine(hf, head, budget=False), [greedy] * len(PROMPTS))
    eng_full = _engine(hf, head, budget=False)
    _run(eng_full, [greedy] * len(PROMPTS))
    nodes = {}
    for conf in (0.005, 0.02):
        cut = replace(eng_full.spec, confidence_threshold=conf)
        eng = Engine.from_model(eng_full.runner.model, tiny_tokenizer(hf.config.vocab_size), spec=cut, device="cpu",
                                check_invariants=True, cache=CacheConfig(block_size=4, num_blocks=2048))
        eng.drafter.budget = None
        assert eng.drafter.tree_confidence == conf
        got, calls = _run(eng, [greedy] * len(PROMPTS))
        assert got == full == _plain(hf, greedy)
        assert calls["device"] > 0 or conf == 0.02
        nodes[conf] = eng.stats().spec_num_draft_tokens
    assert 0 == nodes[0.02] < nodes[0.005] < eng_full.stats().spec_num_draft_tokens
    mixed = [SamplingParams(temperature=1.0 if i % 2 else 0.0, max_tokens=12, ignore_eos=True) for i in range(4)]
    cut = replace(eng_full.spec, confidence_threshold=0.005)
    outs = []
    for host_only in (False, True):
        e = Engine.from_model(eng_full.runner.model, tiny_tokenizer(hf.config.vocab_size), spec=cut, device="cpu",
                              check_invariants=True, cache=CacheConfig(block_size=4, num_blocks=2048))
        e.drafter.budget = None
        torch.manual_seed(0)
        outs.append(_run(e, mixed, host_only=host_only)[0])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kind", ["greedy", "seeded", "sampled", "mixed"])
def test_device_round_equals_host_round(setup, kind):
    """The same requests (same seeds, same generators) through the device path and the host path: identical
    output, greedy, coupled (seeded) sampling, exact tree sampling; a mixed batch (greedy + sampled trees of
    different sizes) takes the host path."""
    hf, head = setup
    mk = {"greedy": lambda i: SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          "seeded": lambda i: SamplingParams(temperature=0.8, seed=10 + i, max_tokens=12, ignore_eos=True),
          "sampled": lambda i: SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
          "mixed": lambda i: SamplingParams(temperature=1.0 if i % 2 else 0.0, max_tokens=12, ignore_eos=True)}[kind]
    params = [mk(i) for i in range(len(PROMPTS))]
    torch.manual_seed(0)
    a, ca = _run(_engine(hf, head, budget=False), params)
    torch.manual_seed(0)
    b, cb = _run(_engine(hf, head, budget=False), params, host_only=True)
    assert a == b
    assert cb["device"] == 0
    if kind != "mixed":
        assert ca["device"] > 0


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_device_round_commits_paths_with_the_kernels(setup, kind, monkeypatch):
    """The accepted paths' KV moves and state gathers through forerun/kernels/path_commit.py (CUDA's default; here
    under Triton's interpreter) against the host path: identical output, the cache invariants checked every step."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter is off beside a GPU (tests/test_path_commit.py runs the kernels on CUDA)")
    from forerun.kernels import path_commit
    hf, head = setup
    temp = 0.0 if kind == "greedy" else 1.0
    params = [SamplingParams(temperature=temp, max_tokens=12, ignore_eos=True) for _ in PROMPTS]
    torch.manual_seed(0)
    b, _ = _run(_engine(hf, head, budget=False), params, host_only=True)
    monkeypatch.setenv("FORERUN_PATH_KERNELS", "1")  # (conftest runs Triton's interpreter without CUDA)
    moves = []
    real = path_commit.move_paths
    monkeypatch.setattr(path_commit, "move_paths", lambda *a: moves.append(a[3].clone()) or real(*a))
    torch.manual_seed(0)
    a, ca = _run(_engine(hf, head, budget=False), params)
    assert a == b
    assert ca["device"] > 0 and len(moves) == ca["device"]
    if kind == "sampled":  # some accepted node sat elsewhere than where a chain puts it (a move that copies, not
        # a slot onto itself; the random head's greedy paths are too short for one)
        assert any(bool((nd[:, 1:] > torch.arange(1, nd.shape[1])).any()) for nd in moves)


def test_batched_kv_move_equals_per_sequence_move():
    from forerun.config import ModelConfig
    from forerun.kvcache.pool import KVPool

    cfg = ModelConfig(arch="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    pools = [KVPool(cfg, CacheConfig(block_size=4, num_blocks=16), torch.float32, "cpu") for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    init = torch.randn(pools[0].k.shape, generator=g)
    for p in pools:
        p.k.copy_(init)
        p.v.copy_(-init)
        for s in (1, 2):
            p.add_sequence(s)
            p.reserve(s, 13)
            p.set_length(s, 13)
    moves = {1: ([5, 7, 9], [4, 5, 6]), 2: ([3, 8], [2, 3])}
    for s, (src, dst) in moves.items():
        pools[0].move(s, src, dst)
    src = torch.cat([pools[1].slots(s, p, p + 1) for s, (a, _) in moves.items() for p in a])
    dst = torch.cat([pools[1].slots(s, p, p + 1) for s, (_, b) in moves.items() for p in b])
    pools[1].move(None, src, dst)
    assert torch.equal(pools[0].k, pools[1].k) and torch.equal(pools[0].v, pools[1].v)
    assert not torch.equal(pools[0].k, init)


# -- overlapped rounds: the next round's drafting queued from the device verdict (EagleDrafter.prelaunch) ----------
class _PathSampler(RoundSampler):
    """The engine's verifier with its device verdict replaced by a path drawn at random (the tree's first-ranked
    child at every level, to a random depth), so the rounds accept 0..max_depth drafts although the random head
    drafts nothing the tiny target would accept. Records every verified tree (tokens, parents) and path."""

    def __init__(self, seed: int) -> None:
        super().__init__("auto")
        self.gen = torch.Generator().manual_seed(seed)
        self.seen: list = []

    def tree_launch(self, logits, requests, rows, starts, tokens, parents, draft_probs, depths, layout=None):
        pending = super().tree_launch(logits, requests, rows, starts, tokens, parents, draft_probs, depths, layout)
        b, n = len(rows), max(rows)
        if any(x != n for x in rows) or tokens.shape[0] != b * n:
            return pending
        dev = tokens.device
        par, tok = parents.view(b, n), tokens.view(b, n)
        j = torch.arange(n, device=dev)
        want = torch.randint(0, n, (b,), generator=self.gen).to(dev)
        nodes = torch.full((b, n), -1, dtype=torch.long, device=dev)
        nodes[:, 0] = 0
        cur, alive = torch.zeros(b, dtype=torch.long, device=dev), torch.ones(b, dtype=torch.bool, device=dev)
        for d in range(1, n):
            child = torch.where((par == cur[:, None]) & (j > 0), j, n).min(-1).values
            alive = alive & (child < n) & (d <= want)
            cur = torch.where(alive, child, cur)
            nodes[:, d] = torch.where(alive, cur, -1)
        acc = (nodes >= 0).sum(-1) - 1
        out = torch.where(nodes[:, 1:] >= 0, tok.gather(1, nodes[:, 1:].clamp(min=0)), -1)
        out = torch.cat([out, torch.full_like(out[:, :1], -1)], 1)
        out.scatter_(1, acc[:, None], pending.res.output_token_ids[:, :1].clamp(min=0))
        self.seen.append((tok[:, 1:].tolist(), par.tolist(), acc.tolist()))
        res = SimpleNamespace(num_accepted=acc, accepted_nodes=nodes, output_token_ids=out)
        host, event = self.verdict_to_host(res, pending.bad)
        return replace(pending, res=res, host=host, event=event)


def _target_graphs(eng: Engine) -> None:
    """The target's CUDA-graph runner with eager bodies (buckets, static buffers, replay counts as on the GPU), whose
    outputs live in one buffer per graph as a captured graph's do: a read of a replay's output after the next
    replay of its bucket sees the next one's, as on the GPU."""
    from forerun.models.llama import ForwardOutput
    from forerun.runtime.cuda_graph import GraphRunner

    gr = GraphRunner(eng.runner, batch_sizes=(1, 2, 4, 8), max_q_len=eng.spec.max_draft_tokens + 1, use_graphs=False)
    replay, static = gr._replay, {}

    def static_replay(cap):
        out = replay(cap)
        keep = static.get(id(cap))
        if keep is None:
            keep = static[id(cap)] = ForwardOutput(
                None if out.logits is None else torch.empty_like(out.logits),
                {layer: torch.empty_like(h) for layer, h in out.hidden_states.items()})
        if out.logits is not None:
            keep.logits.copy_(out.logits)
        for layer, h in out.hidden_states.items():
            keep.hidden_states[layer].copy_(h)
        return keep

    gr._replay = static_replay
    eng.runner.graphs = gr


def _overlap_run(hf, head, overlap: bool, budget: bool, late: bool = True, graphs: bool = False, monkeypatch=None,
                 preverify: bool | None = False, stops: dict | None = None):
    """preverify: queue the next round's verify step too (on the target's eager stand-in graph runner); False: the
    target runs its verify steps as before (no graph runner)."""
    eng = _engine(hf, head, tree=(3, 3, 8), budget=budget)
    eng.drafter.overlap_trees = overlap
    if preverify is not False:
        _target_graphs(eng)
        eng.round.preverify = preverify
    if graphs:  # the CUDA path's buckets and graph keys, eager bodies; a first use "captures" over dummy inputs
        from forerun.drafters.eagle import _StaticDrafting

        monkeypatch.setattr(type(eng.drafter), "_graphs_on", lambda self: True)
        get = _StaticDrafting._get

        def capturing_get(self, key, body, b, qe):
            if key not in self.graphs:
                self._dummy(b, qe)  # what a capture's warm-up runs do to the static inputs
            return get(self, key, body, b, qe)

        monkeypatch.setattr(_StaticDrafting, "_get", capturing_get)
    eng.round.sampler = sampler = _PathSampler(seed=3)
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=48 + 6 * i, ignore_eos=True,
                                          stop_token_ids=(stops or {}).get(i, ())), request_id=str(i))
    def arrive(steps: int) -> None:
        if late and steps == 4:  # a request arriving mid-way: the next round is not the one prelaunched
            eng.add_request([9, 8, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), request_id="late")

    out = _drain(eng, arrive)
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks - 1
    if preverify is not False:
        return out, sampler.seen, eng.drafter.prelaunch_stats, eng.round.preverify_stats
    return out, sampler.seen, eng.drafter.prelaunch_stats


@pytest.mark.parametrize("graphs", [False, True])
def test_prelaunched_drafting_equals_drafting_after_the_verdict(setup, graphs, monkeypatch):
    """Rounds accepting 0..2 drafts (a drawn verdict): with the next round's drafting queued from the device verdict,
    every round verifies the same trees (node for node) and commits the same tokens as with the drafting launched
    after the host read; prelaunched trees are used, and one that no longer fits (a request joined) is dropped.
    graphs: the CUDA path's bucketed static buffers, graphs first "captured" during a prelaunch (a capture's dummy
    run once overwrote the prelaunch's inputs on the H200: every request drafted the same tree)."""
    hf, head = setup
    off = _overlap_run(hf, head, False, False, graphs=graphs, monkeypatch=monkeypatch)
    on = _overlap_run(hf, head, True, False, graphs=graphs, monkeypatch=monkeypatch)
    assert off[2] == {"launched": 0, "used": 0, "discarded": 0, "partial": 0}
    stats = on[2]
    assert stats["used"] >= 8 and stats["discarded"] >= 1, stats
    assert stats["launched"] == stats["used"] + stats["discarded"]
    assert sorted({a for _, _, accs in on[1] for a in accs}) == [0, 1, 2]  # every path length happened
    assert on[1] == off[1]
    assert on[0] == off[0]


@pytest.mark.parametrize("budget", [False, True])
def test_prelaunched_drafting_keeps_greedy_output(setup, budget):
    """The real greedy verdict with overlapped drafting on: output identical to plain decoding (the test above
    without a drawn verdict; prelaunches happen). budget: shapes chosen from measured times (not replayable, so
    not compared round by round above), the look-ahead `choose(record=False)` guessing the next shape."""
    hf, head = setup
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eng = _engine(hf, head, budget=budget)
    eng.drafter.overlap_trees = True
    got, calls = _run(eng, [greedy] * len(PROMPTS))
    stats = eng.drafter.prelaunch_stats
    assert stats["launched"] >= stats["used"] + stats["discarded"] and stats["launched"] <= stats["used"] + stats["discarded"] + 1
    assert stats["used"] > 0 or budget
    assert got == _plain(hf, greedy)


# -- overlapped rounds: the next round's verify step queued from the device verdict too (TreeRound._queue_verify) --
@pytest.mark.parametrize("graphs", [False, True])
def test_preverified_rounds_equal_rounds_verified_after_the_verdict(setup, graphs, monkeypatch):
    """With the next round's verify step queued from the device verdict (ids, positions, cache slots and tree mask
    from the drawn verdict and the prelaunched tree), every round verifies the same trees and commits the same
    tokens as rounds that prepare their verify step on the host after the read; queued steps are used, and the one
    queued before a request joined is dropped. graphs: the drafter's bucketed static buffers too."""
    hf, head = setup
    base = _overlap_run(hf, head, True, False, graphs=graphs, monkeypatch=monkeypatch, preverify=False)
    on = _overlap_run(hf, head, True, False, graphs=graphs, monkeypatch=monkeypatch, preverify=True)
    monkeypatch.setenv("FORERUN_EAGLE_PREVERIFY", "0")  # (None follows the switch)
    switched = _overlap_run(hf, head, True, False, graphs=graphs, monkeypatch=monkeypatch, preverify=None)
    monkeypatch.delenv("FORERUN_EAGLE_PREVERIFY")
    assert switched[3] == {"launched": 0, "used": 0, "discarded": 0, "partial": 0}
    stats = on[3]
    assert stats["used"] >= 8 and stats["discarded"] >= 1, stats
    assert stats["launched"] == stats["used"] + stats["discarded"]
    assert sorted({a for _, _, accs in on[1] for a in accs}) == [0, 1, 2]
    assert on[1] == base[1] == switched[1]
    assert on[0] == base[0] == switched[0]


@pytest.fixture(scope="module")
def setup_llama(tmp_path_factory):
    """A tiny llama whose greedy continuations vary (the qwen2 one repeats one token per prompt)."""
    from tiny import sharpen

    hf = sharpen(hf_model("llama"), 8.0)
    return hf, random_eagle_head_dir(model_from_hf(hf), tmp_path_factory.mktemp("head_llama") / "head")


def test_round_prep_kernels_commit_what_the_torch_ops_commit(setup_llama, monkeypatch):
    """forerun/kernels/round_prep.py in the round (here under Triton's interpreter; CUDA runs them by default): the
    queued verify steps' inputs and the head's extend after a verdict, laid out by the two kernels, give the trees
    drafted, the paths, the commits and the queued-step counts that the torch ops give (the drafter's bucketed
    buffers, a join). The llama's continuations vary, so a bonus token in the wrong extend row changes the next
    trees' drafts (with the qwen2 one, whose bonus token is mostly the root's, it would not)."""
    if os.environ.get("TRITON_INTERPRET") != "1":  # a GPU machine: Triton would launch them on these CPU tensors
        pytest.skip("runs the kernels on a CPU engine under Triton's interpreter (on CUDA: tests/test_round_prep.py)")
    hf, head = setup_llama
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FORERUN_PREP_KERNELS", flag)
        runs[flag] = _overlap_run(hf, head, True, False, graphs=True, monkeypatch=monkeypatch, preverify=True)
    assert runs["1"][3]["used"] >= 8 and runs["1"][3] == runs["0"][3]
    assert runs["1"][1] == runs["0"][1] and runs["1"][0] == runs["0"][0]


@pytest.mark.parametrize("which", ["qwen2", "llama"])
def test_preverified_rounds_keep_greedy_output(setup, setup_llama, which):
    """The real greedy verdict with the next round's drafting and verify step queued ahead: output identical to plain
    decoding, queued verify steps used."""
    hf, head = setup if which == "qwen2" else setup_llama
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eng = _engine(hf, head, budget=False)
    eng.drafter.overlap_trees = True
    _target_graphs(eng)
    got, calls = _run(eng, [greedy] * len(PROMPTS))
    stats = eng.round.preverify_stats
    assert stats["used"] > 0 and stats["launched"] == stats["used"] + stats["discarded"], stats
    assert got == _plain(hf, greedy)


def test_preverify_waits_for_joins_and_context_room(setup):
    """The engine's veto: no verify step is queued while a request waits to join (the next round reads its prompt)
    or when a next tree could reach the context limit."""
    hf, head = setup
    eng = _engine(hf, head, budget=False)
    r = SimpleNamespace(num_tokens=100)
    eng.scheduler.running = [r]
    assert eng._tree_lookahead([r], 2, 8)
    assert not eng._tree_lookahead([r], 2, eng.max_model_len - 100 - 3)
    eng.scheduler.waiting.append(SimpleNamespace(num_tokens=5))
    assert not eng._tree_lookahead([r], 2, 8)
    eng.scheduler.waiting.clear()
    eng.scheduler.running = [r, SimpleNamespace(num_tokens=7)]  # somebody else runs: the next round is not this one
    assert not eng._tree_lookahead([r], 2, 8)


@pytest.mark.parametrize("forced,min_batch", [(None, 1), (None, 2), (True, 2), (False, 1)])
def test_preverify_from_the_smallest_batch_unless_forced(setup, forced, min_batch, monkeypatch):
    """A lone request's next verify step is queued ahead automatically from TreeRound.PREVERIFY_MIN_BATCH (1, the
    default: measured on the H200 in session 31) requests on, or when forced, and never when forced off; its output
    is plain greedy either way."""
    hf, head = setup
    assert TreeRound.PREVERIFY_MIN_BATCH == 1
    monkeypatch.setattr(TreeRound, "PREVERIFY_MIN_BATCH", min_batch)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eng = _engine(hf, head, budget=False)
    eng.drafter.overlap_trees = True
    _target_graphs(eng)
    eng.round.preverify = forced
    eng.add_request(PROMPTS[0], greedy, request_id="0")
    out = _drain(eng)["0"]
    stats = eng.round.preverify_stats
    queued = forced if forced is not None else min_batch <= 1
    assert (stats["used"] > 0) if queued else stats["launched"] == 0, stats
    assert out == _plain(hf, greedy)[0]


class _SpoilingSampler(RoundSampler):
    """The engine's verifier, with a NaN put into one target row of every device-path (greedy verdict) round."""

    def __init__(self) -> None:
        super().__init__("auto")
        self.spoiled = 0

    def tree_launch(self, logits, requests, rows, starts, tokens, parents, draft_probs, depths, layout=None):
        if layout is not None:
            logits = logits.clone()
            logits[3, 5] = float("nan")
            self.spoiled += 1
        return super().tree_launch(logits, requests, rows, starts, tokens, parents, draft_probs, depths, layout)


@pytest.mark.parametrize("preverify", [False, True])
def test_device_round_names_non_finite_target_logits(setup, preverify):
    """A NaN in the target's logits stops the device round (greedy verdict) with an error naming the request, also
    when the next verify step was queued over the same logits' memory (preverify: no re-read)."""
    hf, head = setup
    eng = _engine(hf, head, budget=False)
    eng.drafter.overlap_trees = True
    if preverify:
        _target_graphs(eng)
        eng.round.preverify = True
    eng.round.sampler = sampler = _SpoilingSampler()
    for i, p in enumerate(PROMPTS[:2]):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), request_id=str(i))
    with pytest.raises(ValueError, match="NaN") as err:
        while eng.has_unfinished():
            eng.step()
    assert sampler.spoiled >= 1 and "request" in str(err.value)
    # (queued over: the verdict's flag is reported without re-reading the logits, naming the round's requests)
    assert ("of this round" in str(err.value)) == preverify and eng.round.preverify_stats["launched"] == preverify


def test_preverify_waits_for_a_steady_batch(setup):
    """The automatic choice queues the next verify step only while recent rounds kept their requests: with a request
    arriving every few rounds (each arrival drops the step queued before it) it drops fewer than when forced; with
    a steady batch it queues them; the output is plain greedy either way."""
    hf, head = setup
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def run(forced, arrivals):
        eng = _engine(hf, head, budget=False)
        eng.drafter.overlap_trees = True
        _target_graphs(eng)
        eng.round.preverify = forced
        for i, p in enumerate(PROMPTS):
            eng.add_request(p, greedy, request_id=str(i))
        def arrive(steps: int) -> None:
            if arrivals and steps % 4 == 0 and steps <= 16:
                eng.add_request([9, 8, 7, steps], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                request_id=f"late{steps}")

        out = _drain(eng, arrive)
        return [out[str(i)] for i in range(len(PROMPTS))], dict(eng.round.preverify_stats)

    forced, auto = run(True, True), run(None, True)
    assert auto[0] == forced[0] == _plain(hf, greedy)
    assert forced[1]["discarded"] >= 3 and auto[1]["discarded"] < forced[1]["discarded"], (forced[1], auto[1])
    steady = run(None, False)
    assert steady[1]["used"] >= 5 and steady[1]["discarded"] <= 1, steady[1]


@pytest.mark.parametrize("graphs", [False, True])
def test_queued_rounds_survive_requests_ending_early(setup, graphs, monkeypatch):
    """Requests ending on a stop token (an end the look-ahead cannot plan for): the next round takes the rows of the
    requests still running from the drafting and the verify step queued for all of them (`partial`), and every round
    verifies the same trees and commits the same tokens as without queuing anything."""
    hf, head = setup
    free = _overlap_run(hf, head, True, False, late=False, graphs=graphs, monkeypatch=monkeypatch)[0]

    def first_new(out: list[int], at: int) -> int:  # a token first emitted at `at` or after: the request stops there
        return next(t for j, t in enumerate(out) if j >= at and t not in out[:j])

    # request 0 ends first (the rows taken are then not a prefix of those queued), 2 later; request 3 runs on
    stops = {i: (first_new(free[str(i)], 12 + 8 * i),) for i in range(3)}
    none = _overlap_run(hf, head, False, False, late=False, graphs=graphs, monkeypatch=monkeypatch, stops=stops)
    on = _overlap_run(hf, head, True, False, late=False, graphs=graphs, monkeypatch=monkeypatch, preverify=True,
                      stops=stops)
    assert len(on[0]["0"]) < 48 and len(on[0]["2"]) < 60  # they ended early (1 may or may not: once the batch
    # changes, the drawn paths, and so its tokens, differ from the run that chose the stop tokens)
    assert on[2]["partial"] >= 1 and on[3]["partial"] >= 1, (on[2], on[3])
    done = on[3]["used"] + on[3]["discarded"]
    assert done <= on[3]["launched"] <= done + 1  # (the last request's last round may leave one queued)
    assert on[1] == none[1] and on[0] == none[0]
