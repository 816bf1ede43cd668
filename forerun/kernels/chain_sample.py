"""Fused chain verification (speculative rejection sampling) in three Triton launches.

Inputs follow forerun.verify.verify_chain: request r owns logits rows first[r] .. first[r] + n_r - 1; row j
holds the draft token d_{j+1} that it verifies, the last row holds -1 (it only gives the bonus token).

1. `_row_stats_kernel`, grid (requests, rows, vocabulary splits): per row and split, the max of
   logits / temperature, the first index reaching it (greedy), and sum(exp(x - max)) in float64.
2. `_split_weights_kernel`, grid (requests, splits): walks the request's rows in order with the accept test
   u0 * q(d) < p(d)  (= u0 < min(1, p(d) / q(d))) up to the first rejection (the walk reads one logit and
   one draft probability per row), then sums the final row's sampling weights over its split: the residual
   max(p - q, 0) after a rejection, p itself on the last row (bonus).
3. `_final_kernel`, grid (requests,): the same walk writes the accepted drafts; the final token is the argmax
   (temperature 0: accept d iff d == argmax) or the inverse CDF with the row's second uniform: the split
   from (2), then blocks inside it, then the token.

Every logits row is read once by (1); the final row is read once more by (2), split across the machine, and
(3) reads only the blocks of one split. Weights are formed in float32 and accumulated in float64, so the
token equals a float64 inverse CDF except at numerical ties.
Top-k / top-p / min-p are not applied here: use this kernel only for requests that have them off.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_STATS_BLOCK = 2048
_SAMPLE_BLOCK = 2048


@dataclass(frozen=True)
class ChainSampleOutput:
    output_token_ids: torch.Tensor  # [R, max_seqlen] int64: accepted drafts, then the final token, then -1
    num_accepted: torch.Tensor  # [R] int64: accepted drafts per request (tokens emitted = num_accepted + 1)


# (ints that follow the batch are not specialized on: no compile per value class mid-serving; see triton_backend)
@triton.jit(do_not_specialize=["chunk", "nsplit"])
def _row_stats_kernel(
    Logits, InvTemp, Greedy, First, SeqLens,  # [T, V], [R] f32, [R] i8, [R] i64, [R] i64
    PartMax, PartSum, PartArg,  # [T, NSPLIT] f32 / f64 / i32
    V, stride_l, chunk, nsplit,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    j = tl.program_id(1)
    sp = tl.program_id(2)
    if j >= tl.load(SeqLens + r):
        return
    row = tl.load(First + r) + j
    inv_t = tl.load(InvTemp + r)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, V)
    base = Logits + row.to(tl.int64) * stride_l
    lanes = tl.arange(0, BLOCK)

    # pass 1: max and the first index reaching it (lane-wise, then across lanes)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, chunk, BLOCK):
        offs = lo + start + lanes
        x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32) * inv_t
        upd = x > best
        best = tl.where(upd, x, best)
        best_i = tl.where(upd, offs, best_i)
    m = tl.max(best, 0)
    arg = tl.min(tl.where(best == m, best_i, 2147483647), 0)

    # pass 2: sum of exp(x - m) in float64 (skipped for greedy rows, which only need the argmax)
    total = tl.zeros([BLOCK], tl.float64)
    if tl.load(Greedy + r) == 0:
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        for start in range(0, chunk, BLOCK):
            offs = lo + start + lanes
            x = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32) * inv_t
            total += tl.exp(x - m_safe).to(tl.float64)
    out = row * nsplit + sp
    tl.store(PartMax + out, m)
    tl.store(PartSum + out, tl.sum(total, 0))
    tl.store(PartArg + out, arg)


@triton.jit
def _combine(PartMax, PartSum, PartArg, row, nsplit, S_PAD: tl.constexpr):
    """Row max, softmax normaliser (f64) and first argmax from the per-split partials."""
    offs = tl.arange(0, S_PAD)
    ok = offs < nsplit
    ms = tl.load(PartMax + row * nsplit + offs, mask=ok, other=float("-inf"))
    ss = tl.load(PartSum + row * nsplit + offs, mask=ok, other=0.0)
    args = tl.load(PartArg + row * nsplit + offs, mask=ok, other=2147483647)
    m = tl.max(ms, 0)
    arg = tl.min(tl.where(ms == m, args, 2147483647), 0)  # splits are in index order: the first max wins
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    scale = tl.exp((ms - m_safe).to(tl.float64))
    s = tl.sum(tl.where(ok, ss * scale, 0.0), 0)
    return m, s, arg


@triton.jit
def _weights(Logits, DraftProbs, row, d, m, s, inv_t, offs, V, stride_l, stride_q,
             RESIDUAL: tl.constexpr, HAS_Q: tl.constexpr):
    """float64 sampling weights at vocabulary offsets: p, or the residual max(p - q, 0)."""
    ok = offs < V
    x = tl.load(Logits + row.to(tl.int64) * stride_l + offs, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
    w = tl.exp(x - m).to(tl.float64) / s
    if RESIDUAL:
        if HAS_Q:
            q = tl.load(DraftProbs + row.to(tl.int64) * stride_q + offs, mask=ok, other=0.0).to(tl.float64)
        else:
            q = tl.where(offs == d, 1.0, 0.0).to(tl.float64)
        w = tl.maximum(w - q, 0.0)
    return tl.where(ok, w, 0.0)


@triton.jit
def _accept_walk(Logits, DraftProbs, DraftIds, U, PartMax, PartSum, PartArg, Out,
                 r, start, n, inv_t, sampled, V, stride_l, stride_q, stride_u, stride_o, nsplit,
                 HAS_Q: tl.constexpr, S_PAD: tl.constexpr, WRITE: tl.constexpr):
    """Accept the request's drafts in order until the first rejection; returns the number accepted
    (its final row is start + that number). With WRITE, stores the accepted drafts in Out."""
    j = n * 0
    go = n > 1
    while go:
        row = start + j
        m, s, arg = _combine(PartMax, PartSum, PartArg, row, nsplit, S_PAD)
        d = tl.load(DraftIds + row)
        d_safe = tl.minimum(tl.maximum(d, 0), V - 1)
        if sampled:
            x_d = tl.load(Logits + row * stride_l + d_safe).to(tl.float32) * inv_t
            p_d = tl.exp(x_d - m).to(tl.float64) / s
            q_d = p_d * 0 + 1.0  # point mass on the draft unless its distribution is given
            if HAS_Q:
                q_d = tl.load(DraftProbs + row * stride_q + d_safe).to(tl.float64)
            u = tl.load(U + row * stride_u).to(tl.float64)
            ok = (u * q_d < p_d) & (d >= 0) & (d < V)
        else:
            ok = arg == d
        if ok:
            if WRITE:
                tl.store(Out + r * stride_o + j, d)
            j += 1
            go = j < n - 1
        else:
            go = j < 0
    return j


@triton.jit(do_not_specialize=["stride_u", "nsplit", "ns", "chunk"])
def _split_weights_kernel(
    Logits, DraftProbs, DraftIds, First, SeqLens, InvTemp, Greedy, U,  # as in _final_kernel
    PartMax, PartSum, PartArg,  # [T, NSPLIT] row statistics
    WSum,  # [R, NS, 2] f64 out: per split of the final row, sum of residual weights and of p
    V, stride_l, stride_q, stride_u, nsplit, ns, chunk,
    HAS_Q: tl.constexpr, S_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (R, NS): the weight mass of each vocabulary split of the request's final row."""
    r = tl.program_id(0)
    sp = tl.program_id(1)
    if tl.load(Greedy + r) != 0:
        return
    start = tl.load(First + r)
    n = tl.load(SeqLens + r)
    inv_t = tl.load(InvTemp + r)
    j = _accept_walk(Logits, DraftProbs, DraftIds, U, PartMax, PartSum, PartArg, WSum, r, start, n, inv_t, True,
                     V, stride_l, stride_q, stride_u, 0, nsplit, HAS_Q, S_PAD, False)
    row = start + j
    m, s, arg = _combine(PartMax, PartSum, PartArg, row, nsplit, S_PAD)
    d = tl.load(DraftIds + row)
    lo = sp * chunk
    res_acc = tl.zeros([BLOCK], tl.float64)
    p_acc = tl.zeros([BLOCK], tl.float64)
    for off in range(0, chunk, BLOCK):
        offs = lo + off + tl.arange(0, BLOCK)
        ok = offs < tl.minimum(lo + chunk, V)
        w = _weights(Logits, DraftProbs, row, d, m, s, inv_t, offs, V, stride_l, stride_q, False, HAS_Q)
        w = tl.where(ok, w, 0.0)
        p_acc += w
        if j < n - 1:  # rejected row: the residual max(p - q, 0)
            wr = _weights(Logits, DraftProbs, row, d, m, s, inv_t, offs, V, stride_l, stride_q, True, HAS_Q)
            res_acc += tl.where(ok, wr, 0.0)
    tl.store(WSum + (r * ns + sp) * 2, tl.sum(res_acc, 0))
    tl.store(WSum + (r * ns + sp) * 2 + 1, tl.sum(p_acc, 0))


@triton.jit(do_not_specialize=["stride_u", "stride_o", "nsplit", "ns", "chunk", "max_len"])
def _final_kernel(
    Logits, DraftProbs, DraftIds, First, SeqLens, InvTemp, Greedy, U,  # [T,V], [T,V], [T], [R], [R], [R], [R], [T,2]
    PartMax, PartSum, PartArg,  # [T, NSPLIT]
    WSum,  # [R, NS, 2] f64 from _split_weights_kernel
    Out, NumAcc,  # [R, max_len] i64, [R] i64
    V, stride_l, stride_q, stride_u, stride_o, nsplit, ns, chunk, max_len,
    HAS_Q: tl.constexpr, S_PAD: tl.constexpr, NS_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (R,): accepted drafts, then the final token (argmax, or inverse CDF: split, then block, then token)."""
    r = tl.program_id(0)
    start = tl.load(First + r)
    n = tl.load(SeqLens + r)
    inv_t = tl.load(InvTemp + r)
    sampled = tl.load(Greedy + r) == 0
    j = _accept_walk(Logits, DraftProbs, DraftIds, U, PartMax, PartSum, PartArg, Out, r, start, n, inv_t, sampled,
                     V, stride_l, stride_q, stride_u, stride_o, nsplit, HAS_Q, S_PAD, True)
    row = start + j
    m, s, arg = _combine(PartMax, PartSum, PartArg, row, nsplit, S_PAD)
    tok = arg.to(tl.int64)
    if sampled:
        d = tl.load(DraftIds + row)
        u1 = tl.load(U + row * stride_u + 1).to(tl.float64)
        offs_s = tl.arange(0, NS_PAD)
        s_ok = offs_s < ns
        res = tl.load(WSum + (r * ns + offs_s) * 2, mask=s_ok, other=0.0)
        pw = tl.load(WSum + (r * ns + offs_s) * 2 + 1, mask=s_ok, other=0.0)
        use_res = (j < n - 1) & (tl.sum(res, 0) > 0)  # p == q exactly leaves no residual: sample p
        sums = tl.where(use_res, res, pw)
        cdf = tl.cumsum(sums, 0)
        target = u1 * tl.sum(sums, 0)
        hit = (cdf > target) & (sums > 0)
        last_pos = tl.max(tl.where(sums > 0, offs_s, 0), 0)
        sp = tl.min(tl.where(hit, offs_s, NS_PAD), 0)
        sp = tl.where(sp == NS_PAD, last_pos, sp)  # rounding ran past the total: the last split with mass
        before = tl.sum(tl.where(offs_s < sp, sums, 0.0), 0)
        # inside the split: blocks in order until the cumulative weight passes the target
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, V)
        lanes = tl.arange(0, BLOCK)
        cum = before
        found = tok * 0 - 1
        last_tok = tok * 0 + lo
        off = lo
        while (found < 0) & (off < hi):
            offs = off + lanes
            ok = offs < hi
            if use_res:
                w = _weights(Logits, DraftProbs, row, d, m, s, inv_t, offs, V, stride_l, stride_q, True, HAS_Q)
            else:
                w = _weights(Logits, DraftProbs, row, d, m, s, inv_t, offs, V, stride_l, stride_q, False, HAS_Q)
            w = tl.where(ok, w, 0.0)
            cs = tl.cumsum(w, 0) + cum
            first = tl.min(tl.where((cs > target) & (w > 0), offs, 2147483647), 0)
            if first < 2147483647:
                found = first.to(tl.int64)
            last_tok = tl.maximum(last_tok, tl.max(tl.where(w > 0, offs, 0), 0).to(tl.int64))
            cum += tl.sum(w, 0)
            off += BLOCK
        tok = tl.where(found < 0, last_tok, found)
    tl.store(Out + r * stride_o + j, tok)
    tl.store(NumAcc + r, j)
    for c in range(j + 1, max_len):
        tl.store(Out + r * stride_o + c, -1)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it at a 16-byte aligned address. Triton specialises kernels on whether each pointer is
    16-byte aligned, and a view such as the second row of a [2, R] int64 upload (R odd) is not: each such
    argument compiled another variant in the middle of serving (~1 s rounds under Poisson arrivals on the H200,
    which Engine.warmup cannot foresee). These are small per-request tensors; the copy costs a launch."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def chain_sample(
    target_logits: torch.Tensor,  # [T, V] float (float32 from the model)
    draft_token_ids: torch.Tensor,  # [T] int64; row j of a request holds d_{j+1}, its last row -1
    first_token_positions: torch.Tensor,  # [R] int64, first row of each request
    seqlens_q: torch.Tensor,  # [R] int64, rows of each request (drafts + 1)
    sampling,  # SamplingTensors (uses .temperature [R]) or a temperature tensor [R]; 0 = greedy
    uniforms: torch.Tensor,  # [T, 2] float32: column 0 accept coin, column 1 final-sample coin
    draft_probs: torch.Tensor | None = None,  # [T, V] draft distribution of each row; None = point mass on the draft
    max_seqlen: int | None = None,  # max(seqlens_q) if known (avoids a device sync)
) -> ChainSampleOutput:
    """Chain rejection sampling for a batch of requests in three kernel launches (see the module docstring)."""
    temperature = getattr(sampling, "temperature", sampling).to(device=target_logits.device, dtype=torch.float32)
    num_rows, vocab = target_logits.shape
    num_req = seqlens_q.shape[0]
    if max_seqlen is None:
        max_seqlen = int(seqlens_q.max()) if num_req else 1
    if target_logits.stride(1) != 1:
        target_logits = target_logits.contiguous()
    if draft_probs is not None and draft_probs.stride(1) != 1:
        draft_probs = draft_probs.contiguous()
    if uniforms.stride(1) != 1:
        uniforms = uniforms.contiguous()
    greedy = (temperature <= 0).to(torch.int8)  # [R]
    inv_t = torch.where(greedy.bool(), 1.0, 1.0 / temperature)  # [R]; greedy rows use the raw logits
    first = _aligned(first_token_positions.to(torch.int64))
    lens = _aligned(seqlens_q.to(torch.int64))
    uniforms = _aligned(uniforms)
    dev = target_logits.device
    out = torch.empty(num_req, max_seqlen, dtype=torch.int64, device=dev)
    num_acc = torch.empty(num_req, dtype=torch.int64, device=dev)
    if num_req == 0:
        return ChainSampleOutput(out, num_acc)

    # split the vocabulary so that requests x rows x splits fills the machine about twice. The split counts follow
    # powers of two of the batch (not the batch itself): they set constexpr paddings, and every new value would
    # compile the kernels again in the middle of serving (Engine.warmup runs each power of two once)
    nsplit = max(1, min(triton.cdiv(vocab, _STATS_BLOCK),
                        triton.cdiv(2 * _num_sms(dev), triton.next_power_of_2(num_req * max_seqlen))))
    chunk = triton.cdiv(triton.cdiv(vocab, nsplit), _STATS_BLOCK) * _STATS_BLOCK
    nsplit = triton.cdiv(vocab, chunk)
    part_max = torch.empty(num_rows, nsplit, dtype=torch.float32, device=dev)
    part_sum = torch.empty(num_rows, nsplit, dtype=torch.float64, device=dev)
    part_arg = torch.empty(num_rows, nsplit, dtype=torch.int32, device=dev)
    _row_stats_kernel[(num_req, max_seqlen, nsplit)](
        target_logits, inv_t, greedy, first, lens, part_max, part_sum, part_arg,
        vocab, target_logits.stride(0), chunk, nsplit,
        BLOCK=_STATS_BLOCK, num_warps=8,
    )
    q = draft_probs if draft_probs is not None else target_logits  # dummy pointer when HAS_Q is off
    ids = _aligned(draft_token_ids.to(torch.int64))
    # the final row's sampling mass per split of the vocabulary: about 2 programs per SM in all
    ns = max(1, min(triton.cdiv(vocab, _SAMPLE_BLOCK), triton.cdiv(2 * _num_sms(dev), triton.next_power_of_2(num_req))))
    ns_chunk = triton.cdiv(triton.cdiv(vocab, ns), _SAMPLE_BLOCK) * _SAMPLE_BLOCK
    ns = triton.cdiv(vocab, ns_chunk)
    wsum = torch.empty(num_req, ns, 2, dtype=torch.float64, device=dev)
    common = (target_logits, q, ids, first, lens, inv_t, greedy, uniforms, part_max, part_sum, part_arg)
    _split_weights_kernel[(num_req, ns)](
        *common, wsum, vocab, target_logits.stride(0), q.stride(0), uniforms.stride(0), nsplit, ns, ns_chunk,
        HAS_Q=draft_probs is not None, S_PAD=triton.next_power_of_2(nsplit), BLOCK=_SAMPLE_BLOCK, num_warps=4,
    )
    _final_kernel[(num_req,)](
        *common, wsum, out, num_acc,
        vocab, target_logits.stride(0), q.stride(0), uniforms.stride(0), out.stride(0), nsplit, ns, ns_chunk, max_seqlen,
        HAS_Q=draft_probs is not None, S_PAD=triton.next_power_of_2(nsplit), NS_PAD=triton.next_power_of_2(ns),
        BLOCK=_SAMPLE_BLOCK, num_warps=4,
    )
    return ChainSampleOutput(out, num_acc)
