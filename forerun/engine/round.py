"""One round over the scheduled requests: propose -> one target forward -> verify -> roll back.

Two implementations of one interface, chosen when the engine is built: `ChainRound` (k drafts per request,
k = 0 is plain decoding) and `TreeRound` (a draft tree per request, verified with a tree mask). A round may
mix, in one ragged forward, prefill chunks of requests still reading their prompt (`RoundItem.final`
False: no logits, nothing sampled), plain decode rows and verify rows (seed 000's layout allows it).

Rollback invariant (seed 003): at the top of a round a request's target cache holds a prefix of its
committed tokens; a final item feeds everything it misses (the newest token included) plus its drafts,
and afterwards the cache is truncated to base + fed + accepted, i.e. every committed token except the
newest. Draft caches are truncated to the same length or less; what they miss is fed on their next
proposal. Sampling, coins, the coupling and the choice of verifier live in `engine/sampler.py`.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..devices import Marks, h2d, kernels_on
from ..drafters.base import DraftProposal, Drafter, TreeProposal, subsequence_rows
from ..request import Request
from ..models.llama import ForwardOutput
from ..runtime.runner import Chunk, ModelRunner
from ..verify import tree_attention_mask
from ..structured import commit_emitted, cut_drafts, grammar_of, mask_request_rows_  # issue 14
from .sampler import RoundSampler, Verdict, _depths, is_coupled


@dataclass(frozen=True)
class RoundItem:
    """What one request does this round (the scheduler's decision)."""

    request: Request
    feed: int  # committed tokens the target reads this round (>= 1), from its cached length on
    final: bool  # `feed` reaches the newest committed token: sample the next one (and verify drafts)
    # drafts wanted (chain rounds; 0 = plain decoding); a tree round drafts a tree of at most k nodes beyond the root
    # when k > 0 (the drafter also keeps it no deeper than the request's tokens left: Engine._k_for, tree_depth_cap)
    k: int = 0


@dataclass
class RoundResult:
    """Per item, in order; non-final items emit nothing."""

    emitted: list[list[int]]
    num_drafted: list[int]
    num_accepted: list[int]
    logprobs: list[list[dict] | None]
    draft_step_seconds: float | None = None  # one draft step's measured time (None: not measured this round)
    target_seconds: float = 0.0
    draft_seconds: float = 0.0  # the whole drafting phase (catch-up included)
    target_tokens: int = 0
    sampled_rows: int = 0  # rows that were decode / verify rows (the cost model ignores prefill-heavy rounds)
    drafted_nodes: list[int] = field(default_factory=list)  # tree rounds: draft nodes per item (chain: = drafted)


class Round(ABC):
    def __init__(self, target: ModelRunner, drafter: Drafter | None, sampler: RoundSampler) -> None:
        """Phases are timed by device time points (CUDA events), read after the verification's sync."""
        self.target, self.drafter, self.sampler = target, drafter, sampler
        self.split_mixed: bool | None = None  # None: split mixed rounds when the target replays CUDA graphs
        self.split_rounds = 0  # rounds run as two forwards
        # pass prefill chunks on to the drafter this round (the engine clears it while adaptive k sits at 0: a
        # prompt is then fed to the drafter only if drafting resumes, by its catch-up, not on every arrival)
        self.feed_prefill = True
        # per request: whether its prompt chunks are passed on (None: all are); the engine's CPU path skips prompts
        # whose draft read would cost more than drafting can save over the answer (KPolicy.catch_up_pays)
        self.feed_filter: "Callable[[Request], bool] | None" = None

    @abstractmethod
    def run(self, items: list[RoundItem]) -> RoundResult: ...

    # -- shared steps ------------------------------------------------------------------------------
    def _feed_drafter(self, items: list[RoundItem]) -> None:
        """Pass prefill chunks on to a drafter with its own cache (no long catch-up left for later): every chunk
        of a prompt but a last one that drafts this round (its drafting feeds it). A prompt's last chunk read
        without drafts (prompts read alone, CUDA graphs) was left to the catch-up at the first round that drafted
        for it: cut as the target's length then asked (127 tokens of a 128-token prompt: 64 + 64, beside the
        others' steps), ~5 ms per join on the H200 at 4 requests against one shared replay here."""
        if self.drafter is None or not self.feed_prefill:
            return
        pre = [it for it in items if (not it.final or (it.feed > 1 and it.k == 0 and it.request.remaining > 1))
               and (self.feed_filter is None or self.feed_filter(it.request))]
        if pre:
            kv = self.target.kv
            self.drafter.feed([it.request for it in pre], [kv.length(it.request.req_id) + it.feed for it in pre])

    def _forward(self, chunks: list[Chunk], device_tokens=None):
        layers = self.drafter.target_hidden_layers if self.drafter is not None else ()
        return self.target.forward(chunks, hidden_layers=layers, device_tokens=device_tokens)

    def _forward_split(self, chunks: list[Chunk], feeds: list[int], device_drafts: torch.Tensor | None):
        """The round's target forward. On CUDA graphs a round mixing decode / verify rows (one new token plus k
        drafts each, the same k) with anything else (prefill chunks, a prompt's last chunk) runs as two
        forwards: the uniform rows replay their graph, the rest replays as pieces (`GraphRunner.forward_pieces`;
        eagerly past its replay cap); logits (and hidden states) are
        joined, uniform rows first. device_drafts: the drafts still on the device, flat in chunk order (they
        are the last len - feed tokens of each chunk).
        Returns (output, per chunk its first logits row, per chunk its first flat token row)."""
        lens = [len(c.token_ids) for c in chunks]
        uniform = [i for i, c in enumerate(chunks) if feeds[i] == 1 and c.logits == lens[i]]
        q = max(set(lens[i] for i in uniform), key=lambda n: sum(lens[i] == n for i in uniform)) if uniform else 0
        split = self.split_mixed
        if split is None:
            split = self.target.graphs is not None and q <= self.target.graphs.max_q_len
        groups = [list(range(len(chunks)))]
        if split and uniform:
            first = [i for i in uniform if lens[i] == q]
            rest = [i for i in range(len(chunks)) if i not in set(first)]
            if rest:
                groups = [first, rest]
                self.split_rounds += 1
        # device drafts: where each chunk's drafts sit in the flat device tensor
        d_at, at = [], 0
        for c, f in zip(chunks, feeds):
            d_at.append(at)
            at += len(c.token_ids) - f
        outs, starts, offsets = [], [0] * len(chunks), [0] * len(chunks)
        row0 = tok0 = 0
        for g in groups:
            sub = [chunks[i] for i in g]
            fed = None
            if device_drafts is not None:
                rows, src, t = [], [], 0
                for i in g:
                    n = lens[i] - feeds[i]
                    rows.extend(range(t + feeds[i], t + lens[i]))
                    src.extend(range(d_at[i], d_at[i] + n))
                    t += lens[i]
                if rows:
                    dev = self.target.device
                    fed = (h2d(rows, dev, torch.int64), device_drafts[h2d(src, dev, torch.int64)])
            o, st = self._forward(sub, fed)
            if g is not groups[-1]:  # a replay's outputs live in the graphs' shared pool: the next replay reuses it
                o = ForwardOutput(None if o.logits is None else o.logits.clone(),
                                  {layer: h.clone() for layer, h in o.hidden_states.items()})
            for j, i in enumerate(g):
                starts[i] = row0 + st[j]
                offsets[i] = tok0
                tok0 += lens[i]
            row0 += 0 if o.logits is None else o.logits.shape[0]
            outs.append(o)
        if len(outs) == 1:
            return outs[0], starts, offsets
        logits = [o.logits for o in outs if o.logits is not None and o.logits.shape[0]]
        hidden = {layer: torch.cat([o.hidden_states[layer] for o in outs]) for layer in outs[0].hidden_states}
        return ForwardOutput(torch.cat(logits) if len(logits) > 1 else logits[0], hidden), starts, offsets

    def _observe(self, items: list[RoundItem], out, bases: list[int], committed_rows: list[list[int]]) -> None:
        """Hand the target's hidden states of newly committed tokens to a feature-level drafter (EAGLE).
        committed_rows[i]: flat forward rows of item i's newly committed tokens, in position order."""
        if self.drafter is None or not self.drafter.target_hidden_layers:
            return
        states = []
        for rows in committed_rows:
            if not rows:
                states.append(None)
                continue
            idx = h2d(rows, self.target.device, torch.int64)
            states.append({layer: h[idx] for layer, h in out.hidden_states.items()})
        self.drafter.observe_target([it.request for it in items], states, bases)


class ChainRound(Round):
    def run(self, items: list[RoundItem]) -> RoundResult:
        kv = self.target.kv
        marks = Marks(self.target.device)  # device time points, read after the verification's sync
        # 1. Draft: up to k_i tokens for final items (prefill chunks get none; the drafter reads them along).
        t0 = marks.mark()
        self._feed_drafter(items)
        want = [it.k if it.final else 0 for it in items]
        finals = [i for i, it in enumerate(items) if it.final]
        drafts: list[list[int]] = [[] for _ in items]  # host tokens (placeholders while they are on the device)
        probs: list[torch.Tensor | None] = [None] * len(items)
        prop: DraftProposal | None = None
        if self.drafter is not None and any(want):
            prop = self.drafter.propose([items[i].request for i in finals], [want[i] for i in finals])
            for j, i in enumerate(finals):
                drafts[i] = prop.tokens[j] if prop.tokens is not None else [-1] * prop.lengths[j]
                probs[i] = prop.probs[j]
        on_device = prop is not None and prop.tokens is None
        # issue 14 (structured output): cut grammar-rejected draft tails, mask rows for every verify row
        # (grammar-constrained requests draft through the host, so their tokens are known here)
        gstates = [grammar_of(it.request) if it.final else None for it in items]
        gmasks: list = [None] * len(items)
        if any(s is not None for s in gstates):
            drafts, probs, gmasks = cut_drafts(gstates, drafts, probs)
        t1 = marks.mark()

        # 2. One target forward: the fed committed tokens + drafts; logits for the last k_i + 1 rows of final items.
        bases = [kv.length(it.request.req_id) for it in items]
        chunks = [Chunk(it.request.req_id, it.request.all_tokens[base: base + it.feed] + d,
                        logits=len(d) + 1 if it.final else 0) for it, base, d in zip(items, bases, drafts)]
        out, starts, offsets = self._forward_split(chunks, [it.feed for it in items],
                                                   prop.device_tokens if on_device else None)
        at = sum(len(c.token_ids) for c in chunks)
        t2 = marks.mark()

        # 3. Verify the final items (one entry for every rule).
        verdict = Verdict([], [], [])
        if any(m is not None for m in gmasks):  # issue 14: grammar-masked target logits (-inf) before any rule
            mask_request_rows_(out.logits, [gmasks[i] for i in finals], [starts[i] for i in finals])
        if finals:
            verdict = self.sampler.chain(out.logits, [items[i].request for i in finals], [drafts[i] for i in finals],
                                         [probs[i] for i in finals], [starts[i] for i in finals],
                                         device_drafts=prop.device_tokens if on_device else None)
            commit_emitted([gstates[i] for i in finals], verdict.emitted)  # issue 14: matchers follow commits
        emitted: list[list[int]] = [[] for _ in items]
        accepted, lps = [0] * len(items), [None] * len(items)
        for j, i in enumerate(finals):
            emitted[i], accepted[i], lps[i] = verdict.emitted[j], verdict.num_accepted[j], verdict.logprobs[j]

        # 4. Roll back both caches to everything committed except the newest token.
        committed_rows = []
        for i, it in enumerate(items):
            valid = bases[i] + it.feed + accepted[i]
            if it.final:
                kv.truncate(it.request.req_id, valid)
                if self.drafter is not None:
                    self.drafter.rollback(it.request, valid)
            committed_rows.append(list(range(offsets[i], offsets[i] + it.feed + accepted[i])))
        self._observe(items, out, bases, committed_rows)
        nd = [len(d) for d in drafts]
        step_s = prop.measured_step_seconds() if prop is not None else None
        draft_s, target_s = marks.seconds(t0, t1), marks.seconds(t1, t2)  # the verification has synchronised
        if step_s is None and self.drafter is not None and any(nd) and not self.drafter.times_steps:
            step_s = draft_s / max(nd)  # drafters without steps (n-gram): the whole cost per token
        return RoundResult(emitted, nd, accepted, lps, draft_step_seconds=step_s, target_seconds=target_s,
                           draft_seconds=draft_s, target_tokens=at,
                           sampled_rows=sum(n + 1 for n, it in zip(nd, items) if it.final), drafted_nodes=nd)


@dataclass
class _Preverify:
    """The next round's verify step, queued from this round's device verdict (`TreeRound._queue_verify`), and what
    it assumed: the same requests in the same order taking the prelaunched tree of n nodes each, each request's
    root (its newest committed position) where the host verdict put it (`expect`, set once the verdict is read),
    and no target graph replayed since (`replays`: its output lives in the graph's static memory)."""

    req_ids: tuple
    tree: object  # the prelaunched DeviceTree it verifies
    n: int
    out: ForwardOutput  # logits [B * n, V], hidden states [B * n, H]
    slots: torch.Tensor  # [B * n] the step's cache slots (node j of request b at its root + j)
    marks: Marks  # 0 -> 1: the verify step's device time
    replays: int
    expect: list[int] | None = None

    def matches(self, reqs: list[Request], pend, kv, replays: int) -> list[int] | None:
        """The rows of the step (one per request, in order) when the round can take it, else None: its requests
        are among those queued for (some may have finished), taking the prelaunched tree's rows of the same
        requests, each root where the host verdict put it."""
        if self.expect is None or replays != self.replays or pend.device is None or pend.device.n != self.n:
            return None
        rows = subsequence_rows([r.req_id for r in reqs], self.req_ids)
        if rows is None or pend.prelaunched is None or pend.prelaunched[0] is not self.tree \
                or pend.prelaunched[1] != rows:
            return None
        ok = all(r.num_tokens - 1 == self.expect[j] and kv.length(r.req_id) == self.expect[j]
                 for r, j in zip(reqs, rows))
        return rows if ok else None


class TreeRound(Round):
    """Target cache: the round writes [missing committed tokens before the root] + tree nodes; node j sits at
    cache position root + j while its RoPE position is root + depth(j). The accepted path's keys were computed
    at positions root + 1, root + 2, ... (depth = index on the path), so moving them there (`KVPool.move`) makes
    the cache exactly what a chain would have written; then it is truncated to root + accepted + 1.

    The common round (every request decoding, feed 1, trees of one node count, no grammar, a drafter with
    `propose_tree_async`) runs on the device from the drafted tree: token ids, RoPE positions and the tree mask
    of the verify step, the verification, the KV move of every accepted path and the gather of the committed
    rows' hidden states are queued without reading the device; the host reads the drafted tree and the verdict
    (each copied to the host as soon as it is made) once the verification is queued. Other rounds take the
    general path (host-built chunks).

    Overlapped rounds (CUDA graphs, greedy batches, a steady batch of two requests or more): once the drafter has
    queued the next round's drafting from the device verdict (`EagleDrafter.prelaunch`), the next round's verify
    step is queued too (`_queue_verify`): its
    ids, RoPE positions, cache slots and tree mask come from the verdict and the prelaunched tree on the device,
    so the device runs the next drafting and verify forward while the host reads this verdict and commits it.
    The next round uses it when its plan is the one assumed (`_Preverify.matches`), else drops it (its cache
    writes lie past every committed length: the round that runs instead overwrites them)."""

    # the smallest batch whose next verify step is queued ahead when `preverify` is None. From batch 4 it measured
    # 1-10 % faster (eagle_h200_session27.json). At batch 1 it measured 0-7 % slower while the round was bound by
    # the host (session 27) and within 1 % either way since (sessions 28-29); in session 31 it made batch-1 rounds
    # steady (5.70-5.73 / 5.90-5.91 / 6.24-6.26 ms over three runs, trees 4,3,8 / 1,4,5 / 4,4,16) where without it
    # they drifted by up to 5 % (5.66-6.03 / 5.88-6.09 / 6.19-6.42 ms), ~1 % faster on average
    # (eagle_h200_session31*.json)
    PREVERIFY_MIN_BATCH = 1
    # ... and a steady batch: a queued step is dropped when a request joins or the drafter's budget picks another
    # shape than it guessed, and a dropped step costs a whole verify forward against the ~5 % of a round a used one
    # saves; so the automatic choice queues one only while the share of recent rounds that kept the round before's
    # requests (or some of them) and its queued drafting (an exponential average, weight STEADY_DECAY on the past)
    # is at least PREVERIFY_STEADY
    PREVERIFY_STEADY = 0.95
    STEADY_DECAY = 0.9

    def __init__(self, target: ModelRunner, drafter: Drafter | None, sampler: RoundSampler) -> None:
        super().__init__(target, drafter, sampler)
        # None: on wherever drafting is prelaunched on the target's graphs, from PREVERIFY_MIN_BATCH requests on, in a
        # steady batch
        self.preverify: bool | None = None
        # the engine's veto (requests, accepted at most, nodes) -> bool: False when the next round will not be the
        # one assumed (arrivals waiting to join, a context limit near); without it only the prelaunch's checks apply
        self.lookahead: "Callable[[list[Request], int, int], bool] | None" = None
        self.preverify_stats = {"launched": 0, "used": 0, "discarded": 0, "partial": 0}  # (partial: see prelaunch_stats)
        self._pv: _Preverify | None = None
        self._last_ids: tuple | None = None
        self.steady = 1.0  # the exponential average of rounds with the round before's requests

    def run(self, items: list[RoundItem]) -> RoundResult:
        marks = Marks(self.target.device)
        t0 = marks.mark()
        ids = tuple(it.request.req_id for it in items)  # (a join is what drops a queued step; a prompt's chunk does not)
        kept = self._last_ids is None or subsequence_rows(ids, self._last_ids) is not None  # (some may have ended)
        self._last_ids = ids
        stats = getattr(self.drafter, "prelaunch_stats", None)
        dropped = stats["discarded"] if stats is not None else 0
        self._feed_drafter(items)
        trees = [i for i, it in enumerate(items) if it.final and it.k > 0]
        reqs = [items[i].request for i in trees]
        caps = [items[i].k for i in trees]  # drafts (nodes beyond the root) each tree may hold: what fits the request
        if (trees and len(trees) == len(items) and all(it.feed == 1 for it in items)
                and getattr(self.drafter, "supports_async_tree", False) and all(grammar_of(r) is None for r in reqs)):
            pend = self.drafter.propose_tree_async(reqs, caps)
            t1 = marks.mark()
            # steady: the batch kept its requests (or some of them) and the drafting queued for it was not dropped
            # (a budget whose look-ahead guessed another shape drops it, and the queued verify step with it)
            kept = kept and (stats is None or stats["discarded"] == dropped)
            self.steady = self.STEADY_DECAY * self.steady + (1 - self.STEADY_DECAY) * kept
            if pend.device is not None:
                return self._run_device(items, pend, marks, t0, t1)
            prop = pend.result()
        else:
            prop = self.drafter.propose_tree(reqs, caps) if trees else None
            t1 = marks.mark()
            self.steady = self.STEADY_DECAY * self.steady + (1 - self.STEADY_DECAY) * kept
        if self._pv is not None:  # (the round queued last time was for the device path)
            self._pv = None
            self.preverify_stats["discarded"] += 1
        return self._run_host(items, trees, prop, marks, t0, t1)

    # -- the device path -----------------------------------------------------------------------------
    def _run_device(self, items: list[RoundItem], pend, marks: Marks, t0: int, t1: int) -> RoundResult:
        kv, dev = self.target.kv, self.target.device
        tree = pend.device
        reqs = [it.request for it in items]
        b, n = len(reqs), tree.n
        roots = [r.num_tokens - 1 for r in reqs]  # feed 1: the cache holds everything before the root
        layers = self.drafter.target_hidden_layers
        graphs = self.target.graphs
        pv, self._pv = self._pv, None
        rows = None if pv is None else pv.matches(reqs, pend, kv, graphs.replays)
        ran = b * n  # target rows the verify forward ran
        if rows is not None:  # queued during the last round
            self.preverify_stats["used"] += 1
            for r, root in zip(reqs, roots):
                kv.set_length(r.req_id, root + n)  # (what the step wrote; its blocks were reserved then)
            out, slots, vmarks = pv.out, pv.slots.view(-1, n), pv.marks
            if len(rows) < slots.shape[0]:  # some of its requests finished since: the others' rows
                self.preverify_stats["partial"] += 1
                ran = slots.shape[0] * n  # (the forward ran over them all: not this batch's cost)
                flat = (h2d(rows, dev, torch.int64)[:, None] * n + torch.arange(n, device=dev)).reshape(-1)
                out = ForwardOutput(out.logits.index_select(0, flat),
                                    {layer: h.index_select(0, flat) for layer, h in out.hidden_states.items()})
                slots = slots.view(-1)[flat].view(b, n)
        else:
            if pv is not None:
                self.preverify_stats["discarded"] += 1
            # the verify step: placeholders laid out on the host (slots, lengths, tables), then ids, positions and
            # the tree mask from the device tree
            step = self.target.prepare([Chunk(r.req_id, [0] * n, logits=n) for r in reqs])
            step.input_ids.copy_(tree.tokens.reshape(-1))
            step.positions.copy_((h2d(roots, dev, torch.int64)[:, None] + tree.depth).reshape(-1))
            step = replace(step, meta=replace(step.meta, tree_mask=tree.mask.reshape(b * n, n)))
            out = (graphs if graphs is not None else self.target).execute(step, None, layers)
            slots, vmarks = step.meta.slot_mapping.view(b, n), None
        t2 = marks.mark()
        coupled = any(is_coupled(r, self.sampler.rule) for r in reqs)
        prop = pend.result() if coupled else None  # coupled requests key their rows by the nodes' depths
        rows = [n] * b
        starts = [i * n for i in range(b)]
        pending = self.sampler.tree_launch(
            out.logits, reqs, rows, starts, tree.tokens.reshape(-1), tree.parents.reshape(-1),
            None if tree.probs is None else (lambda: tree.probs.reshape(b * n, -1)),
            [_depths(p) for p in prop.parents] if coupled else None, layout=(tree.mask, tree.depth))
        # before the verdict is read: every accepted path's keys to root + 1.. (a path has at most max_depth
        # drafts; slots past it copy onto themselves) and the committed rows' hidden states gathered
        s = min(n - 1, tree.max_depth)
        nodes = pending.res.accepted_nodes[:, : s + 1]  # [b, s + 1], root first, -1 past the path
        pc = _path_kernels(dev)
        # (the kernels move a path's nodes in order of depth, in place: right because a tree's node ids increase
        # along every path, which every verdict's accepted_nodes keep, root first, -1 past the path)
        if pc is not None and nodes.dtype == torch.int64 and nodes.stride(1) == 1 and slots.dtype == torch.int64:
            pc.move_paths(kv.k, kv.v, slots, nodes, s)  # (one launch for ~8 small kernels, ...
            hidden = pc.gather_paths(out.hidden_states, nodes, n, s)  # ... one per layer for ~6)
        else:
            ar = torch.arange(s + 1, device=dev)
            nodes = torch.where(nodes >= 0, nodes, ar)
            kv.move(None, slots.gather(1, nodes[:, 1:]).reshape(-1), slots[:, 1: s + 1].reshape(-1))
            flat = (torch.arange(b, device=dev)[:, None] * n + nodes).reshape(-1)
            hidden = {layer: h[flat].view(b, s + 1, -1) for layer, h in out.hidden_states.items()}
        # overlap: the next round's drafting queued from the device verdict (EAGLE), so the device drafts while
        # the host reads the verdict, commits and prepares the next verify step; then that verify step itself
        feats = None if coupled else self.drafter.prelaunch(reqs, tree, pending.res, hidden, roots)
        if feats is not None:
            self._pv = self._queue_verify(reqs, roots, s, pending.res)
            pending.stale = self._pv is not None  # (the replay reuses this round's output memory)
        prop = pend.result()  # the drafting phase's host read (the draft is done; the verification runs)
        verdict, paths = self.sampler.tree_finish(pending, prop)
        accepted = verdict.num_accepted
        if self._pv is not None:
            self._pv.expect = [root + a + 1 for root, a in zip(roots, accepted)]
        for r, a, root in zip(reqs, accepted, roots):
            kv.truncate(r.req_id, root + a + 1)
            self.drafter.rollback(r, root + a + 1)
        if self.drafter.target_hidden_layers:
            self.drafter.observe_target_batch(reqs, hidden, [a + 1 for a in accepted], roots, features=feats)
        depth = [max(_depths(p)) for p in prop.parents]
        steps = max(depth, default=0)
        draft_s = pend.seconds() if pend.seconds is not None else marks.seconds(t0, t1)
        target_s = vmarks.seconds(0, 1) if vmarks is not None else marks.seconds(t1, t2)
        return RoundResult(verdict.emitted, depth, accepted, verdict.logprobs,
                           draft_step_seconds=draft_s / steps if steps else None, target_seconds=target_s,
                           draft_seconds=draft_s, target_tokens=ran, sampled_rows=b * n,
                           drafted_nodes=[len(t) - 1 for t in prop.tokens])

    def _preverify_on(self, batch: int) -> bool:
        if self.preverify is not None:
            return self.preverify
        return (batch >= self.PREVERIFY_MIN_BATCH and self.steady >= self.PREVERIFY_STEADY
                and os.environ.get("FORERUN_EAGLE_PREVERIFY", "1") != "0")

    def _queue_verify(self, reqs: list[Request], roots: list[int], s: int, res) -> _Preverify | None:
        """Queue the next round's verify step from this round's device verdict (res: num_accepted [B],
        output_token_ids [B, n]: the accepted drafts then the bonus token) and the tree the drafter has just
        prelaunched: request i's next root is the bonus token at roots[i] + a_i + 1, its nodes' keys go to the cache
        positions after it. None when it would not be the next round's (see `_Preverify`): off, no graphs, a request
        wanting logprobs, the engine's veto, no bucket, too few blocks (a request too near its end for an uncapped
        tree got no prelaunch, and so no queued step)."""
        graphs, kv = self.target.graphs, self.target.kv
        # (the prelaunch already checked that no request's end cuts the next tree: its depth is what an end cuts)
        pre = self.drafter.prelaunched() if self._preverify_on(len(reqs)) and graphs is not None else None
        if pre is None or any(r.params.logprobs is not None for r in reqs):
            return None
        tree, n = pre
        b = len(reqs)
        if n < 2 or n > graphs.max_q_len or graphs.bucket(b) is None:
            return None
        if self.lookahead is not None and not self.lookahead(reqs, s, n):
            return None
        ends = [root + s + 1 + n for root in roots]  # the next root is at most roots + s + 1
        need = sum(max(0, -(-e // kv.block_size) - len(kv.blocks(r.req_id))) for r, e in zip(reqs, ends))
        if kv.num_free_blocks < need + b:  # (a spare block per request for the scheduler's own reservations)
            return None
        for r, e in zip(reqs, ends):
            kv.reserve(r.req_id, e)
        with torch.inference_mode():
            vmarks = Marks(self.target.device)
            vmarks.mark()
            # node 0: the bonus token at roots[i] + a_i + 1; nodes 1..n - 1: the prelaunched tree's drafts
            out, slots = graphs.replay_tree(res.output_token_ids, res.num_accepted, roots, [r.req_id for r in reqs],
                                            tree.tokens, tree.depth[:, :n], tree.mask[:, :n, :n],
                                            self.drafter.target_hidden_layers)
            vmarks.mark()
        self.preverify_stats["launched"] += 1
        return _Preverify(tuple(r.req_id for r in reqs), tree, n, out, slots, vmarks, graphs.replays)

    # -- the general path ----------------------------------------------------------------------------
    def _run_host(self, items: list[RoundItem], trees: list[int], prop: TreeProposal | None, marks: Marks,
                  t0: int, t1: int) -> RoundResult:
        kv = self.target.kv
        # a tree of the root alone (the drafter had nothing to add) is a plain decoding row
        tree_of = {i: j for j, i in enumerate(trees) if len(prop.tokens[j]) > 1}
        bases = [kv.length(it.request.req_id) for it in items]
        chunks, offsets, at = [], [], 0
        for i, (it, base) in enumerate(zip(items, bases)):
            r = it.request
            toks = r.all_tokens[base: base + it.feed]
            if i in tree_of:  # catch-up tokens causal; nodes see them and their ancestors
                j = tree_of[i]
                nodes, parents = prop.tokens[j], prop.parents[j]
                catch = toks[:-1]  # the root (newest committed token) is node 0
                c, n = len(catch), len(nodes)
                depth = _depths(parents)
                full = torch.zeros(c + n, c + n, dtype=torch.bool)
                full[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
                full[c:, :c] = True
                full[c:, c:] = _tree_mask(parents)
                root = r.num_tokens - 1
                chunks.append(Chunk(r.req_id, catch + nodes, positions=list(range(root - c, root)) + [root + d for d in depth],
                                    tree_mask=full, logits=n))
            else:
                chunks.append(Chunk(r.req_id, toks, logits=1 if it.final else 0))
            offsets.append(at)
            at += len(chunks[-1].token_ids)
        out, starts = self._forward(chunks)
        t2 = marks.mark()
        # issue 14 (structured output): a mask per tree node / plain row, then the matchers follow the commits
        gstates = {i: grammar_of(it.request) for i, it in enumerate(items) if it.final}
        gstates = {i: s for i, s in gstates.items() if s is not None}
        if gstates:
            gm = [s.tree_masks(prop.tokens[tree_of[i]], prop.parents[tree_of[i]])[1] if i in tree_of
                  else s.draft_masks([])[1] for i, s in gstates.items()]
            mask_request_rows_(out.logits, gm, [starts[i] for i in gstates])

        emitted: list[list[int]] = [[] for _ in items]
        accepted, lps, nd = [0] * len(items), [None] * len(items), [0] * len(items)
        committed_rows: list[list[int]] = [[] for _ in items]
        kept = list(tree_of)
        if kept:
            sub = TreeProposal([prop.tokens[tree_of[i]] for i in kept], [prop.parents[tree_of[i]] for i in kept],
                               [prop.probs[tree_of[i]] for i in kept])
            verdict, paths = self.sampler.tree(out.logits, [items[i].request for i in kept], sub,
                                               [starts[i] for i in kept])
            for j, i in enumerate(kept):
                r, a, path = items[i].request, verdict.num_accepted[j], paths[j]
                emitted[i], accepted[i], lps[i] = verdict.emitted[j], a, verdict.logprobs[j]
                nd[i] = len(sub.tokens[j]) - 1
                root = r.num_tokens - 1
                kv.move(r.req_id, [root + n for n in path[1: a + 1]], [root + m for m in range(1, a + 1)])
                kv.truncate(r.req_id, root + a + 1)
                self.drafter.rollback(r, root + a + 1)
                c = items[i].feed - 1
                committed_rows[i] = list(range(offsets[i], offsets[i] + c + 1)) + [offsets[i] + c + n for n in path[1: a + 1]]
        plain = [i for i, it in enumerate(items) if it.final and i not in tree_of]
        if plain:  # final items without a tree (no room for one): plain decoding rows
            verdict = self.sampler.chain(out.logits, [items[i].request for i in plain], [[] for _ in plain],
                                         [None] * len(plain), [starts[i] for i in plain])
            for j, i in enumerate(plain):
                emitted[i], lps[i] = verdict.emitted[j], verdict.logprobs[j]
                if self.drafter is not None:
                    self.drafter.rollback(items[i].request, bases[i] + items[i].feed)
        if gstates:  # issue 14
            commit_emitted(list(gstates.values()), [emitted[i] for i in gstates])
        for i, it in enumerate(items):
            if i not in tree_of:
                committed_rows[i] = list(range(offsets[i], offsets[i] + it.feed))
        self._observe(items, out, bases, committed_rows)
        depth = [max(_depths(prop.parents[tree_of[i]])) if i in tree_of else 0 for i in range(len(items))]
        steps = max(depth, default=0)
        draft_s, target_s = marks.seconds(t0, t1), marks.seconds(t1, t2)
        return RoundResult(emitted, depth, accepted, lps,
                           draft_step_seconds=draft_s / steps if steps else None, target_seconds=target_s,
                           draft_seconds=draft_s, target_tokens=at, sampled_rows=sum(len(c.token_ids) for c, it in zip(chunks, items) if it.final),
                           drafted_nodes=nd)


def _path_kernels(device: torch.device):
    """forerun/kernels/path_commit.py where it runs: on CUDA by default (FORERUN_PATH_KERNELS=0 keeps the torch ops,
    =1 uses the kernels elsewhere too, e.g. the CPU under Triton's interpreter); else None."""
    if not kernels_on("FORERUN_PATH_KERNELS", device):
        return None
    from ..kernels import path_commit
    return path_commit


def _tree_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: node i sees j iff j is i or an ancestor of i (forerun.verify's tree_attention_mask)."""
    n = len(parents)
    return tree_attention_mask(torch.tensor(parents), torch.tensor([0]), torch.tensor([n]), n)
