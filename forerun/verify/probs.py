"""The one logits -> probabilities transform shared by draft and target, inverse-CDF sampling, logprobs.

Order of the transform (the Hugging Face `generate` order):

1. temperature: x = (logits - max) / T. A row with T == 0 is greedy: a one-hot at the argmax of the
   raw logits (first index on ties); top-k / top-p / min-p are then irrelevant and skipped.
2. top-k (k > 0): keep tokens whose logit is >= the k-th largest (ties with the k-th are kept).
3. top-p (p < 1): sort the renormalised probabilities ascending and drop the tokens whose cumulative
   mass is <= 1 - p; the most likely token is always kept (transformers' TopPLogitsWarper).
4. min-p (m > 0): drop tokens whose renormalised probability is < m * (largest probability).
5. softmax in float32.

Drafter and target must both go through `logits_to_probs` with the same per-request settings: the
rejection rules are exact for the *processed* target distribution only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..sampling_params import SamplingParams

NEG_INF = float("-inf")


def _where(row_to_req: Tensor | None, row: int) -> str:
    if row_to_req is None:
        return f"row {row}"
    return f"row {row} (request {int(row_to_req[row])})"


def check_logits(logits: Tensor, row_max: Tensor | None = None, *, row_to_req: Tensor | None = None,
                 name: str = "logits") -> None:
    """Raise ValueError naming the first bad row: NaN, +Inf, or every entry -inf (nothing to sample).

    logits: [N, V]; row_max: [N] precomputed logits.amax(-1) (max propagates NaN, so one pass suffices);
    row_to_req: optional [N] request index of each row, named in the message.
    -inf entries are allowed: they are masked tokens.
    """
    if row_max is None:
        row_max = logits.amax(-1)
    bad = ~torch.isfinite(row_max)  # [N]
    if not bool(bad.any()):
        return
    row = int(bad.nonzero()[0, 0])
    values = logits[row]
    if bool(torch.isnan(values).any()):
        what = "contains NaN"
    elif bool(torch.isposinf(values).any()):
        what = "contains +Inf"
    else:
        what = "is fully masked (every entry is -inf): no token can be sampled"
    raise ValueError(f"{name} {_where(row_to_req, row)} {what}")


PROB_SUM_TOLERANCE = 1e-3  # |sum - 1| allowed for a float32 draft distribution (half types: 8e-3)


def check_probs(probs: Tensor, rows: Tensor, *, row_to_req: Tensor | None = None, name: str = "draft_probs",
                tolerance: float | None = None) -> None:
    """Raise ValueError if one of `rows` of probs is not a probability distribution: NaN/Inf, a negative
    entry, or a sum off 1 by more than `tolerance` (default PROB_SUM_TOLERANCE, 8e-3 for 16-bit types).

    The rejection rules compare p(x) with q(x) directly, so a scaled q (0.99 * q) is not a harmless
    normalisation slip: it raises every acceptance probability and biases the output; it is refused.
    probs: [N, V]; rows: [M] long row indices to check.
    """
    if tolerance is None:
        tolerance = PROB_SUM_TOLERANCE if probs.dtype.itemsize >= 4 else 8e-3
    total, low = probs.sum(-1, dtype=torch.float32), probs.amin(-1)  # [N]: two reads, no copy
    bad = (~torch.isfinite(total) | (total <= 0) | (low < 0))[rows]  # [M]
    if bool(bad.any()):
        row = int(rows[bad.nonzero()[0, 0]])
        raise ValueError(f"{name} {_where(row_to_req, row)} is not a probability distribution "
                         f"(sum {float(total[row]):.3g}, min {float(low[row]):.3g}): NaN, negative or all-zero")
    off = ((total - 1).abs() > tolerance)[rows]  # [M]
    if bool(off.any()):
        row = int(rows[off.nonzero()[0, 0]])
        raise ValueError(f"{name} {_where(row_to_req, row)} sums to {float(total[row]):.6g}, not 1 (tolerance "
                         f"{tolerance:g}): pass the normalised distribution the draft was sampled from "
                         "(logits_to_probs); a scaled q biases the accept test")


def _rows(mask: Tensor) -> Tensor:
    return mask.nonzero().squeeze(1)


def logits_to_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                    *, row_to_req: Tensor | None = None, check: bool = True) -> Tensor:
    """Processed sampling distribution of each row (see the module docstring for the order).

    logits: [N, V] float (any float dtype; computed in float32). temperature: [N] float (0 = greedy).
    top_k: [N] long (0 = off). top_p: [N] float (1.0 = off). min_p: [N] float (0 = off).
    row_to_req: optional [N] long, only used to name the request in error messages.
    Returns float32 [N, V], each row summing to 1. Raises ValueError for NaN / +Inf logits or a row
    whose entries are all -inf (when `check`).
    """
    x = logits.float()
    row_max = x.amax(-1, keepdim=True)  # [N, 1]
    if check:
        check_logits(x, row_max.squeeze(1), row_to_req=row_to_req)
    greedy = temperature <= 0  # [N]
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    x = x.sub(row_max).div_(temp.unsqueeze(1))  # one new tensor, <= 0, max entry exactly 0
    vocab = x.shape[1]

    rows = _rows((top_k > 0) & (top_k < vocab) & ~greedy)
    if rows.numel():
        k = top_k.index_select(0, rows).long()  # [M]
        sub = x.index_select(0, rows)  # [M, V]
        kth = sub.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # [M, 1]
        x.index_copy_(0, rows, sub.masked_fill(sub < kth, NEG_INF))

    rows = _rows((top_p < 1) & ~greedy)
    if rows.numel():
        sub = x.index_select(0, rows)
        sorted_p, order = sub.softmax(-1).sort(dim=-1, stable=True)  # ascending
        drop_sorted = sorted_p.cumsum(-1) <= (1 - top_p.index_select(0, rows).float()).unsqueeze(1)
        drop_sorted[:, -1] = False  # keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        x.index_copy_(0, rows, sub.masked_fill(drop, NEG_INF))

    rows = _rows((min_p > 0) & ~greedy)
    if rows.numel():
        sub = x.index_select(0, rows)
        p = sub.softmax(-1)
        floor = min_p.index_select(0, rows).float().unsqueeze(1) * p.amax(-1, keepdim=True)
        x.index_copy_(0, rows, sub.masked_fill(p < floor, NEG_INF))

    probs = x.exp_()  # softmax in place: the row maximum is exactly 0 and always kept by the masks
    probs.div_(probs.sum(-1, keepdim=True))
    rows = _rows(greedy)
    if rows.numel():
        one_hot = torch.zeros(rows.numel(), vocab, dtype=probs.dtype, device=probs.device)
        one_hot.scatter_(1, x.index_select(0, rows).argmax(-1, keepdim=True), 1.0)
        probs.index_copy_(0, rows, one_hot)
    return probs


def sample_from_probs(probs: Tensor, u: Tensor, block: int = 1024) -> Tensor:
    """Inverse-CDF sample of each row: the smallest i with cumsum[i] > u * total.

    probs: [N, V] non-negative weights, need not be normalised (a residual can be passed as is, even
    when every weight is below 2^-31); each row must have positive mass. u: [N] in [0, 1).
    Returns long [N]. Two levels: float32 block sums accumulated in float64, then a float64 cumsum
    inside the one block that holds the target, so a row costs one pass instead of a sequential scan.
    A zero-weight token is never returned: the chosen block has a positive sum, and inside it
    cumsum[i] > cumsum[i-1] implies weight i > 0; when rounding leaves the target at or past the
    block's own cumsum, the token where that cumsum first reaches its total (positive weight) is used.
    """
    n, vocab = probs.shape
    block = min(block, vocab)
    full = vocab // block
    sums = probs[:, : full * block].view(n, full, block).sum(-1)  # [N, full] (float32 pairwise sums)
    if vocab > full * block:
        sums = torch.cat([sums, probs[:, full * block:].sum(-1, keepdim=True)], 1)
    block_cdf = sums.double().cumsum(-1)  # [N, blocks]
    total = block_cdf[:, -1:].contiguous()  # [N, 1]
    target = u.double().unsqueeze(1) * total
    b = torch.minimum(torch.searchsorted(block_cdf, target, right=True), torch.searchsorted(block_cdf, total))
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), 0.0)  # [N, 1]
    cols = b * block + torch.arange(block, device=probs.device)  # [N, block]
    inside = probs.gather(1, cols.clamp(max=vocab - 1)).masked_fill(cols >= vocab, 0.0)
    cdf = inside.cumsum(-1, dtype=torch.float64)
    idx = torch.searchsorted(cdf, (target - before).clamp(min=0), right=True)
    idx = torch.minimum(idx, torch.searchsorted(cdf, cdf[:, -1:].contiguous()))
    return (b * block + idx).squeeze(1)


def compute_logprobs(logits: Tensor, token_ids: Tensor, num_top: int = 0
                     ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Logprob of each row's token and the row's top-`num_top` logprobs.

    logits: [N, V]; the distribution is log_softmax(logits) in float32. With raw model logits this is
    vLLM's default ("raw" logprobs: before temperature / top-k / top-p / min-p); pass log(probs) of
    `logits_to_probs` instead to get logprobs of the processed distribution.
    token_ids: [N] long, -1 = no token (NaN logprob).
    Returns (token_logprobs [N] float32, top_logprobs [N, num_top] or None, top_ids [N, num_top] or None).
    """
    logp = logits.float().log_softmax(-1)  # [N, V]
    has = token_ids >= 0
    tok = logp.gather(1, token_ids.clamp(min=0).unsqueeze(1)).squeeze(1)
    tok = torch.where(has, tok, torch.full_like(tok, float("nan")))
    if num_top <= 0:
        return tok, None, None
    top = logp.topk(min(num_top, logp.shape[1]), dim=-1)
    return tok, top.values, top.indices


@dataclass(frozen=True)
class SamplingTensors:
    """Sampling settings, one entry per REQUEST (the verifiers gather them per row)."""

    temperature: Tensor  # [R] float, 0 = greedy
    top_k: Tensor  # [R] long, 0 = off
    top_p: Tensor  # [R] float, 1.0 = off
    min_p: Tensor  # [R] float, 0 = off

    @classmethod
    def from_params(cls, params: Sequence["SamplingParams"], device: torch.device | str | None = None
                    ) -> "SamplingTensors":
        """From forerun.sampling_params.SamplingParams objects (or anything with the four attributes)."""
        from ..devices import h2d

        f32 = torch.float32  # one transfer, queued without waiting for the device
        both = h2d([[p.temperature, max(p.top_k, 0), p.top_p, p.min_p] for p in params], device, torch.float64)
        both = both.reshape(-1, 4)
        return cls(both[:, 0].to(f32), both[:, 1].long(), both[:, 2].to(f32), both[:, 3].to(f32))

    def probs(self, logits: Tensor, row_to_req: Tensor, *, check: bool = True) -> Tensor:
        """logits_to_probs of rows [N, V] whose requests are row_to_req [N]."""
        return logits_to_probs(logits, self.temperature[row_to_req], self.top_k[row_to_req],
                               self.top_p[row_to_req], self.min_p[row_to_req], row_to_req=row_to_req, check=check)


@dataclass(frozen=True)
class Logprobs:
    """Logprobs of emitted tokens, laid out like output_token_ids (slot j = j-th emitted token)."""

    token_logprobs: Tensor  # [R, W] float32, NaN where nothing was emitted
    top_logprobs: Tensor | None  # [R, W, n] float32 (None when n == 0)
    top_ids: Tensor | None  # [R, W, n] long vocabulary ids (None when n == 0)
