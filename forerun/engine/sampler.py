"""The one verifier entry of the engine: SamplingParams -> tensors, coins, the coupling, the rule, logprobs.

Every round (chain or tree, k = 0 plain decoding included) ends here. What happens once per round:

1. Per request: its sampling settings, and whether it is *coupled*: a seeded request sampled at
   temperature > 0 under rule "auto" uses the position-keyed Gumbel coupling (forerun/verify/coupling.py),
   so its output depends on (prompt, seed) only, never on k, the tree, its batch neighbours or preemption.
   Its target rows are replaced by the perturbed scores log p + g and verified greedily.
2. Coins: two per verify row from the request's own generator (unseeded sampled requests use them; every
   request draws them so that a generator's stream does not depend on the others).
3. The verifier: the fused CUDA kernel where it applies (rule auto, temperature only), else
   `verify_chain` / `verify_tree` with the configured rule.
4. Logprobs of the emitted tokens from the raw target logits (vLLM's default), chain and tree alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..devices import h2d, to_host_async
from ..drafters.base import TreeProposal
from ..request import Request
from ..verify import SamplingTensors, compute_logprobs, verify_chain, verify_tree
from ..verify.probs import check_logits
from ..verify.tree import greedy_tree_verdict, pack_verdict
from ..verify.coupling import coupled_scores, row_key
from ..verify.probs import logits_to_probs


@dataclass(frozen=True)
class Verdict:
    """Per request: accepted drafts, emitted tokens (accepted drafts then the final token), logprob entries."""

    num_accepted: list[int]
    emitted: list[list[int]]
    logprobs: list[list[dict] | None]


def temperature_only(requests: list[Request]) -> bool:
    """No top-k / top-p / min-p / logprobs: what the fused chain kernel (and overlapped decoding) covers."""
    return not any(r.params.top_k or r.params.top_p < 1.0 or r.params.min_p > 0 or r.params.logprobs is not None
                   for r in requests)


def forcing(r: Request) -> bool:
    """Golden tokens (SamplingParams.forced_tokens) still to come."""
    return len(r.output_token_ids) < len(r.params.forced_tokens)


def is_coupled(r: Request, rule: str) -> bool:
    return r.params.seed is not None and r.params.temperature > 0 and rule == "auto"


class RoundSampler:
    def __init__(self, rule: str = "auto", verify_kwargs: dict | None = None) -> None:
        self.rule, self.verify_kwargs = rule, dict(verify_kwargs or {})

    # -- shared preparation ------------------------------------------------------------------------
    def _prepare(self, logits: torch.Tensor, requests: list[Request], starts: list[int], rows: list[int],
                 depths: list[list[int]] | None = None):
        """Sampling tensors (coupled requests as greedy), coins [T, 2], and logits with coupled rows perturbed.
        rows[i]: verify rows of request i (k_i + 1 for a chain, its node count for a tree); depths[i][j]: how
        far past the newest committed token row j samples (chain: j; tree: the node's depth)."""
        device = logits.device
        coupled = [is_coupled(r, self.rule) for r in requests]
        params = [r.params for r in requests]
        st = SamplingTensors.from_params(params, device)
        coins = h2d(torch.cat([torch.rand(n, 2, generator=r.generator) for r, n in zip(requests, rows)]), device)
        if any(coupled):
            logits = logits.clone()
            temps = st.temperature.clone()
            for i, r in enumerate(requests):
                if not coupled[i]:
                    continue
                sl = slice(starts[i], starts[i] + rows[i])
                n = rows[i]
                offs = depths[i] if depths is not None else range(n)
                keys = h2d([row_key(r.params.seed, r.num_tokens + o) for o in offs], device, torch.int64)
                logits[sl] = _coupled(logits[sl], st.temperature[i].expand(n), keys, st.top_k[i].expand(n),
                                      st.top_p[i].expand(n), st.min_p[i].expand(n))
                temps[i] = 0.0
            st = SamplingTensors(temps, st.top_k, st.top_p, st.min_p)
        return st, coins, logits, coupled

    # -- chains --------------------------------------------------------------------------------------
    def chain(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
              draft_probs: list[torch.Tensor | None], starts: list[int],
              device_drafts: torch.Tensor | None = None) -> Verdict:
        """logits: [T, V] with request i's k_i + 1 rows at starts[i]; row j verifies drafts[i][j].
        device_drafts: the drafts still on the device, flat in request order ([sum k_i] int64); drafts[i] then
        only gives their number (its entries are placeholders)."""
        device = logits.device
        rows = [len(d) + 1 for d in drafts]
        logits, starts = _compact(logits, starts, rows)
        raw = logits
        st, coins, logits, coupled = self._prepare(logits, requests, starts, rows)
        if device_drafts is None:
            draft_ids = h2d([t for d in drafts for t in d + [-1]], device, torch.int64)
        else:  # [T]: request i's drafts at its first k_i rows, -1 at its last row
            draft_ids = torch.full((sum(rows),), -1, dtype=torch.int64, device=device)
            at = h2d([s + j for s, d in zip(starts, drafts) for j in range(len(d))], device, torch.int64)
            draft_ids.index_copy_(0, at, device_drafts)
        ftp, lens = h2d([starts, rows], device, torch.int64)
        golden = None  # [T] forced output of each row, -1 = free (rows of request i: its next outputs)
        if any(forcing(r) for r in requests):
            g = []
            for r, n in zip(requests, rows):
                f, at = r.params.forced_tokens, len(r.output_token_ids)
                g.extend(f[at + j] if at + j < len(f) else -1 for j in range(n))
            golden = h2d(g, device, torch.int64)
        # the verifier wants q whenever a sampled (uncoupled) row and any draft share the batch
        sampled = any(r.params.temperature > 0 and not c for r, c in zip(requests, coupled)) and any(drafts)
        dense = sampled and any(q is not None for q, c in zip(draft_probs, coupled) if not c)
        q = _dense_draft_probs(logits, [len(d) for d in drafts], draft_ids, draft_probs, starts) if sampled else None
        if golden is None and self._fused_ok(device, requests):
            from ..kernels.chain_sample import chain_sample

            res = chain_sample(logits, draft_ids, ftp, lens, st, coins, draft_probs=q if dense else None,
                               max_seqlen=max(rows))
        else:
            res = verify_chain(logits, draft_ids, ftp, lens, st, coins, draft_probs=q, rule=self.rule,
                               golden_token_ids=golden, **self.verify_kwargs)
        both = torch.cat([res.num_accepted.unsqueeze(1), res.output_token_ids], 1).tolist()  # one device sync
        num_acc = [row[0] for row in both]
        emitted = [row[1: a + 2] for row, a in zip(both, num_acc)]
        lp_rows = [[s + j for j in range(len(e))] for s, e in zip(starts, emitted)]
        return Verdict(num_acc, emitted, self._logprobs(raw, requests, emitted, lp_rows))

    def _fused_ok(self, device: torch.device, requests: list[Request]) -> bool:
        if device.type != "cuda" or self.rule != "auto" or self.verify_kwargs or not temperature_only(requests):
            return False
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True

    # -- trees ---------------------------------------------------------------------------------------
    def tree(self, logits: torch.Tensor, requests: list[Request], prop: TreeProposal, starts: list[int]) -> tuple[Verdict, list[list[int]]]:
        """logits: [T, V] with request i's n_i node rows at starts[i] (root first). Returns the verdict and,
        per request, the accepted path (node indices, root first)."""
        device = logits.device
        rows = [len(t) for t in prop.tokens]
        pending = self.tree_launch(
            logits, requests, rows, starts, h2d([t for toks in prop.tokens for t in toks], device, torch.int64),
            h2d([p for ps in prop.parents for p in ps], device, torch.int64),
            lambda: torch.cat([q.to(device) for q in prop.probs]), [_depths(p) for p in prop.parents])
        return self.tree_finish(pending, prop)

    def tree_launch(self, logits: torch.Tensor, requests: list[Request], rows: list[int], starts: list[int],
                    tokens: torch.Tensor, parents: torch.Tensor, draft_probs, depths: list[list[int]] | None,
                    layout: tuple[torch.Tensor, torch.Tensor] | None = None) -> "TreePending":
        """Queue the tree verification without reading the device back. tokens / parents: [sum rows] int64 on the
        device (request i's nodes at its rows, root first; local parents, -1 at roots); draft_probs: [sum rows, V],
        or a callable making it (called only when a rule reads it), or None (greedy batches); depths[i][j]: node
        j's depth (read only for coupled requests: None is allowed when there are none). layout: (ancestor-or-self
        mask [R, n, n], depth [R, n]) of R trees of n nodes each (a drafter's device tree): a greedy batch is then
        verified by `greedy_tree_verdict` (the same rule, a fraction of the device ops, no coins drawn). The verdict
        is copied to the host asynchronously; `tree_finish` waits for it (the round's one host read)."""
        device = logits.device
        logits, starts = _compact(logits, starts, rows)
        raw = logits
        b, n = len(rows), max(rows)
        if (layout is not None and self.rule in ("auto", "greedy") and logits.shape[0] == b * n
                and all(r.params.temperature == 0 for r in requests)):
            res = greedy_tree_verdict(logits, tokens.view(b, n), parents.view(b, n), layout[0], layout[1])
            bad = res.bad
            host, event = self.packed_to_host(res.packed)
            return TreePending(res, host, event, raw, logits, requests, starts, rows, tokens, parents, None, None,
                               None, n, bad)
        coupled = [is_coupled(r, self.rule) for r in requests]
        if any(coupled) and depths is None:
            raise ValueError("coupled requests need the nodes' depths")
        st, coins, logits, coupled = self._prepare(logits, requests, starts, rows, depths)
        # temperature > 0 after coupling (coupled requests are verified greedily on perturbed scores)
        any_sampled = any(r.params.temperature > 0 and not c for r, c in zip(requests, coupled))
        need_q = self.rule == "exact" or (self.rule == "auto" and any_sampled)
        q = draft_probs() if need_q and callable(draft_probs) else (draft_probs if need_q else None)
        width = max(rows)
        # no host reads: sizes from the host, the input checks folded into the one read (re-run on failure)
        res = verify_tree(logits, tokens, parents, h2d(starts, device, torch.int64), h2d(rows, device, torch.int64),
                          st, coins, draft_probs=q, rule=self.rule, max_nodes=width, check=False,
                          any_sampled=any_sampled)
        bad = ~torch.isfinite(logits.amax(-1)).all()
        host, event = self.verdict_to_host(res, bad)
        return TreePending(res, host, event, raw, logits, requests, starts, rows, tokens, parents, st, coins, q, width,
                           bad)

    @staticmethod
    def packed_to_host(packed: torch.Tensor):
        """Queue the copy of a greedy tree verdict (`GreedyTreeVerdict.packed`) to the host: (host tensor, event)."""
        return to_host_async(packed)

    @staticmethod
    def verdict_to_host(res, bad: torch.Tensor):
        """Queue the copy of a tree verdict (num_accepted [R], accepted_nodes [R, n], output_token_ids [R, n]) and
        the non-finite flag to the host: (host tensor [R, 2 + 2 n], CUDA event after the copy or None)."""
        return to_host_async(pack_verdict(res.num_accepted, res.accepted_nodes, res.output_token_ids, bad))

    def tree_finish(self, pending: "TreePending", prop: TreeProposal | None = None) -> tuple[Verdict, list[list[int]]]:
        """Wait for the verdict of `tree_launch` (one host read); (Verdict, per request the accepted path, node
        indices root first). prop: the host proposal (unused here; subclasses, e.g. a benchmark's, read it)."""
        if pending.event is not None:
            pending.event.synchronize()
        both = pending.host.tolist()
        w = pending.width
        if any(row[-1] for row in both) and pending.stale:
            raise ValueError("target logits of this round contain NaN or +Inf, or a fully masked row: no token can "
                             f"be sampled (requests {[r.req_id for r in pending.requests]})")
        if any(row[-1] for row in both) and pending.st is None:  # (the greedy verdict: no coins were drawn)
            ids = torch.tensor([r.req_id for r in pending.requests]).repeat_interleave(torch.tensor(pending.rows))
            check_logits(pending.logits, row_to_req=ids, name="target_logits")
        if any(row[-1] for row in both):  # non-finite target logits: the checked verification raises the error
            verify_tree(pending.logits, pending.tokens, pending.parents,
                        h2d(pending.starts, pending.logits.device, torch.int64),
                        h2d(pending.rows, pending.logits.device, torch.int64), pending.st, pending.coins,
                        draft_probs=pending.q, rule=self.rule, check=True)
        num_acc = [row[0] for row in both]
        paths = [row[1: 2 + a] for row, a in zip(both, num_acc)]
        emitted = [row[1 + w: 2 + w + a] for row, a in zip(both, num_acc)]
        lp_rows = [[s + n for n in path] for s, path in zip(pending.starts, paths)]
        return Verdict(num_acc, emitted, self._logprobs(pending.raw, pending.requests, emitted, lp_rows)), paths

    # -- rounds whose verdict stays on the device (overlapped sessions, engine/overlap*.py) --------------
    def device_verdict(self, logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy chain verification without a host read (overlapped speculative rounds: greedy requests only).
        logits [B * (k+1), V] (request-major), drafts [B, k] on the device. Returns (tokens [B, k+1]: row i
        emits tokens[i, :accepted[i] + 1], accepted [B]). Subclasses may replace the verdict (the synthetic
        acceptance mode of benchmarks/online.py)."""
        b, k = drafts.shape
        best = logits.view(b, k + 1, -1).argmax(-1)  # [B, k+1]
        accepted = (best[:, :k] == drafts).to(torch.int64).cumprod(1).sum(1)  # leading matches
        return best, accepted

    def plain_inputs(self, requests: list[Request], device: torch.device) -> "PlainInputs":
        """What every k = 0 step of an overlapped session (engine/overlap.py) verifies with, built once: the
        sampling tensors (coupled requests greedy on perturbed scores), and which verifier runs."""
        if self.rule != "auto" or self.verify_kwargs or not temperature_only(requests):
            raise ValueError("overlapped plain steps take rule 'auto' and temperature-only sampling")
        b = len(requests)
        coupled = [i for i, r in enumerate(requests) if is_coupled(r, self.rule)]
        temps = [0.0 if i in coupled else r.params.temperature for i, r in enumerate(requests)]
        st = SamplingTensors(h2d(temps, device, torch.float32), torch.zeros(b, dtype=torch.int64, device=device),
                             torch.ones(b, device=device), torch.zeros(b, device=device))
        return PlainInputs(st, torch.full((b,), -1, dtype=torch.int64, device=device),
                           torch.arange(b, device=device), torch.ones(b, dtype=torch.int64, device=device),
                           h2d(coupled, device, torch.int64) if coupled else None,
                           h2d([requests[i].params.temperature for i in coupled], device, torch.float32)
                           if coupled else None, self._fused_ok(device, requests))

    def plain_launch(self, logits: torch.Tensor, inp: "PlainInputs", coins: torch.Tensor,
                     keys: torch.Tensor | None) -> torch.Tensor:
        """One k = 0 step's tokens [B] on the device, no host read: logits [B, V], coins [B, 2] (each request's
        two, from its generator, as `chain` draws them), keys [len(coupled)] the coupled rows' position keys
        (`row_key(seed, index of the sampled token)`; None without coupled rows). The verifier is `chain`'s."""
        if inp.coupled_rows is not None:
            logits = logits.clone()  # (a graph's static output is not overwritten)
            n = inp.coupled_rows.numel()
            zeros = torch.zeros(n, dtype=torch.int64, device=logits.device)
            logits[inp.coupled_rows] = _coupled(logits[inp.coupled_rows], inp.coupled_temps, keys, zeros,
                                                torch.ones(n, device=logits.device), torch.zeros(n, device=logits.device))
        if inp.fused:
            from ..kernels.chain_sample import chain_sample

            res = chain_sample(logits, inp.no_draft, inp.first, inp.ones, inp.sampling, coins, None, max_seqlen=1)
        else:
            res = verify_chain(logits, inp.no_draft, inp.first, inp.ones, inp.sampling, coins)
        return res.output_token_ids[:, 0]

    # -- logprobs ------------------------------------------------------------------------------------
    @staticmethod
    def _logprobs(raw: torch.Tensor, requests: list[Request], emitted: list[list[int]],
                  rows: list[list[int]]) -> list[list[dict] | None]:
        """Raw logprobs (log_softmax of the target logits) of each emitted token and the top-n, per request."""
        want = [r.params.logprobs for r in requests]
        out: list[list[dict] | None] = [None] * len(requests)
        idx = [i for i, w in enumerate(want) if w is not None]
        if not idx:
            return out
        flat_rows = [x for i in idx for x in rows[i]]
        toks = [t for i in idx for t in emitted[i]]
        n_top = max(want[i] for i in idx)
        tok_lp, top_lp, top_ids = compute_logprobs(raw[h2d(flat_rows, raw.device, torch.int64)],
                                                   h2d(toks, raw.device, torch.int64), n_top)
        tok_lp = tok_lp.tolist()
        top_lp = top_lp.tolist() if top_lp is not None else None
        top_ids = top_ids.tolist() if top_ids is not None else None
        at = 0
        for i in idx:
            entries = []
            for t in emitted[i]:
                e = {"token_id": t, "logprob": tok_lp[at]}
                if top_ids is not None:
                    e["top"] = dict(zip(top_ids[at][: want[i]], top_lp[at][: want[i]]))
                entries.append(e)
                at += 1
            out[i] = entries
        return out


@dataclass
class PlainInputs:
    """`RoundSampler.plain_inputs`: the per-session tensors of overlapped k = 0 steps (B requests)."""

    sampling: SamplingTensors  # coupled requests at temperature 0 (verified greedily on perturbed scores)
    no_draft: torch.Tensor  # [B] -1
    first: torch.Tensor  # [B] row of each request
    ones: torch.Tensor  # [B] one verify row each
    coupled_rows: torch.Tensor | None  # [C] rows of the coupled requests
    coupled_temps: torch.Tensor | None  # [C] their temperatures
    fused: bool  # the fused CUDA sampler (else verify_chain)


def _coupled(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, top_k: torch.Tensor,
             top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Coupled rows' scores log p + g(key): greedy on them samples p (forerun/verify/coupling.py)."""
    return coupled_scores(logits_to_probs(logits, temps, top_k, top_p, min_p), keys)


@dataclass
class TreePending:
    """A tree verification queued by `RoundSampler.tree_launch`, its verdict on its way to the host."""

    res: object  # forerun.verify.TreeVerifyResult (device tensors)
    host: torch.Tensor  # [R, 2 + 2 n]: accepted, path nodes, output tokens, non-finite flag (pinned on CUDA)
    event: object  # CUDA event after the copy (None on the CPU)
    raw: torch.Tensor  # the compacted raw logits (logprobs)
    logits: torch.Tensor  # as verified (coupled rows perturbed)
    requests: list
    starts: list[int]
    rows: list[int]
    tokens: torch.Tensor
    parents: torch.Tensor
    st: SamplingTensors | None  # (None: the greedy verdict, no sampling tensors or coins)
    coins: torch.Tensor | None
    q: torch.Tensor | None
    width: int
    bad: torch.Tensor  # [] bool or [R] (per request, the greedy verdict's): a non-finite target row
    # the logits were overwritten after the verification was queued (TreeRound queued the next round's verify in
    # the same graph's static memory): a non-finite row is reported without re-reading them
    stale: bool = False


def _depths(parents: list[int]) -> list[int]:
    """Depth of each node of one tree (root 0; a parent precedes its children): forerun.verify's tree_positions."""
    depth = [0] * len(parents)
    for j, p in enumerate(parents):
        if p >= 0:
            depth[j] = depth[p] + 1
    return depth


def _compact(logits: torch.Tensor, starts: list[int], rows: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Only these requests' rows, contiguous: ([sum rows, V], new starts). A no-op when they already are."""
    new, at = [], 0
    for n in rows:
        new.append(at)
        at += n
    if new == list(starts) and at == logits.shape[0]:
        return logits, starts
    idx = h2d(torch.cat([torch.arange(s, s + n) for s, n in zip(starts, rows)]), logits.device)
    return logits[idx], new


def _dense_draft_probs(logits: torch.Tensor, counts: list[int], draft_ids: torch.Tensor,
                       probs: list[torch.Tensor | None], starts: list[int]) -> torch.Tensor:
    """[T, V] draft distribution per row (zeros on rows without a draft); None = a point mass on the token.
    counts[i]: drafts of request i; draft_ids [T]: the drafted token of each row (-1 on rows without one)."""
    out = torch.zeros_like(logits, dtype=torch.float32)
    for n, q, s in zip(counts, probs, starts):
        if not n:
            continue
        rows = torch.arange(s, s + n, device=logits.device)
        if q is None:
            out[rows, draft_ids[s: s + n]] = 1.0
        else:
            out[rows] = q.to(logits.device)
    return out
