"""Autoregressive drafting with a model over its own (or a shared) paged KV cache.

Shared by the separate draft model and early-exit self-drafting: they differ only in which runner and
how many layers draft. Each step is one batched forward over the requests still drafting; step 0 also
feeds any committed tokens the draft cache misses (the prompt on the first round, `last`, and after an
all-accepted round the final draft the drafter never fed). Sampling uses the request's own transform and
generator, so at temperature > 0 drafts are sampled from the draft distribution, not taken by argmax.
Confidence stopping (DSpark): a step whose top draft probability falls below `confidence_threshold` ends
that request's draft before that token.
"""
from __future__ import annotations

import time

import torch

from ..devices import Marks, h2d
from ..request import Request
from ..runtime.runner import Chunk, ModelRunner
from ..structured import apply_grammar_to_draft_logits, grammar_of  # issue 14
from ..verify.coupling import coupled_scores, keys_for
from ..verify.probs import SamplingTensors, logits_to_probs, sample_from_probs
from .base import DraftProposal, Drafter


class ModelDrafter(Drafter):
    times_steps = True  # pure steps are timed in propose (step >= 2 on the device path)

    def __init__(self, runner: ModelRunner, num_layers: int | None = None, confidence_threshold: float = 0.0,
                 shares_target_cache: bool = False) -> None:
        self.runner, self.num_layers = runner, num_layers
        self.confidence_threshold = confidence_threshold
        self.shares_target_cache = shares_target_cache

    def _ensure(self, r: Request) -> None:
        kv = self.runner.kv
        if not kv.has(r.req_id):  # (prefix caching: the draft's own cached prefix; feeding starts after it)
            cached = kv.prefix_caching and not self.shares_target_cache
            # at most up to position L - 2: an overlapped session re-feeds L - 1 (overlap_spec._enter truncates
            # there, and a shared block cannot be cut)
            kv.add_sequence(r.req_id, r.all_tokens if cached else None, limit=max(r.num_tokens - 2, 0))

    @property
    def kv(self):
        return None if self.shares_target_cache else self.runner.kv

    def blocks_needed(self, request: Request, tokens: int) -> int:
        if self.shares_target_cache:
            return 0
        kv = self.runner.kv
        have = len(kv.blocks(request.req_id)) if kv.has(request.req_id) else 0
        return max(0, -(-tokens // kv.block_size) - have)

    def feed(self, requests: list[Request], upto: list[int]) -> None:
        """Chunked catch-up: forwards of at most the runner's token budget, no logits."""
        if self.shares_target_cache:
            return
        kv, budget = self.runner.kv, self.runner.buffers.max_tokens
        todo = []
        for r, n in zip(requests, upto):
            self._ensure(r)
            if kv.length(r.req_id) < n:
                todo.append((r, n))
        t0, fed = time.perf_counter(), sum(n - kv.length(r.req_id) for r, n in todo)
        while todo:
            chunks, left, rest = [], budget, []
            for r, n in todo:
                have = kv.length(r.req_id)
                take = min(n - have, left)
                if take > 0 and len(chunks) < self.runner.buffers.max_seqs:
                    chunks.append(Chunk(r.req_id, r.all_tokens[have: have + take], logits="none"))
                    left -= take
                if have + max(take, 0) < n:
                    rest.append((r, n))
            self.runner.forward(chunks, num_layers=self.num_layers)
            todo = rest
        if fed and self.on_feed is not None:
            self.on_feed(fed, time.perf_counter() - t0)

    max_catchup = 2  # step 0 feeds at most this many missing committed tokens per request (else feed() first)

    def propose(self, requests: list[Request], ks: list[int]) -> DraftProposal:
        kv = self.runner.kv
        active = [i for i, k in enumerate(ks) if k > 0]
        for i in active:
            self._ensure(requests[i])
        # step 0 feeds what the cache misses: the newest committed token, and after an all-accepted round the last
        # draft too. When every drafting request misses the same few tokens that is one uniform step (a CUDA graph
        # replays it); longer or uneven catch-ups (a prompt) are fed first, in budget-sized forwards.
        miss = {requests[i].num_tokens - kv.length(requests[i].req_id) for i in active}
        if len(miss) > 1 or max(miss, default=1) > self.max_catchup:
            self.feed([requests[i] for i in active], [requests[i].num_tokens - 1 for i in active])
        start_len = {requests[i].req_id: kv.length(requests[i].req_id) for i in active}
        on_device = self.confidence_threshold <= 0 and all(grammar_of(requests[i]) is None for i in active)
        prop = (self._propose_on_device if on_device else self._propose_on_host)(requests, ks, active)
        if self.shares_target_cache:  # early exit wrote into the target's cache: give the positions back
            for rid, n in start_len.items():
                kv.truncate(rid, n)
        return prop

    def _pick(self, logits: torch.Tensor, group: list[Request], drafted: int | list[int]):
        """The next draft token of each row, on the device: argmax for greedy rows (no probabilities needed),
        a sample from q for sampled rows, argmax(log q + g(seed, position)) for coupled rows.
        Returns (picked [A] int64, q [S, V] of the sampled/coupled rows or None, those rows)."""
        gst = [grammar_of(r) for r in group]
        if any(s is not None for s in gst):  # issue 14: draft from the grammar-masked q (same support as p)
            apply_grammar_to_draft_logits(logits, gst)
        picked = logits.argmax(-1)
        soft = [row for row, r in enumerate(group) if r.params.temperature > 0]
        q = None
        if soft:
            st = SamplingTensors.from_params([group[row].params for row in soft], logits.device)
            q = logits_to_probs(logits[soft], st.temperature, st.top_k, st.top_p, st.min_p)  # [S, V]
            sampled = [j for j, row in enumerate(soft) if not group[row].coupled]
            if sampled:
                u = h2d(torch.stack([torch.rand((), generator=group[soft[j]].generator) for j in sampled]), q.device)
                picked[[soft[j] for j in sampled]] = sample_from_probs(q[sampled], u)
            for j, row in enumerate(soft):
                r = group[row]
                if r.coupled:
                    n = drafted if isinstance(drafted, int) else drafted[row]
                    keys = keys_for(r.params.seed, r.num_tokens + n, 1, q.device)
                    picked[row] = coupled_scores(q[j: j + 1], keys).argmax(-1)[0]
        return picked, q, soft

    def _propose_on_device(self, requests: list[Request], ks: list[int], active: list[int]) -> DraftProposal:
        """Every draft step launched without a host round trip: a step's tokens go from its argmax / sample
        straight into the next step's input buffer. Every request drafts exactly k_i tokens (no confidence
        stopping, no grammar). The tokens stay on the device for the verification forward."""
        kv, dev = self.runner.kv, self.runner.device
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        steps: list[tuple[list[int], torch.Tensor]] = []  # per step: the drafting requests, their tokens [A]
        marks, first = Marks(dev), None
        step = 0
        # Steps 1.. of a batch drafting one k on CUDA graphs need no host preparation: the graph computes positions
        # and cache slots from the context lengths on the device (GraphRunner.run_uniform), the blocks for every
        # step are reserved up front and the host lengths are set once at the end.
        gr = self.runner.graphs
        uniform = (gr is not None and not self.shares_target_cache and len(active) > 0
                   and len({ks[i] for i in active}) == 1 and ks[active[0]] >= 2 and gr.bucket(len(active)) is not None)
        ctx, ctx0 = None, []
        while active:
            logits = None
            if step == 0:
                chunks = [Chunk(requests[i].req_id, requests[i].all_tokens[kv.length(requests[i].req_id):]) for i in active]
                fed = None
            elif uniform:
                if step == 1:
                    first = marks.mark()
                    ids = [requests[i].req_id for i in active]
                    ctx0 = [kv.length(rid) for rid in ids]
                    for rid, n in zip(ids, ctx0):
                        kv.reserve(rid, n + ks[active[0]] - 1)
                    self.runner.load_block_tables(ids)
                    ctx = h2d(ctx0, dev, torch.int64)
                logits = gr.run_uniform(steps[-1][1].view(-1, 1), ctx, 1, self.num_layers)
                ctx = ctx + 1
            else:
                chunks = [Chunk(requests[i].req_id, [0]) for i in active]  # placeholders: ids come from the device
                rows, prev = steps[-1]
                fed = (None, prev if rows == active else prev[h2d([rows.index(i) for i in active], dev, torch.int64)])
                if step == 1:
                    first = marks.mark()  # pure draft steps (one token each) from here
            if logits is None:
                logits = self.runner.forward(chunks, num_layers=self.num_layers, device_tokens=fed)[0].logits
            picked, q, soft = self._pick(logits, [requests[i] for i in active], step)
            steps.append((list(active), picked))
            for j, row in enumerate(soft):
                probs[active[row]].append(q[j])
            step += 1
            active = [i for i in active if step < ks[i]]
        if ctx0:  # the device-prepared steps wrote step - 1 tokens per request
            for i, n in zip(steps[0][0], ctx0):
                kv.set_length(requests[i].req_id, n + step - 1)
        timer = None
        if step >= 2:
            last, n = marks.mark(), step - 1
            timer = lambda: marks.seconds(first, last) / n  # noqa: E731
        lengths = [min(k, step) if k > 0 else 0 for k in ks]
        if steps:  # flat, in request order: request i's s-th draft is row rows_s.index(i) of step s
            offs, at = [], 0
            for rows, _ in steps:
                offs.append(at)
                at += len(rows)
            idx = [offs[s] + steps[s][0].index(i) for i in range(len(requests)) for s in range(lengths[i])]
            flat = torch.cat([p for _, p in steps])[h2d(idx, dev, torch.int64)]
        else:
            flat = torch.zeros(0, dtype=torch.int64, device=dev)
        return DraftProposal(None, [torch.stack(p) if p else None for p in probs], lengths=lengths,
                             device_tokens=flat, step_timer=timer)

    def _propose_on_host(self, requests: list[Request], ks: list[int], active: list[int]) -> DraftProposal:
        """Token by token through the host: confidence stopping and grammar matchers decide per token."""
        kv = self.runner.kv
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        step, step_times = 0, []
        while active:
            t_step = time.perf_counter()
            chunks = []
            for i in active:
                r = requests[i]
                feed = r.all_tokens[kv.length(r.req_id):] if step == 0 else [tokens[i][-1]]
                chunks.append(Chunk(r.req_id, feed))
            out, _ = self.runner.forward(chunks, num_layers=self.num_layers)
            group = [requests[i] for i in active]
            gst = [grammar_of(r) for r in group]
            logits = out.logits  # [A, V]
            picked, q, soft = self._pick(logits, group, [len(tokens[i]) for i in active])
            q_of = {row: j for j, row in enumerate(soft)}
            picked = picked.tolist()
            # confidence: the draft's top probability (of softmax(logits) for greedy rows)
            if self.confidence_threshold > 0:
                top = torch.softmax(logits.float(), -1).max(-1).values
                if q is not None:
                    top[soft] = q.max(-1).values
                top = top.tolist()
            else:
                top = [1.0] * len(group)
            still = []
            for row, i in enumerate(active):
                if top[row] < self.confidence_threshold:
                    continue  # DSpark: low confidence ends this request's draft here
                if gst[row] is not None and not gst[row].draft_accept(picked[row]):
                    continue  # issue 14: the grammar has ended (only a stop token was left)
                tokens[i].append(picked[row])
                if row in q_of:
                    probs[i].append(q[q_of[row]])
                if len(tokens[i]) < ks[i]:
                    still.append(i)
            if all(len(c.token_ids) == 1 for c in chunks):  # a pure draft step (no catch-up feeding)
                step_times.append(time.perf_counter() - t_step)  # .tolist() above has synchronised
            active, step = still, step + 1
        for r in requests:  # issue 14: grammar matchers back at the committed tokens
            if grammar_of(r) is not None:
                grammar_of(r).draft_end()
        # greedy requests: None (a point mass on each token, all a greedy verifier needs)
        return DraftProposal(tokens, [torch.stack(p) if p else None for p in probs],
                             step_seconds=sum(step_times) / len(step_times) if step_times else None)

    def rollback(self, request: Request, valid_len: int) -> None:
        kv = self.runner.kv
        if not self.shares_target_cache and kv.has(request.req_id) and kv.length(request.req_id) > valid_len:
            kv.truncate(request.req_id, valid_len)

    def release(self, request: Request) -> None:
        if not self.shares_target_cache:
            self.runner.kv.free(request.req_id, request.committed_prefix)

    def cached_length(self, request: Request) -> int | None:
        kv = self.runner.kv
        return kv.length(request.req_id) if kv.has(request.req_id) else 0


class DraftModelDrafter(ModelDrafter):
    """A separate small model sharing the target's tokenizer, with its own paged KV cache."""

    name = "draft-model"


class EarlyExitDrafter(ModelDrafter):
    """Self-speculation: the target's first n layers, then its final norm and head. It drafts through the
    target's own runner and cache: the keys it writes for layers < n at the draft positions are rewritten
    by the verification forward, and the cache length is restored after drafting."""

    name = "early-exit"

    def __init__(self, target_runner: ModelRunner, num_layers: int, confidence_threshold: float = 0.0) -> None:
        total = target_runner.config.num_layers
        if not 1 <= num_layers < total:
            raise ValueError(f"early-exit layers must be in 1..{total - 1}, got {num_layers}")
        super().__init__(target_runner, num_layers, confidence_threshold, shares_target_cache=True)
