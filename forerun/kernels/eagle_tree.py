"""The EAGLE dynamic tree's bookkeeping (greedy trees) in a few Triton launches instead of ~90 small torch kernels
per tree step: inside the drafting graph those small kernels cost more GPU time than the head's own step at
batch 1 (`benchmarks/eagle_gpu.py --profile`, session 27: ~370 of the ~480 kernels a drafting phase ran).

The tensors are those of `forerun.drafters.eagle.grow_tree` (R requests, M candidate slots, RM frontier rows):
score [R, M] float64 (cumulative log-probability), tok [R, M] int64 (target token ids), par [R, M] int64 (parent
slot), front [R, RM] (frontier row -> slot), fpar [R, RM] (frontier row -> its feature's bank row), anc [R, RM, RM]
uint8 (frontier row sees frontier row). Each kernel is the same arithmetic as grow_tree's torch code:

0. `tree_init` (one launch): the root's slot and bank row (nothing else needs an initial value).
1. `expand_topk` (two launches per tree step): each parent's K best children = top-K of log_softmax over the draft
   vocabulary (ties to the lower index; K distinct ids even when fewer entries are finite; a row with a NaN gets
   NaN scores, as torch gives), mapped to target ids, written into their level's slots with their cumulative
   scores. `_chunk_topk_kernel` (grid rows x vocabulary chunks) keeps each chunk's K best and its
   max / sum of exp; `_merge_expand_kernel` (grid rows) merges them and writes tok / score / par.
2. `select_step` (one launch per step): the K best nodes of the level (rank by pairwise comparison, as `_rank`),
   their frontier rows / feature rows / ancestor rows, then the head's inputs over frontier rows 0..n-1: token ids,
   RoPE positions, cache slots, the tree mask, seq lens and the feature rows to gather.
3. `final_select` (one launch): the n - 1 best candidates (optionally capped per request by depth and count), their
   tokens, parent columns, the packed host copy, and the verify step's ancestor mask and depths.

Under TRITON_INTERPRET=1 they run on the CPU (tests/test_eagle_tree_kernels.py compares them with the torch code).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048  # vocabulary entries per chunk program
_JB = 16  # comparison tile (columns) of the pairwise ranks
_BIG = tl.constexpr(2 ** 30)  # (a global a kernel reads must be a constexpr)


def fits(k: int, num_slots: int, rows_max: int, nodes: int) -> bool:
    """The shapes these kernels take (every program holds a level / all candidates in registers)."""
    return k <= 16 and k * k <= 256 and num_slots <= 1024 and rows_max <= 64 and nodes <= 128


@triton.jit
def _chunk_topk_kernel(Logits, PartVal, PartIdx, PartMax, PartSum, V, stride_l, nchunks,
                       K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    ok = idx < V
    x = tl.load(Logits + row.to(tl.int64) * stride_l + idx, mask=ok, other=float("-inf")).to(tl.float32)
    nan = tl.max((x != x).to(tl.int32), 0) > 0
    x = tl.where(x != x, float("-inf"), x)
    m = tl.max(x, 0)
    e = tl.where(ok, tl.exp(x - m), 0.0)
    s = tl.sum(e.to(tl.float64), 0)  # float64: the same sum whatever the order (rows that tie stay tied)
    s = tl.where(m == float("-inf"), 0.0, s)
    s = tl.where(nan, float("nan"), s)  # a NaN row's scores are NaN, as torch's log_softmax makes them
    kk = tl.arange(0, KP)
    vals = tl.full([KP], float("-inf"), tl.float32)
    ids = tl.full([KP], _BIG, tl.int32)
    free = ok  # not taken yet (a row with fewer than K finite entries still gives K distinct ids)
    for j in tl.static_range(K):
        v = tl.max(tl.where(free, x, float("-inf")), 0)
        i = tl.min(tl.where(free & (x == v), idx, _BIG), 0)
        vals = tl.where(kk == j, v, vals)
        ids = tl.where(kk == j, i, ids)
        free = free & (idx != i)
    out = (row * nchunks + c) * KP
    tl.store(PartVal + out + kk, vals)
    tl.store(PartIdx + out + kk, ids)
    tl.store(PartMax + row * nchunks + c, m)
    tl.store(PartSum + row * nchunks + c, s)


@triton.jit
def _merge_expand_kernel(PartVal, PartIdx, PartMax, PartSum, D2T, Parents, Score, Tok, Par,
                         nchunks, P, stride_p, lo, M, V,
                         K: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr):
    row = tl.program_id(0)  # = r * P + p: parent p of request r
    r = row // P
    p = row % P
    cc = tl.arange(0, CP)
    cm = cc < nchunks
    pm = tl.load(PartMax + row * nchunks + cc, mask=cm, other=float("-inf"))
    ps = tl.load(PartSum + row * nchunks + cc, mask=cm, other=0.0)
    mx = tl.max(pm, 0)
    tot = tl.sum(tl.where(ps != 0, ps * tl.exp((pm - mx).to(tl.float64)), 0.0), 0)  # (a NaN chunk: NaN)
    lsum = tl.log(tot).to(tl.float32)  # log_softmax = (x - max) - log(sum exp(x - max)), as torch forms it
    flat = tl.arange(0, CP * KP)
    fm = (flat // KP) < nchunks
    vals = tl.load(PartVal + row * nchunks * KP + flat, mask=fm, other=float("-inf"))
    ids = tl.load(PartIdx + row * nchunks * KP + flat, mask=fm, other=_BIG)
    parent = tl.load(Parents + r * stride_p + p)
    base = tl.load(Score + r * M + parent)
    free = ids < _BIG
    for j in tl.static_range(K):
        v = tl.max(tl.where(free, vals, float("-inf")), 0)
        i = tl.min(tl.where(free & (vals == v), ids, _BIG), 0)
        free = free & (ids != i)
        i = tl.maximum(tl.minimum(i, V - 1), 0)  # (V < K only: still a real token)
        dst = r * M + lo + p * K + j
        tl.store(Tok + dst, tl.load(D2T + i))
        tl.store(Score + dst, base + ((v - mx) - lsum).to(tl.float64))
        tl.store(Par + dst, parent)


def expand_topk(logits: torch.Tensor, k: int, d2t: torch.Tensor, parents: torch.Tensor, score: torch.Tensor,
                tok: torch.Tensor, par: torch.Tensor, lo: int) -> None:
    """grow_tree's greedy `expand`: logits [R P, V] (row r P + p: parent p of request r, parents [R, P] slots);
    children of rank j land in slot lo + p k + j: tok = d2t[id], score = score[parent] + log_softmax, par = parent."""
    n, v = logits.shape
    r_, p = parents.shape
    assert n == r_ * p and parents.stride(1) == 1
    logits = logits.contiguous()
    nchunks = triton.cdiv(v, _BLOCK)
    kp = triton.next_power_of_2(k)
    dev = logits.device
    pval = torch.empty(n, nchunks, kp, dtype=torch.float32, device=dev)
    pidx = torch.empty(n, nchunks, kp, dtype=torch.int32, device=dev)
    pmax = torch.empty(n, nchunks, dtype=torch.float32, device=dev)
    psum = torch.empty(n, nchunks, dtype=torch.float64, device=dev)
    _chunk_topk_kernel[(n, nchunks)](logits, pval, pidx, pmax, psum, v, logits.stride(0), nchunks,
                                     K=k, KP=kp, BLOCK=_BLOCK, num_warps=4)
    _merge_expand_kernel[(n,)](pval, pidx, pmax, psum, d2t, parents, score, tok, par,
                               nchunks, p, parents.stride(0), lo, score.shape[1], v,
                               K=k, KP=kp, CP=triton.next_power_of_2(nchunks), num_warps=1)


@triton.jit
def _sort_key(Row, Dep, dcap, idx, size, CAPPED: tl.constexpr):
    """-score of entries idx of a score row (+ 0.0: no -0.0); CAPPED: +inf where Dep[idx] (their depth) > dcap."""
    ok = idx < size
    key = -tl.load(Row + idx, mask=ok, other=0.0) + 0.0
    if CAPPED:
        key = tl.where(tl.load(Dep + idx, mask=ok, other=0) <= dcap, key, float("inf"))
    return key


@triton.jit
def _sort_places(Row, Dep, dcap, size, N: tl.constexpr, JB: tl.constexpr, CAPPED: tl.constexpr):
    """Entries 0 .. size - 1 of a score row -> [N] each one's place in a stable ascending sort of their keys
    (`_sort_key`; ties: the lower index first), by pairwise comparison in JB-wide tiles (grow_tree's `_rank`)."""
    i = tl.arange(0, N)
    key = _sort_key(Row, Dep, dcap, i, size, CAPPED)
    rank = tl.zeros([N], tl.int32)
    for j0 in range(0, N, JB):
        j = j0 + tl.arange(0, JB)
        kj = _sort_key(Row, Dep, dcap, j, size, CAPPED)
        less = (kj[None, :] < key[:, None]) | ((kj[None, :] == key[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((less & (j < size)[None, :]).to(tl.int32), 1)
    return rank


@triton.jit
def _slot_of(Tables, r, stride_t, pos, BS, mask):
    """Cache slots of sequence r's cache positions pos (its KV block table row r; `cache_slots` in torch)."""
    return tl.load(Tables + r * stride_t + pos // BS, mask=mask, other=0) * BS + pos % BS


@triton.jit
def _select_step_kernel(Score, Tok, Front, Fpar, Anc, Ctx, Tables,
                        Ids, Pos, Slots, TMask, SeqLens, FIdx,
                        M, RM, lo, size, t, n, stride_t, BS,
                        K: tl.constexpr, SP: tl.constexpr, JB: tl.constexpr, RMP: tl.constexpr,
                        NP: tl.constexpr):
    r = tl.program_id(0)
    i = tl.arange(0, SP)
    iv = i < size
    rank = _sort_places(Score + r * M + lo, Score, 0, size, SP, JB, False)
    chosen = iv & (rank < K)
    pos = tl.cumsum(chosen.to(tl.int32), 0) - 1
    chosen = chosen & (pos < K)
    row = (t - 1) * K + pos  # this step's frontier rows, by ascending level position
    ppos = i // K  # the parent's frontier position at step t - 1
    tl.store(Front + r * RM + row, lo + i, mask=chosen)
    tl.store(Fpar + r * RM + row, tl.where(t == 1, 0, 1 + (t - 2) * K + ppos), mask=chosen)
    cols = tl.arange(0, RMP)
    cv = cols < RM
    src = (t - 2) * K + ppos
    a = tl.load(Anc + r * RM * RM + src[:, None] * RM + cols[None, :],
                mask=(chosen & (src >= 0))[:, None] & cv[None, :], other=0)  # step 1: no parent row
    a = tl.where(cols[None, :] == row[:, None], 1, a).to(tl.uint8)
    tl.store(Anc + r * RM * RM + row[:, None] * RM + cols[None, :], a, mask=chosen[:, None] & cv[None, :])
    tl.debug_barrier()
    # the head's inputs over frontier rows 0 .. n-1 (n = t K)
    q = tl.arange(0, NP)
    qv = q < n
    fr = tl.load(Front + r * RM + q, mask=qv, other=0)
    tl.store(Ids + r * n + q, tl.load(Tok + r * M + fr, mask=qv, other=0), mask=qv)
    # frontier row q: RoPE position ctx - 1 + its depth (q // K + 1), cache slot the scratch row ctx + q
    c0 = tl.load(Ctx + r)
    tl.store(Pos + r * n + q, c0 + q // K, mask=qv)
    tl.store(Slots + r * n + q, _slot_of(Tables, r, stride_t, c0 + q, BS, qv), mask=qv)
    f = tl.load(Fpar + r * RM + q, mask=qv, other=0)
    tl.store(FIdx + r * n + q, r * (1 + RM) + f, mask=qv)
    qm = qv[:, None] & qv[None, :]
    am = tl.load(Anc + r * RM * RM + q[:, None] * RM + q[None, :], mask=qm, other=0)
    tl.store(TMask + (r * n + q[:, None]) * n + q[None, :], am, mask=qm)
    tl.store(SeqLens + r, c0 + n)


def select_step(score, tok, front, fpar, anc, ctx, tables, block_size: int, lo: int, size: int, t: int, k: int):
    """grow_tree's step t selection and the head's inputs. anc: uint8 [R, RM, RM]; front / fpar / anc need no
    initial values (every row a step reads was written by an earlier step). ctx [R]: the committed lengths; tables
    [R, W] the KV block tables (frontier row q sits at RoPE position ctx - 1 + depth, cache position ctx + q).
    Returns ids [R n], positions [R n], slot_mapping [R n], tree_mask [R n, n] (bool), seq_lens [R], and
    feature rows [R n] of bank.view(R (1 + RM), H)."""
    r_, m_ = score.shape
    rm = front.shape[1]
    n = t * k
    assert all(x.is_contiguous() for x in (score, tok, front, fpar, anc, ctx)) and tables.stride(1) == 1
    dev = score.device
    ids = torch.empty(r_ * n, dtype=torch.long, device=dev)
    pos = torch.empty(r_ * n, dtype=torch.long, device=dev)
    slots = torch.empty(r_ * n, dtype=torch.long, device=dev)
    tmask = torch.empty(r_ * n, n, dtype=torch.uint8, device=dev)
    seq_lens = torch.empty(r_, dtype=torch.long, device=dev)
    fidx = torch.empty(r_ * n, dtype=torch.long, device=dev)
    sp = max(triton.next_power_of_2(size), _JB)
    _select_step_kernel[(r_,)](score, tok, front, fpar, anc, ctx, tables,
                               ids, pos, slots, tmask, seq_lens, fidx,
                               m_, rm, lo, size, t, n, tables.stride(0), block_size,
                               K=k, SP=sp, JB=_JB, RMP=triton.next_power_of_2(rm),
                               NP=triton.next_power_of_2(n), num_warps=4)
    return ids, pos, slots, tmask.view(torch.bool), seq_lens, fidx


@triton.jit
def _tree_init_kernel(Tok, Score, Par, Bank, Root, M, bank_stride, H, BH: tl.constexpr):
    r = tl.program_id(0)
    o = tl.arange(0, 1)
    tl.store(Tok + r * M + o, tl.zeros([1], tl.int64))
    tl.store(Score + r * M + o, tl.zeros([1], tl.float64))
    tl.store(Par + r * M + o, tl.full([1], -1, tl.int64))
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        tl.store(Bank + r.to(tl.int64) * bank_stride + h, tl.load(Root + r.to(tl.int64) * H + h, mask=h < H), mask=h < H)


def tree_init(tok, score, par, bank, root_out) -> None:
    """A tree's state before its first expansion, in one launch: the root's slot (token 0, score 0, parent -1) and
    its output in bank row 0. Nothing else needs a value: every other slot is written by its level's expansion,
    every other bank row by its step, before anything reads it."""
    r_, m_ = score.shape
    hid = root_out.shape[1]
    assert all(x.is_contiguous() for x in (tok, score, par, bank, root_out)) and bank.shape[0] == r_
    _tree_init_kernel[(r_,)](tok, score, par, bank, root_out, m_, bank.stride(0), hid,
                             BH=min(1024, triton.next_power_of_2(hid)), num_warps=4)


@triton.jit
def _final_kernel(Score, Tok, Par, SlotDepth, Dcap, Ncap,
                  Nodes, Tokens, Parents, Packed, Mask, Depth,
                  M, ng, hops, width,
                  CAPPED: tl.constexpr, MP: tl.constexpr, JB: tl.constexpr, NP: tl.constexpr):
    r = tl.program_id(0)
    i = tl.arange(0, MP)  # candidate i is slot i + 1
    iv = i < M - 1
    if CAPPED:  # candidates deeper than the cap sort last
        dcap = tl.load(Dcap + r)
        want = tl.minimum(tl.load(Ncap + r), ng) - 1
    else:
        dcap = 0
        want = ng - 1
    rank = _sort_places(Score + r * M + 1, SlotDepth + 1, dcap, M - 1, MP, JB, CAPPED)
    chosen = iv & (rank < want)
    pos = tl.cumsum(chosen.to(tl.int32), 0) - 1
    chosen = chosen & (pos < want) & (pos < ng - 1)  # (want <= ng - 1: a guard, the row's columns only)
    c = tl.arange(0, NP)
    cv = c < ng
    # columns past `want` hold no node (id M); column 0 is the root
    tl.store(Nodes + r * ng + c, tl.where(c == 0, 0, M), mask=cv)
    tl.debug_barrier()
    tl.store(Nodes + r * ng + 1 + pos, (i + 1).to(tl.int64), mask=chosen)
    tl.debug_barrier()
    nodes = tl.load(Nodes + r * ng + c, mask=cv, other=M)
    nodes_c = tl.minimum(nodes, M - 1)
    tokens = tl.load(Tok + r * M + nodes_c, mask=cv, other=0)
    pnode = tl.load(Par + r * M + nodes_c, mask=cv, other=-1)
    match = (nodes[None, :] == pnode[:, None]) & cv[None, :]  # [column, column']: column' holds my parent
    found = tl.sum(match.to(tl.int32), 1) > 0
    pcol = tl.sum(tl.where(match, c[None, :], 0), 1)
    parents = tl.where((pnode >= 0) & found & (c > 0), pcol, -1).to(tl.int64)
    tl.store(Tokens + r * ng + c, tokens, mask=cv)
    tl.store(Parents + r * ng + c, parents, mask=cv)
    kscore = tl.load(Score + r * M + nodes_c, mask=cv, other=0.0)
    pk = Packed + r * width
    tl.store(pk + c, tokens.to(tl.float64), mask=cv)
    tl.store(pk + ng + c, parents.to(tl.float64), mask=cv)
    tl.store(pk + 2 * ng + c, kscore, mask=cv)
    for s0 in tl.static_range(0, MP + 1, MP):  # every slot's score and parent: M <= MP + 1 entries
        s = s0 + tl.arange(0, MP)
        sv = s < M
        tl.store(pk + 3 * ng + s, tl.load(Score + r * M + s, mask=sv, other=0.0), mask=sv)
        tl.store(pk + 3 * ng + M + s, tl.load(Par + r * M + s, mask=sv, other=0).to(tl.float64), mask=sv)
    tl.debug_barrier()
    # the verify step's ancestor-or-self mask and depths, by `hops` parent hops (as tree_mask_and_depth)
    mask = (c[:, None] == c[None, :])
    depth = tl.zeros([NP], tl.int64)
    cur = c.to(tl.int64)
    for _ in range(hops):
        nxt = tl.load(Parents + r * ng + tl.maximum(cur, 0), mask=cv & (cur >= 0), other=-1)
        cur = tl.where(cur >= 0, nxt, cur)
        mask = mask | ((cur[:, None] == c[None, :]) & (cur >= 0)[:, None])
        depth += (cur >= 0).to(tl.int64)
    mm = cv[:, None] & cv[None, :]
    tl.store(Mask + (r * ng + c[:, None]) * ng + c[None, :], mask.to(tl.uint8), mask=mm)
    tl.store(Depth + r * ng + c, depth, mask=cv)


def final_select(score, tok, par, slot_depth, ng: int, hops: int, caps=None) -> dict[str, torch.Tensor]:
    """grow_tree's final selection (greedy) plus tree_mask_and_depth(parents, hops): nodes, tokens, parents,
    packed, mask (bool [R, n, n]), depth [R, n]."""
    r_, m_ = score.shape
    dev = score.device
    width = 3 * ng + 2 * m_
    out = dict(nodes=torch.empty(r_, ng, dtype=torch.long, device=dev),
               tokens=torch.empty(r_, ng, dtype=torch.long, device=dev),
               parents=torch.empty(r_, ng, dtype=torch.long, device=dev),
               packed=torch.empty(r_, width, dtype=torch.float64, device=dev),
               mask=torch.empty(r_, ng, ng, dtype=torch.uint8, device=dev),
               depth=torch.empty(r_, ng, dtype=torch.long, device=dev))
    dcap, ncap = caps if caps is not None else (slot_depth, slot_depth)  # unread without caps
    assert all(x.is_contiguous() for x in (score, tok, par, slot_depth, dcap, ncap))
    mp = max(triton.next_power_of_2(m_ - 1), _JB)
    _final_kernel[(r_,)](score, tok, par, slot_depth, dcap, ncap,
                         out["nodes"], out["tokens"], out["parents"], out["packed"], out["mask"], out["depth"],
                         m_, ng, hops, width,
                         CAPPED=caps is not None, MP=mp, JB=_JB, NP=triton.next_power_of_2(ng), num_warps=4)
    out["mask"] = out["mask"].view(torch.bool)
    out["probs"] = None
    return out


@triton.jit
def _extend_rows_kernel(Lo, Nlast, Tables, Pos, Slots, SeqLens, Rows, stride_t, BS, QE, QP: tl.constexpr):
    r = tl.program_id(0)
    q = tl.arange(0, QP)
    qv = q < QE
    lo = tl.load(Lo + r)
    pos = lo + q
    tl.store(Pos + r * QE + q, pos, mask=qv)
    tl.store(Slots + r * QE + q, _slot_of(Tables, r, stride_t, pos, BS, qv), mask=qv)
    tl.store(SeqLens + r, lo + QE)
    tl.store(Rows + r, r * QE + tl.load(Nlast + r))


def extend_rows(lo: torch.Tensor, nlast: torch.Tensor, tables: torch.Tensor, block_size: int, qe: int):
    """The draft extend's inputs in one launch (in place of ~10 small torch kernels): b requests feeding qe rows
    from position lo [b] each (KV block tables [b, W]) -> positions [b qe], cache slots [b qe], seq lens [b] (lo +
    qe) and the rows whose outputs are wanted [b] (row nlast of each request's qe)."""
    b = lo.shape[0]
    assert lo.is_contiguous() and nlast.is_contiguous() and tables.stride(1) == 1
    dev = lo.device
    pos = torch.empty(b * qe, dtype=torch.long, device=dev)
    slots = torch.empty(b * qe, dtype=torch.long, device=dev)
    seq_lens = torch.empty(b, dtype=torch.long, device=dev)
    rows = torch.empty(b, dtype=torch.long, device=dev)
    _extend_rows_kernel[(b,)](lo, nlast, tables, pos, slots, seq_lens, rows, tables.stride(0), block_size, qe,
                              QP=triton.next_power_of_2(qe), num_warps=1)
    return pos, slots, seq_lens, rows
