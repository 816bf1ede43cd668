"""forerun/kernels/eagle_tree.py (the greedy dynamic tree's bookkeeping in Triton) against the torch code of
forerun.drafters.eagle.grow_tree, on the CPU under Triton's interpreter or on CUDA.

Whole trees through the kernels are compared with the host-built oracle in tests/test_eagle.py
(test_fused_tree_kernels_*); here each kernel meets its torch counterpart on inputs made to tie: scores drawn
from a few values (every tie broken by the lower index), logits with equal maxima across vocabulary chunks."""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
from forerun.drafters.eagle import (TreeLayout, _first, _frontier_rows, _greedy_kept, _kept_tree,  # noqa: E402
                                    _rank, _tree_buffers, tree_mask_and_depth)
from forerun.kernels.eagle_tree import (expand_topk, extend_rows, final_select, select_step,  # noqa: E402
                                        tree_init)

DEV = torch.device("cuda" if CUDA else "cpu")


def _expand_ref(logits, k, d2t, parents, score, tok, par, lo):
    """grow_tree's torch expand, its topk as a stable sort: torch.topk leaves the order of equal logits open (bf16
    rows have many), the kernels put the lower index first."""
    r_, p = parents.shape
    lp, idx = logits.float().log_softmax(-1).sort(dim=-1, descending=True, stable=True)
    ids, lp = d2t[idx[:, :k]], lp[:, :k]
    blk = slice(lo, lo + p * k)
    tok[:, blk] = ids.reshape(r_, p * k)
    score[:, blk] = (score.gather(1, parents)[:, :, None] + lp.double().view(r_, p, k)).reshape(r_, p * k)
    par[:, blk] = parents[:, :, None].expand(r_, p, k).reshape(r_, p * k)


@pytest.mark.parametrize("r_,p,v,k", [(3, 2, 50, 3), (2, 3, 5000, 4), (1, 4, 4096, 1), (2, 1, 9000, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_topk_is_log_softmax_topk(r_, p, v, k, dtype):
    """Children of every parent: the top-k of log_softmax (over one or several 2048-entry chunks), mapped to target
    ids, cumulative scores, parents (read from a strided view, as grow_tree passes its frontier rows)."""
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("the interpreter emulates bfloat16 imprecisely")
    g = torch.Generator().manual_seed(r_ * 100 + v + k)
    m = 1 + p * k + 5
    logits = (torch.randn(r_ * p, v, generator=g) * 3).to(dtype).to(DEV)
    d2t = torch.randperm(3 * v, generator=g)[:v].to(DEV)
    front = torch.randint(0, 4, (r_, p + 3), generator=g).to(DEV)  # parents (slots below lo = 4): columns 1 .. p
    base = torch.randn(r_, m, generator=g, dtype=torch.float64).to(DEV)
    outs = []
    for fn in (_expand_ref, expand_topk):
        score, tok, par = base.clone(), torch.zeros(r_, m, dtype=torch.long, device=DEV), \
            torch.full((r_, m), -1, dtype=torch.long, device=DEV)
        fn(logits, k, d2t, front[:, 1: 1 + p], score, tok, par, 4)
        outs.append((score, tok, par))
    (s0, t0, p0), (s1, t1, p1) = outs
    assert torch.equal(t1, t0) and torch.equal(p1, p0)
    torch.testing.assert_close(s1, s0, rtol=0, atol=2e-6)


def test_expand_topk_ties_go_to_the_lower_index():
    """Equal logits inside a chunk and across chunks (2048 entries each): the lower draft index first."""
    v, k = 6000, 4
    logits = torch.full((2, v), -5.0)
    logits[0, [5, 2047, 2048, 4100]] = 1.0  # four equal maxima in three chunks
    logits[1] = 0.0  # every entry ties
    d2t = torch.arange(v) + 10
    score = torch.zeros(1, 1 + 2 * k, dtype=torch.float64)
    tok = torch.zeros(1, 1 + 2 * k, dtype=torch.long)
    par = torch.full((1, 1 + 2 * k), -1, dtype=torch.long)
    expand_topk(logits.to(DEV), k, d2t.to(DEV), torch.zeros(1, 2, dtype=torch.long, device=DEV),
                score := score.to(DEV), tok := tok.to(DEV), par := par.to(DEV), 1)
    assert tok[0, 1:].tolist() == [15, 2057, 2058, 4110, 10, 11, 12, 13]
    ref = logits.log_softmax(-1)
    # float32 log-softmax of ~-8.7: one ulp is ~1e-6, and torch's vectorized log_softmax rounds differently by CPU
    # (AVX-512 vs AVX2: 3.1e-6 apart on an AMD Zen 3), so a few ulps relative
    torch.testing.assert_close(score[0, 1:].cpu(), torch.cat([ref[0, [5, 2047, 2048, 4100]], ref[1, :4]]).double(),
                               rtol=1e-6, atol=1e-6)


def test_expand_topk_degenerate_rows():
    """A row with fewer finite logits than K still gives K distinct children (the finite ones first, then the lowest
    ids; their scores -inf); a row holding a NaN gets NaN scores (as torch's log_softmax gives)."""
    v, k = 5000, 4
    logits = torch.full((2, v), float("-inf"))
    logits[0, [4097, 7]] = torch.tensor([1.0, 2.0])
    logits[1] = torch.randn(v)
    logits[1, 3000] = float("nan")
    score = torch.zeros(1, 1 + 2 * k, dtype=torch.float64, device=DEV)
    tok = torch.zeros(1, 1 + 2 * k, dtype=torch.long, device=DEV)
    par = torch.full((1, 1 + 2 * k), -1, dtype=torch.long, device=DEV)
    expand_topk(logits.to(DEV), k, torch.arange(v, device=DEV), torch.zeros(1, 2, dtype=torch.long, device=DEV),
                score, tok, par, 1)
    assert tok[0, 1: 1 + k].tolist() == [7, 4097, 0, 1]
    assert score[0, 3: 1 + k].tolist() == [float("-inf")] * 2 and score[0, 1: 3].isfinite().all()
    assert score[0, 1 + k:].isnan().all()


def _tied_scores(g, r_, m_):
    """Scores from a handful of values (many exact ties), root 0."""
    s = -torch.randint(0, 4, (r_, m_), generator=g).double() * 0.5
    s[:, 0] = 0.0
    return s


@pytest.mark.parametrize("k,steps,r_", [(3, 4, 2), (4, 4, 3), (1, 5, 2), (8, 3, 1)])
def test_select_step_is_grow_trees_selection(k, steps, r_):
    """Every step of a tree: the level's K best (ties: lower position), frontier / feature / ancestor rows, and the
    head's inputs (ids, positions, slots, tree mask, seq lens, feature rows) as grow_tree's torch code makes them."""
    lay = TreeLayout.get(k, steps, 10)
    g = torch.Generator().manual_seed(k * 10 + steps)
    m_, rm = lay.num_slots, max((steps - 1) * k, 1)
    score = _tied_scores(g, r_, m_).to(DEV)
    tok = torch.randint(0, 1000, (r_, m_), generator=g).to(DEV)
    ctx = torch.randint(5, 50, (r_,), generator=g).to(DEV)
    bs = 4
    tables = torch.randperm(200, generator=g)[: r_ * 30].view(r_, 30).to(DEV)  # 30 blocks of 4: room for ctx + rm
    pos_all, slots_all = _frontier_rows(lay, ctx, tables, bs)
    ar = torch.arange(max(m_, rm) + 2, device=DEV)
    eye = torch.eye(rm, dtype=torch.bool, device=DEV)
    front, fpar, anc = [torch.zeros(r_, rm, dtype=torch.long, device=DEV) for _ in range(2)] + \
        [torch.zeros(r_, rm, rm, dtype=torch.bool, device=DEV)]
    # the kernel's state starts as garbage (the fused path leaves it empty): nothing unwritten may be read
    state = [torch.randint(-9, 9, (r_, rm), generator=g).to(DEV) for _ in range(2)]
    anc8 = torch.randint(0, 2, (r_, rm, rm), generator=g).to(torch.uint8).to(DEV)
    for t in range(1, steps):
        lo, size, n = lay.lo[t], lay.size[t], t * k
        # grow_tree's torch code
        key = -score[:, lo: lo + size] + 0.0
        tri = ar[None, :size] < ar[:size, None]
        sel = _first(_rank(key, tri[None]) < k, k)
        rows = slice((t - 1) * k, t * k)
        front[:, rows] = lo + sel
        if t == 1:
            fpar[:, rows] = 0
        else:
            ppos = sel // k
            fpar[:, rows] = 1 + (t - 2) * k + ppos
            anc[:, rows] = anc.gather(1, ((t - 2) * k + ppos)[:, :, None].expand(r_, k, rm))
        anc[:, rows] |= eye[rows]
        want = dict(ids=tok.gather(1, front[:, :n]).reshape(-1), positions=pos_all[:, :n].reshape(-1),
                    slots=slots_all[:, :n].reshape(-1), tmask=anc[:, :n, :n].reshape(r_ * n, n), seq_lens=ctx + n,
                    fidx=(torch.arange(r_, device=DEV)[:, None] * (1 + rm) + fpar[:, :n]).reshape(-1))
        got = dict(zip(want, select_step(score, tok, state[0], state[1], anc8, ctx, tables, bs,
                                         lo, size, t, k)))
        for name in want:
            assert torch.equal(got[name], want[name]), (t, name, got[name], want[name])
        done = slice(0, t * k)  # the rows written so far
        assert torch.equal(state[0][:, done], front[:, done]) and torch.equal(state[1][:, done], fpar[:, done])
        assert torch.equal(anc8[:, done].bool(), anc[:, done])


@pytest.mark.parametrize("r_,hid", [(1, 64), (3, 1500), (2, 4096)])
def test_tree_init_sets_the_root_slot_and_bank_row(r_, hid):
    """The fused tree's state starts empty: tree_init writes the root's slot (token 0, score 0, parent -1) and its
    output into bank row 0, and nothing else (the other slots and rows keep whatever they held)."""
    lay = TreeLayout.get(3, 3, 8)
    g = torch.Generator().manual_seed(hid)
    root_out = torch.randn(r_, hid, generator=g).to(DEV)
    tok, score, par, bank, anc, front, fpar = _tree_buffers(lay, root_out, torch.uint8, init=False)
    for x in (tok, par):
        x.copy_(torch.randint(-5, 5, x.shape, generator=g))
    score.copy_(torch.randn(score.shape, generator=g, dtype=torch.float64))
    bank.copy_(torch.randn(bank.shape, generator=g))
    before = [x.clone() for x in (tok, score, par, bank)]
    tree_init(tok, score, par, bank, root_out)
    ref = _tree_buffers(lay, root_out, torch.uint8)  # the torch path's zero-initialised state
    for got, old, want in zip((tok, score, par, bank), before, ref):
        assert torch.equal(got[:, 0], want[:, 0])
        assert torch.equal(got[:, 1:], old[:, 1:])


def _final_ref(score, tok, par, lay, caps, hops):
    """grow_tree's torch final selection (its own functions) and the verify mask / depths."""
    nodes = _greedy_kept(score, lay, lay.consts(score.device), caps)
    _, tokens, parents, packed = _kept_tree(nodes, tok, par, score)
    mask, depth = tree_mask_and_depth(parents, hops)
    return dict(nodes=nodes, tokens=tokens, parents=parents, packed=packed, mask=mask, depth=depth)


@pytest.mark.parametrize("k,steps,nodes,r_", [(4, 4, 16, 3), (3, 3, 8, 2), (1, 4, 5, 2), (4, 2, 30, 2),
                                              (8, 4, 64, 1)])
@pytest.mark.parametrize("capped", [False, True])
def test_final_select_is_grow_trees_selection(k, steps, nodes, r_, capped):
    """The n - 1 best candidates (ties: lower id; capped: per-request depth and node caps, columns past the cap
    hold no node), their tokens, parent columns, the packed host copy, and the verify mask / depths."""
    lay = TreeLayout.get(k, steps, nodes)
    g = torch.Generator().manual_seed(k * 100 + nodes + capped)
    m_ = lay.num_slots
    # parents in the layout: level d's slots hang under level d - 1's (a random frontier of it)
    par = torch.full((r_, m_), -1, dtype=torch.long)
    for d in range(1, steps + 1):
        lo, size = lay.lo[d], lay.size[d]
        plo, psize = lay.lo[d - 1], lay.size[d - 1]
        par[:, lo: lo + size] = plo + torch.randint(0, psize, (r_, size), generator=g)
    score = _tied_scores(g, r_, m_)
    # children never outscore their parents (as cumulative log-probabilities): the kept set is ancestor-closed
    for j in range(1, m_):
        score[:, j] = torch.minimum(score[:, j], score.gather(1, par[:, j: j + 1].clamp_min(0))[:, 0])
    tok = torch.randint(0, 1000, (r_, m_), generator=g)
    caps = None
    if capped:
        caps = (torch.randint(1, steps + 1, (r_,), generator=g), torch.randint(1, nodes + 3, (r_,), generator=g))
    to = lambda x: x.to(DEV)  # noqa: E731
    score, tok, par = map(to, (score, tok, par))
    caps = tuple(map(to, caps)) if caps else None
    want = _final_ref(score, tok, par, lay, caps, steps)
    got = final_select(score, tok, par, torch.tensor(lay.depth, device=DEV), lay.greedy_nodes, steps, caps)
    for name in want:
        assert torch.equal(got[name], want[name]), (name, got[name], want[name])


def test_drawn_verdict_kernel_is_the_benchs_torch_draw():
    """benchmarks/eagle_gpu.py's synthetic verdict: the kernel (drawn_tree_verdict_packed, CUDA's) and the torch ops
    (drawn_path) take the same path for the same caught ranks, the real verdict's final token after it and its
    flag kept; random trees, ranks caught 0..3 or none (4), trees accepting 0 to several drafts."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from eagle_gpu import drawn_path

    from forerun.kernels.tree_verdict import drawn_tree_verdict_packed
    from forerun.verify.tree import greedy_tree_verdict

    g = torch.Generator().manual_seed(3)
    acc_seen = []
    for b, n, levels in [(6, 8, 3), (9, 16, 5), (2, 3, 2)]:
        par = torch.full((b, n), -1, dtype=torch.long)
        for i in range(1, n):
            par[:, i] = (torch.rand(b, generator=g) * min(i, 3)).long()  # wide near the root: sibling ranks 0..
        mask, depth = tree_mask_and_depth(par, n)
        tok = torch.randint(0, 50, (b, n), generator=g)
        want = torch.multinomial(torch.tensor([0.45, 0.15, 0.1, 0.05, 0.25]), b * (levels + 1), replacement=True,
                                 generator=g).view(b, levels + 1)
        logits = torch.randn(b * n, 50, generator=g)
        logits[1, 0] = float("nan")  # request 0's flag set: kept
        dev = [x.to(DEV) for x in (logits, tok, par, mask, depth, want)]
        real = greedy_tree_verdict(dev[0], dev[1], dev[2], dev[3], dev[4], kernel=False).packed
        got = drawn_tree_verdict_packed(real, dev[5], dev[1], dev[2], dev[3], dev[4]).cpu()
        acc, nodes = drawn_path(want, par, mask, depth)
        out = torch.where(nodes[:, 1:] >= 0, tok.gather(1, nodes[:, 1:].clamp(min=0)), -1)
        out = torch.cat([out, torch.full_like(out[:, :1], -1)], 1)
        out.scatter_(1, acc[:, None], real[:, 1 + n: 2 + n].cpu().clamp(min=0))
        assert got[:, 0].tolist() == acc.tolist()
        assert torch.equal(got[:, 1: 1 + n], nodes) and torch.equal(got[:, 1 + n: 1 + 2 * n], out)
        assert got[:, -1].tolist() == real[:, -1].tolist() and got[0, -1] != 0
        acc_seen += acc.tolist()
    assert min(acc_seen) == 0 and max(acc_seen) >= 2


def test_bench_keeps_the_kernel_drawn_verdict():
    """benchmarks/eagle_gpu.py's SyntheticTreeSampler with the path kernel (CUDA's): tree_finish returns the path
    drawn on the device (the round moved the accepted keys and queued the next steps from it), not a second draw,
    and the bonus token after it is the real verdict's."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from eagle_gpu import SyntheticTreeSampler

    from forerun.drafters.base import TreeProposal
    from forerun.request import Request
    from forerun.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(5)
    b, n, v = 4, 8, 30
    par = torch.full((b, n), -1, dtype=torch.long)
    for i in range(1, n):
        par[:, i] = (torch.rand(b, generator=g) * min(i, 3)).long()
    mask, depth = tree_mask_and_depth(par, n)
    tok = torch.randint(0, v, (b, n), generator=g)
    logits = torch.randn(b * n, v, generator=g)
    reqs = [Request(i, None, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=64), torch.Generator(),
                    frozenset()) for i in range(b)]
    prop = TreeProposal(tok.tolist(), par.tolist(), [None] * b)
    seen = []
    for round_ in range(6):
        smp = SyntheticTreeSampler([0.6, 0.2, 0.1], DEV, max_depth=4, seed=round_)
        smp.kernel = True
        dev = [x.to(DEV) for x in (logits, tok, par, mask, depth)]
        pending = smp.tree_launch(dev[0], reqs, [n] * b, [i * n for i in range(b)], dev[1].reshape(-1),
                                  dev[2].reshape(-1), None, None, layout=(dev[3], dev[4]))
        drawn = pending.res.packed.cpu()
        verdict, paths = smp.tree_finish(pending, prop)
        root_token = logits.view(b, n, v)[:, 0].argmax(-1)
        for i in range(b):
            a = int(drawn[i, 0])
            assert verdict.num_accepted[i] == a and paths[i] == drawn[i, 1: 2 + a].tolist()
            assert verdict.emitted[i] == [tok[i, j].item() for j in paths[i][1:]] + [root_token[i].item()]
            seen.append(a)
    assert min(seen) == 0 and max(seen) >= 2


@pytest.mark.parametrize("b,qe,bs", [(1, 1, 16), (3, 5, 4), (5, 7, 16)])
def test_extend_rows_is_the_extend_bodys_torch_code(b, qe, bs):
    """The draft extend's positions, cache slots, seq lens and wanted rows (one launch) as _StaticDrafting's torch
    code makes them: rows crossing KV blocks, each request's own table."""
    g = torch.Generator().manual_seed(b * 10 + qe)
    lo = torch.randint(0, 40, (b,), generator=g).to(DEV)
    nlast = torch.randint(0, qe, (b,), generator=g).to(DEV)
    tables = torch.randperm(500, generator=g)[: b * 20].view(b, 20).to(DEV)
    pos = (lo[:, None] + torch.arange(qe, device=DEV)[None, :])
    want = (pos.reshape(-1), (tables.gather(1, pos // bs) * bs + pos % bs).reshape(-1), lo + qe,
            torch.arange(b, device=DEV) * qe + nlast)
    got = extend_rows(lo, nlast, tables, bs, qe)
    for name, x, y in zip(("positions", "slots", "seq_lens", "rows"), got, want):
        assert torch.equal(x, y), (name, x, y)
