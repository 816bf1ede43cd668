"""The greedy tree verdict (`forerun.verify.tree.greedy_tree_verdict`) in two Triton launches instead of ~25 torch
ops: on a fast GPU the round's host work (each op's launch) had become longer than its GPU work at batch 1.

1. `_argmax_chunk_kernel`, grid (rows, vocabulary chunks): each chunk's maximum and the first index reaching it
   (NaN-free; a chunk holding a NaN reports NaN).
2. `_path_kernel`, grid (requests,): the target's argmax after each node (the first chunk reaching the row's
   maximum: the lowest index, as torch.argmax), the first child of each node that matches it, the deepest node whose
   ancestors all matched, its path by depth, the tokens emitted, and a per-request flag for a row whose maximum is
   not finite (NaN, +Inf, or nothing but -inf).

Output: one int64 tensor [R, 2 + 2 n] = what the round copies to the host: accepted drafts, path nodes by depth
(-1 past the path), output tokens (-1 past the final token), the flag. With SYNTH (a benchmark's drawn verdict,
benchmarks/eagle_gpu.py) the path is instead the nodes whose sibling rank equals the rank drawn for their depth,
and the final token the real verdict's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096
_BIG = tl.constexpr(2 ** 30)


@triton.jit
def _argmax_chunk_kernel(Logits, PMax, PIdx, V, stride_l, nchunks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(Logits + row.to(tl.int64) * stride_l + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    nan = x != x
    x = tl.where(nan, float("-inf"), x)
    m = tl.max(x, 0)
    i = tl.min(tl.where(x == m, idx, _BIG), 0)
    m = tl.where(tl.max(nan.to(tl.int32), 0) > 0, float("nan"), m)
    tl.store(PMax + row * nchunks + c, m)
    tl.store(PIdx + row * nchunks + c, i)


@triton.jit
def _path_kernel(PMax, PIdx, Tokens, Parents, Anc, Depth, Want, Real, Out,
                 n, nchunks, levels, V,
                 NP: tl.constexpr, CP: tl.constexpr, SYNTH: tl.constexpr):
    r = tl.program_id(0)
    i = tl.arange(0, NP)  # node (rows of the [node, node'] matrices)
    j = tl.arange(0, NP)  # node' (columns)
    iv = i < n
    jv = j < n
    tok = tl.load(Tokens + r * n + i, mask=iv, other=-1)
    par = tl.load(Parents + r * n + i, mask=iv, other=-1)
    dep = tl.load(Depth + r * n + i, mask=iv, other=0)
    anc = tl.load(Anc + (r * n + i[:, None]) * n + j[None, :], mask=iv[:, None] & jv[None, :], other=0) != 0
    child = par >= 0
    if SYNTH:
        sib = (par[:, None] == par[None, :]) & (j[None, :] < i[:, None]) & jv[None, :]
        rank = tl.sum(sib.to(tl.int32), 1)
        want = tl.load(Want + r * (levels + 1) + tl.minimum(dep, levels), mask=iv, other=-1)
        ok = ((rank == want) & (dep <= levels)) | (i == 0)
        bad = tl.load(Real + r * (2 + 2 * n) + 1 + 2 * n)
        am = tok  # (unused)
    else:
        c = tl.arange(0, CP)
        pm_mask = iv[:, None] & (c < nchunks)[None, :]
        pm = tl.load(PMax + (r * n + i[:, None]) * nchunks + c[None, :], mask=pm_mask, other=float("-inf"))
        pi = tl.load(PIdx + (r * n + i[:, None]) * nchunks + c[None, :], mask=pm_mask, other=_BIG)
        isnan = pm != pm
        pm = tl.where(isnan, float("-inf"), pm)
        rm = tl.max(pm, 1)  # [NP] the row's maximum
        am = tl.min(tl.where(pm == rm[:, None], pi, _BIG), 1)  # chunks in order: the lowest index reaching it
        am = tl.maximum(tl.minimum(am, V - 1), 0).to(tl.int64)
        rowbad = (tl.max(isnan.to(tl.int32), 1) > 0) | (rm == float("inf")) | (rm == float("-inf"))
        bad = tl.max(tl.where(iv & rowbad, 1, 0), 0).to(tl.int64)
        am_par = tl.sum(tl.where(j[None, :] == par[:, None], am[None, :], 0), 1)  # argmax after my parent
        match = child & (tok == am_par) & iv
        earlier = (par[:, None] == par[None, :]) & (j[None, :] < i[:, None])
        picked = match & (tl.max((earlier & match[None, :]).to(tl.int32), 1) == 0)  # the first matching sibling
        ok = picked | ~child
    on_path = (tl.max((anc & ~ok[None, :]).to(tl.int32), 1) == 0) & iv  # every ancestor-or-self ok
    key = tl.where(on_path, dep, -1)
    acc = tl.max(key, 0)
    final = tl.min(tl.where(key == acc, i, _BIG), 0)
    path = tl.max(tl.where(i[:, None] == final, anc.to(tl.int32), 0), 0) > 0  # [NP over j]: nodes on its path
    d = tl.arange(0, NP)[:, None]  # depth (rows)
    hit = path[None, :] & (dep[None, :] == d) & jv[None, :]  # [depth, node']
    nodes = tl.where(tl.max(hit.to(tl.int32), 1) > 0, tl.sum(tl.where(hit, j[None, :], 0), 1), -1)
    dd = tl.arange(0, NP)
    if SYNTH:
        nxt = path[None, :] & (dep[None, :] == d + 1) & jv[None, :]
        tnext = tl.sum(tl.where(nxt, tok[None, :], 0), 1)
        root_out = tl.maximum(tl.load(Real + r * (2 + 2 * n) + 1 + n), 0)
        out = tl.where(dd < acc, tnext, tl.where(dd == acc, root_out, -1))
    else:
        out = tl.where(nodes >= 0, tl.sum(tl.where(hit, am[None, :], 0), 1), -1)
    o = Out + r * (2 + 2 * n)
    tl.store(o, acc.to(tl.int64))
    tl.store(o + 1 + dd, nodes.to(tl.int64), mask=dd < n)
    tl.store(o + 1 + n + dd, out.to(tl.int64), mask=dd < n)
    tl.store(o + 1 + 2 * n, bad)


def greedy_tree_verdict_packed(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                               ancestors: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """logits [R n, V] (tree-major), tokens / parents / depth [R, n] int64, ancestors [R, n, n] bool ->
    [R, 2 + 2 n] int64: accepted, path nodes by depth, output tokens, non-finite flag (see the module doc)."""
    r, n = tokens.shape
    v = logits.shape[1]
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    nchunks = triton.cdiv(v, _BLOCK)
    dev = logits.device
    pmax = torch.empty(r * n, nchunks, dtype=torch.float32, device=dev)
    pidx = torch.empty(r * n, nchunks, dtype=torch.int32, device=dev)
    _argmax_chunk_kernel[(r * n, nchunks)](logits, pmax, pidx, v, logits.stride(0), nchunks, BLOCK=_BLOCK,
                                           num_warps=8)
    out = torch.empty(r, 2 + 2 * n, dtype=torch.long, device=dev)
    _path_kernel[(r,)](pmax, pidx, tokens.contiguous(), parents.contiguous(), ancestors.contiguous().view(torch.uint8),
                       depth.contiguous(), pmax, pmax, out, n, nchunks, 0, v,
                       NP=triton.next_power_of_2(n), CP=triton.next_power_of_2(nchunks), SYNTH=False, num_warps=4)
    return out


def drawn_tree_verdict_packed(real: torch.Tensor, want: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                              ancestors: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """A benchmark's synthetic verdict: real = a verdict's packed [R, 2 + 2 n] (its final token after the root and
    its flag are kept), want [R, levels + 1] the sibling rank caught at each depth (column 0 unread) -> the packed
    verdict of the path whose nodes have their depth's rank, the real final token after it."""
    r, n = tokens.shape
    out = torch.empty_like(real)
    _path_kernel[(r,)](real, real, tokens.contiguous(), parents.contiguous(), ancestors.contiguous().view(torch.uint8),
                       depth.contiguous(), want.contiguous(), real.contiguous(), out, n, 1, want.shape[1] - 1, 1,
                       NP=triton.next_power_of_2(n), CP=1, SYNTH=True, num_warps=4)
    return out
