"""Ragged steps replayed as a few bucket replays (GraphRunner.forward_pieces) give what one forward gives.

On CUDA a prefill chunk, a drafter's catch-up or a prompt beside decode rows replays CUDA graphs of one sequence x
a piece length instead of running eagerly. The cutting, the overlapping last piece, the logits / hidden-state
bookkeeping and the cache it leaves are device-independent, so they are checked here with an eager GraphRunner
(`use_graphs=False` runs each bucket's body); tests/test_gpu.py runs the same on captured graphs.
"""
from __future__ import annotations

import pytest
import torch

from forerun.runtime.cuda_graph import PIECE_SIZES, GraphRunner, split_pieces
from forerun.runtime.runner import Chunk
from tiny import hf_model, ours_from_hf


@pytest.mark.parametrize("n", list(range(1, 70)) + [127, 128, 129, 130, 200, 511, 512, 513, 1000, 1100, 4096])
def test_split_pieces_covers_every_token_with_bucket_lengths(n):
    cut = split_pieces(n)
    assert all(q in PIECE_SIZES for _, q in cut)
    assert cut[0][0] == 0 and cut[-1][0] + cut[-1][1] == n  # starts at 0, ends at n
    for (a, q), (b, _) in zip(cut, cut[1:]):
        assert b <= a + q  # no gap
    for (a, q), (b, _) in zip(cut[:-2], cut[1:-1]):
        assert b == a + q  # only the last piece overlaps
    assert len(cut) <= n // 512 + 3


def test_split_pieces_examples():
    assert split_pieces(130) == [(0, 128), (128, 2)]
    assert split_pieces(200) == [(0, 128), (72, 128)]
    assert split_pieces(20) == [(0, 16), (16, 4)]
    assert split_pieces(6) == [(0, 4), (4, 2)]
    assert split_pieces(1100) == [(0, 512), (512, 512), (972, 128)]


def _runner(max_q_len=4, **kw):
    r = ours_from_hf(hf_model("qwen3"), block_size=4, num_blocks=512)
    r.graphs = GraphRunner(r, batch_sizes=(1, 2, 4), max_q_len=max_q_len, use_graphs=False, **kw)
    return r


def _cache(runner, seq, n):
    """The sequence's K and V rows 0..n-1 of every layer."""
    kv, bs = runner.kv, runner.kv.block_size
    blocks = kv.blocks(seq)
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])
    return [(k.reshape(-1, *k.shape[2:])[slots], v.reshape(-1, *v.shape[2:])[slots]) for k, v in zip(kv.k, kv.v)]


def _same_caches(a, b, seqs):
    """Equal lengths and K / V rows for every sequence, and the next step reads both caches alike."""
    for s in seqs:
        assert a.kv.length(s) == b.kv.length(s)
        for (k1, v1), (k2, v2) in zip(_cache(a, s, a.kv.length(s)), _cache(b, s, b.kv.length(s))):
            torch.testing.assert_close(k1, k2, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v1, v2, atol=1e-4, rtol=1e-4)
    nxt = [Chunk(s, [17]) for s in seqs]
    torch.testing.assert_close(a.forward(nxt)[0].logits, b.forward(nxt)[0].logits, atol=1e-4, rtol=1e-4)


def test_pieces_equal_one_forward_logits_hidden_and_cache():
    """A ragged step (a 37-token prompt, a 3-token chunk without logits, two 1-token rows) as pieces vs as one
    forward on a runner without graphs: same logits rows, hidden states of every fed token, cache lengths and
    cache contents (the overlapping last piece rewrites positions with the same values)."""
    torch.manual_seed(0)
    ref, pcs = _runner(), _runner()
    ref.graphs = None
    prompts = {0: list(range(3, 40)), 1: [5, 6, 7], 2: [9], 3: [11]}
    for r in (ref, pcs):
        for s in prompts:
            r.kv.add_sequence(s)
        r.forward([Chunk(2, [4, 5, 6, 7, 8])])  # sequences 2, 3 have a context already
        r.forward([Chunk(3, [3, 2])])
    chunks = [Chunk(0, prompts[0], logits="last"), Chunk(1, prompts[1], logits="none"),
              Chunk(2, prompts[2], logits="last"), Chunk(3, prompts[3], logits="last")]
    assert pcs.graphs.plan_pieces(chunks) is not None
    before = pcs.graphs.pieces_steps
    out_r, st_r = ref.forward(chunks, hidden_layers=(0, 2))
    out_p, st_p = pcs.forward(chunks, hidden_layers=(0, 2))
    assert pcs.graphs.pieces_steps == before + 1
    assert st_p == st_r == [0, 1, 1, 2]
    assert out_p.logits.shape == out_r.logits.shape == (3, 97)
    torch.testing.assert_close(out_p.logits, out_r.logits, atol=1e-4, rtol=1e-4)
    for layer in (0, 2):
        assert out_p.hidden_states[layer].shape == out_r.hidden_states[layer].shape == (37 + 3 + 1 + 1, 64)
        torch.testing.assert_close(out_p.hidden_states[layer], out_r.hidden_states[layer], atol=1e-4, rtol=1e-4)
    _same_caches(pcs, ref, prompts)  # (and the next step reads that cache alike)


def test_pieces_not_used_where_one_bucket_fits_or_a_chunk_cannot_be_cut():
    r = _runner(max_q_len=4, max_pieces=3)
    g = r.graphs
    assert g.plan_pieces([Chunk(0, [1, 2, 3]), Chunk(1, [4, 5, 6])]) is None  # uniform: the ordinary bucket
    assert g.plan_pieces([Chunk(0, list(range(20)), logits=3)]) is None  # several logits rows of a long chunk
    assert g.plan_pieces([Chunk(0, list(range(20)), positions=list(range(20)))]) is None
    assert len(g.plan_pieces([Chunk(0, list(range(700)))])) == 2  # 512 + an overlapping 256
    # 3 x 16 in one replay (long pieces of several sequences share a bucket), then 3 x 4: 2 replays
    assert [(tuple(i), q, m) for i, q, m, _ in g.plan_pieces([Chunk(i, list(range(20))) for i in range(3)])] == [
        ((0, 1, 2), 16, 0), ((0, 1, 2), 4, 1)]
    g.piece_batch_tokens = 16  # one 16-token piece per replay: 3 + 1 replays, more than max_pieces
    assert g.plan_pieces([Chunk(i, list(range(20))) for i in range(3)]) is None
    g.piece_batch_tokens = 1024
    g.max_pieces = 8
    plan = g.plan_pieces([Chunk(0, list(range(10))), Chunk(1, [1]), Chunk(2, [2]), Chunk(3, [4, 5], logits=2)])
    assert [(tuple(i), q, m, w) for i, q, m, w in plan] == [  # replay r holds the r-th pieces, grouped
        ((0,), 8, 0, [(0, 8)]), ((1, 2), 1, 1, [(0, 1), (0, 1)]), ((3,), 2, 2, [(0, 2)]), ((0,), 2, 1, [(8, 2)])]


def test_long_pieces_of_several_prompts_share_replays_up_to_the_token_cap():
    """Prompts read together: their long pieces replay several sequences at once, at most piece_batch(q) of them
    (a bucket size within piece_batch_tokens tokens, PIECE_BATCH sequences); a lone prompt still replays alone."""
    g = _runner(max_q_len=4).graphs  # buckets 1, 2, 4
    g.piece_batch_tokens = 64
    assert [g.piece_batch(q) for q in (8, 16, 32, 64, 128)] == [4, 4, 2, 1, 1]
    plan = g.plan_pieces([Chunk(i, list(range(32)), logits="last") for i in range(3)])
    assert [(tuple(i), q, m) for i, q, m, _ in plan] == [((0, 1), 32, 1), ((2,), 32, 1)]
    plan = g.plan_pieces([Chunk(i, list(range(16)), logits="last") for i in range(5)])
    assert [(tuple(i), q, m) for i, q, m, _ in plan] == [((0, 1, 2, 3), 16, 1), ((4,), 16, 1)]
    # within one replay's share: pad to the bucket, or split by powers of two where padding wastes more
    g8 = _runner(max_q_len=4).graphs
    g8.batch_sizes = (1, 2, 4, 8)
    assert [g8._long_piece_split(n) for n in range(1, 9)] == [[1], [2], [3], [4], [4, 1], [4, 2], [7], [8]]
    assert g._fits(4, 16) and not g._fits(4, 32) and g._fits(1, 512) and g._fits(2, 32)


def test_grouped_prompt_pieces_equal_one_forward():
    """Prompts of 37, 40, 35 and 23 tokens and a 1-token row as pieces (the long pieces of the prompts grouped in
    shared replays, three 32-token pieces padded to a bucket of 4) vs one forward: same logits, hidden states and
    cache contents."""
    torch.manual_seed(0)
    ref, pcs = _runner(), _runner()
    ref.graphs = None
    prompts = {0: list(range(3, 40)), 1: list(range(50, 90)), 2: list(range(7, 30)), 3: [9], 4: list(range(60, 95))}
    for r in (ref, pcs):
        for s in prompts:
            r.kv.add_sequence(s)
        r.forward([Chunk(3, [4, 5, 6, 7, 8])])
    chunks = [Chunk(s, p, logits="last") for s, p in prompts.items()]
    plan = pcs.graphs.plan_pieces(chunks)
    assert plan is not None and any(len(i) == 3 and q == 32 for i, q, _, _ in plan), plan
    out_r, st_r = ref.forward(chunks, hidden_layers=(1,))
    out_p, st_p = pcs.forward(chunks, hidden_layers=(1,))
    assert st_p == st_r
    torch.testing.assert_close(out_p.logits, out_r.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out_p.hidden_states[1], out_r.hidden_states[1], atol=1e-4, rtol=1e-4)
    _same_caches(pcs, ref, prompts)


def test_a_catch_up_of_many_requests_is_a_few_grouped_replays():
    """A drafter's catch-up: requests missing 3..6 tokens each (no logits) replay as power-of-two pieces of all of
    them at once, round by round (the remainders in the second round)."""
    g = _runner(max_q_len=8).graphs
    plan = g.plan_pieces([Chunk(i, list(range(n)), logits="none") for i, n in enumerate((3, 3, 5, 6))])
    assert [(tuple(i), q, m, w) for i, q, m, w in plan] == [
        ((0, 1), 2, 0, [(0, 2), (0, 2)]), ((2, 3), 4, 0, [(0, 4), (0, 4)]),
        ((0, 1, 2), 1, 0, [(2, 1), (2, 1), (4, 1)]), ((3,), 2, 0, [(4, 2)])]


def test_engine_greedy_equal_with_pieces():
    """Speculative greedy output with prompts fed as pieces (the draft model's prompt feed too) equals plain
    greedy output of an engine without graphs, for prompts longer than a verify step."""
    from forerun.config import CacheConfig, SpecConfig
    from forerun.engine.llm import LLM
    from forerun.sampling_params import SamplingParams
    from tiny import sharpen, tiny_tokenizer

    target = sharpen(hf_model("llama"), 3.0)
    draft = ours_from_hf(sharpen(hf_model("llama", seed=1, num_hidden_layers=1), 3.0))
    prompts = [list(range(3, 3 + n)) for n in (5, 19, 40, 77)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tok = tiny_tokenizer(97)

    def llm(spec):
        return LLM.from_model(ours_from_hf(target).model, tok, spec=spec, device="cpu", check_invariants=True,
                              cache=CacheConfig(block_size=4, num_blocks=2048))

    want = [o.token_ids for o in llm(None).generate(prompts, params)]
    spec = llm(SpecConfig(method="draft", draft_model=(draft.model, tok), k=3))
    eng = spec.engine
    for runner in (eng.runner, eng.drafter.runner):
        runner.graphs = GraphRunner(runner, batch_sizes=(1, 2, 4), max_q_len=4, use_graphs=False)
    eng.scheduler.draft_prefill = False
    got = [o.token_ids for o in spec.generate(prompts, params)]
    assert got == want
    assert eng.runner.graphs.pieces_steps > 0 and eng.drafter.runner.graphs.pieces_steps > 0
    # draft steps 1.. ran device-prepared (run_uniform: no host preparation), the rollback invariant checked
    assert any(key.device_prep for key in eng.drafter.runner.graphs.graphs)


@pytest.mark.parametrize("method", ["draft", "tree", "eagle"])
def test_warmup_covers_every_replay_a_run_needs(method, tmp_path):
    """Engine.warmup captures every bucket a run then replays (prefill pieces, catch-ups, device-prepared draft
    steps, a fixed tree's level steps, chain and tree verify steps): nothing is captured while serving, where a
    capture stalls a round. Eager GraphRunners (CPU) record the same keys as CUDA graphs would; tests/test_gpu.py
    checks the draft case on CUDA."""
    from forerun.config import CacheConfig, SpecConfig
    from forerun.engine.llm import LLM
    from forerun.sampling_params import SamplingParams
    from tiny import random_eagle_head_dir, sharpen, tiny_tokenizer

    tok = tiny_tokenizer(97)

    def build():
        return ours_from_hf(sharpen(hf_model("llama"), 3.0)).model

    spec = {"draft": lambda: SpecConfig(method="draft", draft_model=(build(), tok), k=3),
            "tree": lambda: SpecConfig(method="draft", draft_model=(build(), tok), tree=(2, 2, 1)),
            "eagle": lambda: SpecConfig(method="eagle", eagle_head=random_eagle_head_dir(build(), tmp_path),
                                        eagle_tree=(2, 2, 4))}[method]()
    llm = LLM.from_model(build(), tok, spec=spec, max_num_seqs=4, device="cpu",
                         cache=CacheConfig(block_size=16, num_blocks=512))
    eng = llm.engine
    runners = {id(r): r for r in (eng.runner, getattr(eng.drafter, "runner", None)) if r is not None}.values()
    for r in runners:
        r.graphs = GraphRunner(r, batch_sizes=(1, 2, 4), max_q_len=eng.spec.max_draft_tokens + 1, use_graphs=False)
    eng.scheduler.draft_prefill = False  # as on CUDA graphs
    if method == "eagle":  # the head's drafting graphs as on CUDA (eager bodies on the CPU, keyed the same)
        eng.drafter._graphs_on = lambda: True
    assert eng.warmup() > 0
    before = {id(r): set(r.graphs.graphs) for r in runners}
    static_before = set(eng.drafter.static.graphs) if method == "eagle" else None
    if method == "eagle":
        assert any(key[-1] == "capped" for key in static_before)
    prompts = [[5, 9, 13, 22, 40, 7, 5, 9, 13], [70, 71, 72, 70, 71, 72, 70], list(range(3, 40))]
    llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 17, 9)])
    for r in runners:
        assert set(r.graphs.graphs) == before[id(r)], f"captured while serving: {set(r.graphs.graphs) - before[id(r)]}"
    if method == "eagle":  # (different max_tokens: trees capped per request near their ends, mid-batch)
        new = set(eng.drafter.static.graphs) - static_before
        assert not new, f"EAGLE graphs captured while serving: {new}"
        assert eng.drafter.static.replays > 0
    assert eng.runner.graphs.replays > 0


def test_capturing_holds_the_garbage_collector_off(monkeypatch):
    """runtime.cuda_graph.capturing: no Python garbage collection while a stream captures (a collection there can
    free another engine's CUDA graph, whose reset is not permitted during a capture and fails it: seen on the H200
    when GPU tests ran after other tests' engines); the collector's state is restored afterwards, also on an error."""
    import contextlib
    import gc

    import forerun.runtime.cuda_graph as cg

    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None):  # (no CUDA here: the capture itself is torch's)
        seen.append(gc.isenabled())
        yield

    monkeypatch.setattr(cg.torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with cg.capturing(None, None):
        seen.append(gc.isenabled())
    assert seen == [False, False] and gc.isenabled()
    try:
        with cg.capturing(None, None):
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    try:
        with cg.capturing(None, None):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
