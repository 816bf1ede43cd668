"""Chain verification: greedy, exact rejection sampling, the alpha-penalty residual, typical acceptance.

Notation: p = target distribution (processed by `logits_to_probs`), q = draft distribution that produced
the drafted token x (seed 000 names them the other way round). Each row decides on its own; the layout
(`layout.accept_prefix`) keeps the accepted prefix, and the first row that stops its request (a
rejected draft, or the last row with nothing to verify) gives the final token. Coins: uniforms[row, 0]
decides the row's draft, uniforms[row, 1] samples the final token when that row is the final row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .layout import (accept_prefix, apply_token_bitmasks, chain_rows, columns_to_vocab, rows_to_requests,
                     step_counters, vocab_to_columns)
from .probs import Logprobs, SamplingTensors, check_logits, check_probs, compute_logprobs, sample_from_probs

from ..config import VERIFY_RULES as RULES  # the rule names, said once (config.py)
DRAFT_PROB_PENALTY = 5e-5  # DeepInfer's default: alpha = exp(-5e-5), epsilon = 1 - alpha ~ 5.0e-5


def greedy_accept(target_argmax: Tensor, draft: Tensor) -> Tensor:
    """Greedy rule: accept x iff x == argmax p; the final token is argmax p at the final row.
    Exact: every committed token is the one plain greedy decoding of the target emits, because row j
    holds the target's logits after exactly the committed prefix. target_argmax, draft: [T]."""
    return target_argmax == draft


def ratio_accept(p_x: Tensor, q_x: Tensor, u: Tensor) -> Tensor:
    """Rejection-sampling accept step: accept x with probability min(1, p(x) / q(x)), as u * q(x) < p(x)
    with u ~ U[0, 1) (no division; q(x) = 0 accepts iff p(x) > 0). p_x, q_x, u: [T].

    Exact (Leviathan et al., Chen et al.): P(emit y by acceptance) = q(y) min(1, p(y)/q(y)) = min(p, q)(y);
    P(reject) = 1 - sum min(p, q) = sum max(p - q, 0) = Z, and a reject draws max(p - q, 0) / Z, adding
    max(p - q, 0)(y). Sum: min(p, q) + max(p - q, 0) = p. Row j applies this to p( . | d_1..d_j), so by
    induction the accepted prefix plus the final token is distributed as the target's own sampling.
    """
    return u * q_x < p_x


def residual_weights(p: Tensor, q: Tensor, alpha: float = 1.0) -> Tensor:
    """Weights to resample from after a reject: max(p - alpha q, 0), or p itself where that is empty.

    p, q: [N, V]. Unnormalised on purpose (`sample_from_probs` scales u by the total), so a residual
    whose every weight is below 2^-31 still yields a valid token.

    alpha = 1 (rule "rejection"): exact, see `ratio_accept`. An all-zero residual means p == q up to
    rounding; then a reject has probability ~0 and falls back to p (seed 003).

    alpha = exp(-DRAFT_PROB_PENALTY) < 1 (rule "penalty", seed 000 / DeepInfer): the accept step keeps
    min(1, p/q); a token with p = q > 0 keeps weight (1 - alpha) q, so a reject always has mass. It is
    not exact. With eps = 1 - alpha, the output probability A[j] of every token j satisfies

        p[j] - eps / (1 + eps)  <=  A[j]  <=  (1 + eps) p[j].

    Proof. Let m = min(p, q), Z0 = sum max(p - q, 0) = 1 - sum m (the reject probability),
    r = max(p - alpha q, 0) and Z = sum r, so A = m + Z0 r / Z. For every i,
    max(p_i - q_i, 0) <= r_i <= max(p_i - q_i, 0) + eps m_i  (if p_i >= q_i: r_i = (p_i - q_i) + eps q_i;
    else r_i <= p_i - alpha p_i = eps p_i), hence Z0 <= Z <= Z0 + eps (1 - Z0).
    Upper: if p_j >= q_j, A_j <= q_j + r_j = p_j + eps q_j <= (1 + eps) p_j (Z0 / Z <= 1); if p_j < q_j,
    A_j <= p_j + eps p_j. Lower: p_j - A_j = max(p_j - q_j, 0) - Z0 r_j / Z
    <= max(p_j - q_j, 0)(1 - Z0 / Z) <= Z0 (Z - Z0) / Z, which grows with Z, so with Z <= Z0 + eps(1 - Z0)
    and x = Z0: p_j - A_j <= eps x (1 - x) / (x + eps (1 - x)) <= eps / (1 + eps), the last step being
    (1 + eps) x (1 - x) <= x + eps (1 - x)  <=>  0 <= (x - eps)^2 + eps (1 - eps) + eps x^2.  QED.
    With the default penalty 5e-5 no token gains more than a factor 1.00005 or loses more than ~5e-5.
    """
    res = torch.sub(p, q, alpha=alpha).clamp_min_(0)
    empty = res.sum(-1, keepdim=True) <= 0
    return torch.where(empty, p, res) if bool(empty.any()) else res


def typical_threshold(probs: Tensor, epsilon: float, delta: float) -> Tensor:
    """Typical acceptance (Medusa, Cai et al. 2024), LOSSY and opt-in: accept x while
    p(x) > min(epsilon, delta * exp(-H(p))), H the entropy of the processed target row; the final token
    is then sampled from p at the first failing row. It does not preserve the target distribution
    (it favours likely tokens; no draft probabilities are used). Medusa's "first token always advances"
    is the final token here: it comes from the target itself, so every round commits at least one
    token. Temperature-0 rows (one-hot p) accept exactly the argmax. probs: [N, V] -> threshold [N]."""
    entropy = -torch.special.xlogy(probs, probs).sum(-1)
    return torch.clamp(delta * torch.exp(-entropy), max=epsilon)


@dataclass(frozen=True)
class VerifyResult:
    """Per-request outcome of `verify_chain` (R requests, T rows, W = max_q columns)."""

    num_accepted: Tensor  # [R] long: accepted drafts (= last_valid_offset)
    output_token_ids: Tensor  # [R, W] long: accepted drafts then the final token, -1 padded
    num_emitted: Tensor  # [R] long: num_accepted + 1
    sampled_token_ids: Tensor  # [R] long: the final token (residual sample, bonus or argmax)
    verified_token_ids: Tensor  # [T] long: the accepted draft of each row, else -1
    accepted_mask: Tensor  # [T] bool: effective accept
    is_final: Tensor  # [T] bool: the row that produced the final token
    last_valid_offset: Tensor  # [R] long: local step of the final row
    num_generated_tokens: Tensor  # [nextn] long: accepted drafts per step
    num_verified_tokens: Tensor  # [nextn] long: verify rows per step
    draft_tok: Tensor  # [R] long: drafts + 1 (= seqlens_q)
    accept_tok: Tensor  # [R] long: accepted + 1
    row_to_req: Tensor  # [T] long
    local_step: Tensor  # [T] long
    is_verify: Tensor  # [T] bool
    raw_accept: Tensor  # [T] bool: per-row decision before the prefix rule (fresh rows: True)
    blocked: Tensor  # [T] bool
    alive: Tensor  # [T] bool
    logprobs: Logprobs | None = None


def verify_chain(
    target_logits: Tensor,  # [T, V] (or [T, K] with topk_index)
    draft_token_ids: Tensor,  # [T] long: row ftp[r]+j holds d_{j+1}; last row of each request -1
    first_token_positions: Tensor,  # [R] long/int
    seqlens_q: Tensor,  # [R] long/int: k_r + 1
    sampling: SamplingTensors,  # per request
    uniforms: Tensor,  # [T, 2] in [0, 1): accept coin, final-sample coin
    draft_probs: Tensor | None = None,  # [T, V]: row ftp[r]+j = the distribution that produced d_{j+1}
    rule: str = "auto",
    *,
    penalty: float = DRAFT_PROB_PENALTY,
    typical_epsilon: float = 0.09,
    typical_delta: float = 0.3,
    golden_token_ids: Tensor | None = None,  # [T] long: forced output token of each row, -1 = not forced
    token_bitmasks: Sequence[tuple[Tensor, Tensor] | None] | None = None,  # per step (req_idx [n], mask [n, W])
    topk_index: Tensor | None = None,  # [T, K] long: force top-k, vocabulary id of each logits column
    logprobs: int | None = None,  # None = off; n >= 0: emitted-token logprob and top-n logprobs
    logprobs_mode: str = "raw",  # "raw": log_softmax(logits); "processed": log of the processed distribution
    nextn: int | None = None,  # counter slots (default max(seqlens_q) - 1)
    max_q: int | None = None,  # width of output_token_ids (default max(seqlens_q))
    check: bool = True,
) -> VerifyResult:
    """Verify a flattened batch of draft chains; returns each request's accepted prefix and final token.

    rule: "greedy" (argmax chain for every row), "rejection" (exact), "penalty" (alpha residual, see
    `residual_weights`), "typical" (lossy, see `typical_threshold`), "auto" (greedy for temperature-0
    requests, rejection otherwise; mixed batches are fine). A temperature-0 request is greedy under
    every rule. draft_probs is needed for rejection / penalty (and auto with a sampled request) and
    must come from `logits_to_probs` with the same settings. Structured-output bitmasks are applied to
    the target logits before anything else; golden_token_ids forces a row's output (a forced verify row
    accepts iff its draft equals the forced token). With topk_index the logits (and draft_probs) are
    over the K columns of each row's top-k table and outputs are mapped back to vocabulary ids.
    Raises ValueError naming the request for NaN / +Inf logits, fully masked rows or bad draft_probs.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    num_rows, device = target_logits.shape[0], target_logits.device
    ftp, seqlens = first_token_positions.long(), seqlens_q.long()
    num_req = ftp.shape[0]
    width = int(seqlens.max()) if max_q is None else max_q
    nextn = max(width - 1, 1) if nextn is None else nextn
    row_to_req, local_step, is_verify = chain_rows(ftp, seqlens, num_rows)

    logits = target_logits if not token_bitmasks else apply_token_bitmasks(target_logits, token_bitmasks, ftp, seqlens)
    draft_vocab = torch.where(is_verify, draft_token_ids.long(), -1)
    drafts = draft_vocab if topk_index is None else vocab_to_columns(draft_vocab, topk_index)
    has_draft = is_verify & (drafts >= 0)
    d_idx = drafts.clamp(min=0).unsqueeze(1)  # [T, 1]

    greedy_req = sampling.temperature <= 0 if rule == "auto" else torch.full((num_req,), rule == "greedy", device=device)
    greedy = greedy_req[row_to_req]  # [T]
    any_greedy = rule == "greedy" or (rule == "auto" and bool(greedy_req.any()))
    need_probs = rule != "greedy" and (rule != "auto" or not bool(greedy_req.all()))
    needs_q = need_probs and rule in ("auto", "rejection", "penalty")
    if needs_q and draft_probs is None:
        if bool(has_draft.any()):
            raise ValueError(f"rule {rule!r} with sampled requests needs draft_probs")
        needs_q = False  # no row carries a draft (plain decoding): q plays no part
    probs = sampling.probs(logits, row_to_req, check=check) if need_probs else None  # [T, V]
    argmax = None
    if any_greedy:
        row_max, argmax = logits.max(-1)  # one pass: the argmax and the NaN / Inf check
        if check and probs is None:
            check_logits(logits, row_max, row_to_req=row_to_req)
    if needs_q and check:
        check_probs(draft_probs, (has_draft & ~greedy).nonzero().squeeze(1), row_to_req=row_to_req)

    # per-row decision (greedy rows: argmax; sampled rows: the rule), then the accepted prefix
    raw = None if argmax is None else greedy_accept(argmax, drafts)
    if probs is not None:
        p_x = probs.gather(1, d_idx).squeeze(1)
        if rule == "typical":
            sampled_ok = p_x > typical_threshold(probs, typical_epsilon, typical_delta)
        elif draft_probs is None:
            sampled_ok = torch.zeros_like(has_draft)
        else:
            sampled_ok = ratio_accept(p_x, draft_probs.gather(1, d_idx).squeeze(1).float(), uniforms[:, 0])
        raw = sampled_ok if raw is None else torch.where(greedy, raw, sampled_ok)
    raw = raw & has_draft
    if golden_token_ids is not None:
        forced = is_verify & (golden_token_ids >= 0)
        raw = torch.where(forced, draft_vocab == golden_token_ids, raw)
    raw = raw | ~is_verify
    acc = accept_prefix(raw, is_verify, row_to_req, ftp)

    # final token from each request's final row: argmax, residual sample (rejected) or bonus sample
    f = acc.final_row  # [R]
    final = None if argmax is None else argmax[f]
    if probs is not None:
        weights = probs[f]  # [R, V]
        if rule != "typical" and draft_probs is not None:  # residual where the final row is a rejected verify row; q = 0 on bonus rows
            alpha = math.exp(-penalty) if rule == "penalty" else 1.0
            rejected = (draft_vocab[f] >= 0).to(weights.dtype).unsqueeze(1)
            weights = residual_weights(weights, draft_probs[f].float().mul_(rejected), alpha)
        sampled = sample_from_probs(weights, uniforms[f, 1])
        final = sampled if final is None else torch.where(greedy_req, final, sampled)
    if topk_index is not None:
        final = columns_to_vocab(final, topk_index[f])
    if golden_token_ids is not None:
        final = torch.where(golden_token_ids[f] >= 0, golden_token_ids[f], final)

    row_token = torch.where(acc.accepted, draft_vocab, torch.where(acc.is_final, final[row_to_req], -1))
    num_generated, num_verified = step_counters(local_step, acc.accepted, is_verify, nextn)
    lp = None
    if logprobs is not None:
        row_col = row_token if topk_index is None else vocab_to_columns(row_token, topk_index)
        lp = _logprobs(logits, probs, sampling, row_to_req, local_step, row_col, logprobs, logprobs_mode,
                       topk_index, num_req, width)
    return VerifyResult(
        num_accepted=acc.num_accepted,
        output_token_ids=rows_to_requests(row_token, row_to_req, local_step, num_req, width, -1),
        num_emitted=acc.num_accepted + 1,
        sampled_token_ids=final,
        verified_token_ids=torch.where(acc.accepted, draft_vocab, -1),
        accepted_mask=acc.accepted,
        is_final=acc.is_final,
        last_valid_offset=acc.num_accepted,
        num_generated_tokens=num_generated,
        num_verified_tokens=num_verified,
        draft_tok=seqlens,
        accept_tok=acc.num_accepted + 1,
        row_to_req=row_to_req,
        local_step=local_step,
        is_verify=is_verify,
        raw_accept=raw,
        blocked=acc.blocked,
        alive=acc.alive,
        logprobs=lp,
    )


def _logprobs(logits: Tensor, probs: Tensor | None, sampling: SamplingTensors, row_to_req: Tensor,
              local_step: Tensor, row_col: Tensor, n: int, mode: str, topk_index: Tensor | None,
              num_req: int, width: int) -> Logprobs:
    """Logprobs of each row's emitted token (row_col [T], column space, -1 = none) laid out [R, W]."""
    if mode == "processed":
        probs = sampling.probs(logits, row_to_req, check=False) if probs is None else probs
        source = probs.log()
    elif mode == "raw":
        source = logits
    else:
        raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {mode!r}")
    tok, top, ids = compute_logprobs(source, row_col, n)
    place = lambda v, fill: rows_to_requests(v, row_to_req, local_step, num_req, width, fill)  # noqa: E731
    if ids is not None and topk_index is not None:
        ids = columns_to_vocab(ids, topk_index)
    return Logprobs(place(tok, float("nan")), None if top is None else place(top, float("nan")),
                    None if ids is None else place(ids, -1))
