"""One speculative round for a batch of requests: propose -> one verify forward -> verify -> roll back.

Plain decoding is the same round with k = 0 for every request (the target feeds `last`, the verifier
samples one token), so there is a single code path.

Rollback invariant (seed 003): at the top of a round the target cache holds every committed token except
the newest, `last`. The target feeds its missing committed tokens (just `last`, or the whole prompt on a
request's first round) plus the k drafts; afterwards it is truncated to base + accepted + 1, which is
again "everything committed except the newest token". Draft caches are truncated to the same length or
less; what they miss is fed on their next proposal.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..drafters.base import DraftProposal, Drafter
from ..request import Request
from ..verify import SamplingTensors, verify_chain
from ..runtime.runner import Chunk, ModelRunner


@dataclass(frozen=True)
class RoundResult:
    emitted: list[list[int]]  # per request: accepted drafts then the final (corrected or bonus) token
    num_drafted: list[int]
    num_accepted: list[int]
    logprobs: list[list[dict]] | None  # per request, per emitted token (when any request asked)
    draft_step_seconds: float | None = None  # one draft step's measured time (None: not measured this round)
    target_seconds: float = 0.0
    target_tokens: int = 0


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def speculative_round(target: ModelRunner, drafter: Drafter | None, requests: list[Request], ks: list[int],
                      rule: str = "auto", verify_kwargs: dict | None = None, timing: bool = True) -> RoundResult:
    """timing: synchronise the device around the draft and target phases so that their times are real
    (adaptive k needs them; without it the host never waits for the device before verification)."""
    now = (lambda: _now(target.device)) if timing else time.perf_counter
    # 1. Draft: up to k_i tokens per request (k = 0 requests get none).
    t0 = now()
    if drafter is not None and any(ks):
        proposal = drafter.propose(requests, ks)
    else:
        proposal = DraftProposal([[] for _ in requests], [None] * len(requests))
    drafts = proposal.tokens
    t1 = now()

    # 2. One target forward: missing committed tokens + drafts; logits for the last k_i + 1 rows.
    kv = target.kv
    chunks = [Chunk(r.req_id, r.all_tokens[kv.length(r.req_id):] + d, logits=len(d) + 1)
              for r, d in zip(requests, drafts)]
    out, starts = target.forward(chunks)
    t2 = now()
    logits = out.logits  # [T, V], T = sum(k_i + 1), request i owns rows starts[i] .. starts[i] + k_i
    device = logits.device

    # 3. Verify. Row j of request i verifies draft j+1; the last row has no draft (-1).
    seqlens = [len(d) + 1 for d in drafts]
    draft_ids, ftp, lens, sampling, uniforms = _verify_inputs(requests, drafts, starts, seqlens, device)
    sampled_drafts = any(r.params.temperature > 0 for r in requests) and any(drafts)
    want_lp = max((r.params.logprobs for r in requests if r.params.logprobs is not None), default=None)
    if _fused_ok(device, rule, requests, verify_kwargs):
        # CUDA: one fused Triton pass (probabilities, accept test, residual / bonus sample); a drafter without
        # distributions (n-gram: point masses) needs no dense q at all
        from ..kernels.chain_sample import chain_sample

        dense = sampled_drafts and any(q is not None for q in proposal.probs)
        q = _dense_draft_probs(logits, drafts, proposal.probs, starts) if dense else None
        res = chain_sample(logits, draft_ids, ftp, lens, sampling, uniforms, draft_probs=q, max_seqlen=max(seqlens))
    else:
        q = _dense_draft_probs(logits, drafts, proposal.probs, starts) if sampled_drafts else None
        kwargs = dict(verify_kwargs or {})
        if want_lp is not None:
            kwargs["logprobs"] = want_lp
        res = verify_chain(logits, draft_ids, ftp, lens, sampling, uniforms, draft_probs=q, rule=rule, **kwargs)
    both = torch.cat([res.num_accepted.unsqueeze(1), res.output_token_ids], 1).tolist()  # one device sync
    num_acc, out_ids = [row[0] for row in both], [row[1:] for row in both]
    emitted = [row[: a + 1] for row, a in zip(out_ids, num_acc)]

    # 4. Roll back both caches to base + accepted + 1 (= committed tokens except the newest).
    for r, d, a in zip(requests, drafts, num_acc):
        valid = kv.length(r.req_id) - (len(d) + 1) + a + 1
        kv.truncate(r.req_id, valid)
        if drafter is not None:
            drafter.rollback(r, valid)
    lps = _logprobs(res, emitted, want_lp) if want_lp is not None else None
    step_s = proposal.step_seconds
    if step_s is None and drafter is not None and any(drafts):  # drafters without steps: their whole cost per token
        step_s = (t1 - t0) / max(map(len, drafts))
    return RoundResult(emitted, [len(d) for d in drafts], num_acc, lps, draft_step_seconds=step_s, target_seconds=t2 - t1,
                       target_tokens=sum(len(c.token_ids) for c in chunks))


def _verify_inputs(requests: list[Request], drafts: list[list[int]], starts: list[int], seqlens: list[int],
                   device: torch.device):
    """The verifier's small inputs in two host -> device transfers (one int64, one float32):
    draft ids [T], ftp [R], seqlens [R], sampling settings [R] and the requests' own coins [T, 2]."""
    num_req, rows = len(requests), sum(seqlens)
    p = [r.params for r in requests]
    ints = torch.tensor([t for d in drafts for t in d + [-1]] + starts + seqlens + [x.top_k for x in p],
                        dtype=torch.int64).to(device, non_blocking=True)
    coins = torch.cat([torch.rand(n, 2, generator=r.generator) for r, n in zip(requests, seqlens)]).flatten()
    floats = torch.cat([coins, torch.tensor([v for x in p for v in (x.temperature, x.top_p, x.min_p)])])
    floats = floats.to(device, non_blocking=True)
    draft_ids, ftp, lens, top_k = ints.split([rows, num_req, num_req, num_req])
    uniforms, settings = floats.split([2 * rows, 3 * num_req])
    settings = settings.view(num_req, 3)
    sampling = SamplingTensors(settings[:, 0], top_k, settings[:, 1], settings[:, 2])
    return draft_ids, ftp, lens, sampling, uniforms.view(rows, 2)


def _dense_draft_probs(logits: torch.Tensor, drafts: list[list[int]], probs: list[torch.Tensor | None],
                       starts: list[int]) -> torch.Tensor:
    """[T, V] draft distribution per row (zeros on rows without a draft); None = a point mass on the token."""
    out = torch.zeros_like(logits)
    for d, q, s in zip(drafts, probs, starts):
        if not d:
            continue
        rows = torch.arange(s, s + len(d), device=logits.device)
        if q is None:
            out[rows, torch.tensor(d, device=logits.device)] = 1.0
        else:
            out[rows] = q.to(logits.device)
    return out


def temperature_only(requests: list[Request]) -> bool:
    """Every request samples with temperature alone (or greedily): no top-k / top-p / min-p, no logprobs.
    That is what the fused chain kernel covers (and so the overlapped decoding that uses it)."""
    return not any(r.params.top_k or r.params.top_p < 1.0 or r.params.min_p > 0 or r.params.logprobs is not None
                   for r in requests)


def _fused_ok(device: torch.device, rule: str, requests: list[Request], verify_kwargs) -> bool:
    """The fused CUDA kernel covers rule 'auto' with temperature only (no top-k/p, min-p, logprobs, extras)."""
    if device.type != "cuda" or rule != "auto" or verify_kwargs or not temperature_only(requests):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _logprobs(res, emitted: list[list[int]], want: int | None) -> list[list[dict]] | None:
    if want is None or getattr(res, "logprobs", None) is None:
        return None
    lp = res.logprobs
    out = []
    for i, toks in enumerate(emitted):
        row = []
        for j, t in enumerate(toks):
            entry = {"token_id": t, "logprob": float(lp.token_logprobs[i, j])}
            if lp.top_ids is not None:
                entry["top"] = dict(zip(lp.top_ids[i, j].tolist(), lp.top_logprobs[i, j].tolist()))
            row.append(entry)
        out.append(row)
    return out
