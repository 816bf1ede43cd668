"""The request scheduler: which requests run this step, and what each one feeds.

Waiting and running queues, first come first served. Each step:

1. Running requests past their prefill decode or verify: 1 token + their drafts (k from the draft-length
   policy, engine/k_policy.py, which is a separate concern).
2. Running requests still reading their prompt get the next chunk of it under the step's token budget
   (chunked prefill: a long prompt never stalls the others' decode and verify rows).
3. Waiting requests are admitted in order while the batch has seats, the budget has tokens and the pools
   have the blocks their first chunk needs *now* (not their lifetime worst case).
4. If the pools cannot hold this step's tokens, the newest running request is preempted by recompute: its
   blocks (target and draft) go back and it returns to the front of the waiting queue; when admitted again
   it re-reads prompt + committed output and continues where it was, with the same output (greedy, and
   seeded requests through the position-keyed coupling).
A request that could never fit (alone, the pool cannot hold it) fails on its own; the others carry on.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..drafters.base import Drafter
from ..kvcache.pool import KVPool
from ..request import Request
from .round import RoundItem


@dataclass
class SchedulerOutput:
    items: list[RoundItem] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv: KVPool, drafter: Drafter | None, max_num_seqs: int, max_num_batched_tokens: int,
                 tree: bool = False) -> None:
        """tree: k is a tree's node count beyond its root (the whole tree, or one cut to fit its request:
        `Engine._k_for`), drafted all or nothing within the token budget; a chain's k drafts are cut to fit."""
        self.kv, self.drafter, self.tree = kv, drafter, tree
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # draft in the round that feeds a prompt's last chunk (feed > 1). On CUDA graphs the engine turns this off:
        # a prompt without drafts is a prefill chunk that replays as graph pieces, while a prompt plus drafts wants
        # logits for several rows of a long chunk and would run eagerly (~20-60 ms for an 8B model)
        self.draft_prefill = True

    # -- queues ----------------------------------------------------------------------------------------
    def add(self, r: Request) -> None:
        self.waiting.append(r)

    def remove(self, r: Request) -> None:
        """Take a request out (finished, aborted or failed) and give its blocks back at once."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self._free(r)

    def _free(self, r: Request) -> None:
        self.kv.free(r.req_id, r.committed_prefix)  # (prefix caching: what later prompts may share)
        if self.drafter is not None:
            self.drafter.release(r)

    def admit_head(self) -> Request:
        """Admit the head of the waiting queue without scheduling its prompt's read (the caller reads it: a prompt
        joining an overlapped session in the members' verify forward). Its blocks are reserved by that read."""
        r = self.waiting.popleft()
        r.prompt_shared = 0
        self.kv.add_sequence(r.req_id)
        self.running.append(r)
        return r

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _missing(self, r: Request) -> int:
        """Committed tokens the target cache lacks (1 in steady state: the newest)."""
        return r.num_tokens - (self.kv.length(r.req_id) if self.kv.has(r.req_id) else 0)

    # -- one step --------------------------------------------------------------------------------------
    def schedule(self, k_for: Callable[[list[Request]], list[int]], prefill_only: bool = False,
                 exclude: frozenset[int] | set[int] = frozenset(), admit: Callable[[Request], bool] | None = None,
                 preempt: bool = True) -> SchedulerOutput:
        """k_for(requests) -> drafts per request (capped by room) for the requests that sample this step.
        prefill_only: running requests past their prefill sit this step out (a round of prompts alone).
        exclude: running requests left out of this step (the members of an overlapped session, whose host-side
        cache lengths lag while it runs); admit(request): waiting requests are admitted in order while it holds;
        preempt=False: a step the pools cannot hold takes nothing instead of preempting (a session's members hold
        their blocks)."""
        out = SchedulerOutput()
        if self.kv.prefix_caching:
            self._share_read_prompts()
        while True:
            items = self._plan(k_for, prefill_only, exclude)
            need_t, need_d = self._blocks(items)
            if need_t <= self.kv.num_free_blocks and need_d <= self._draft_free():
                break
            if not preempt:
                return out
            # not enough blocks for this step: preempt the newest running request (recompute later)
            victim = self.running[-1] if self.running else None
            if victim is None:
                break
            if len(self.running) == 1:  # alone and still too big: it can never run
                short = need_t > self.kv.num_free_blocks  # the target's pool, else the drafter's own
                pool, kv = ("pool", self.kv) if short else ("drafter's pool", self.drafter.kv)
                out.failed.append((victim, f"request {victim.external_id or victim.req_id} needs more KV blocks than the "
                                           f"{pool} has ({kv.num_blocks - 1} blocks of {kv.block_size} tokens); "
                                           "raise the KV memory budget or lower max_tokens"))
                self.remove(victim)
                continue
            self.running.pop()
            self._free(victim)
            victim.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(victim)
            out.preempted.append(victim)
        out.items = items
        if out.preempted:  # no admissions in a step that had to take blocks back
            return out
        # admit waiting requests with what is left of the budget and the pools
        left = self.budget - sum(it.feed + it.k for it in items)
        need_t, need_d = self._blocks(items)
        free_t, free_d = self.kv.num_free_blocks - need_t, self._draft_free() - need_d
        while self.waiting and len(self.running) < self.max_num_seqs and left > 0:
            r = self.waiting[0]
            if admit is not None and not admit(r):
                break
            hit = taken = dtaken = 0
            dkv = self.drafter.kv if self.drafter is not None else None
            if self.kv.prefix_caching:  # its cached prefix joins its tables now (undone below if it does not fit)
                cap = None
                if self.drafter is not None:  # the drafter's own cached prefix first: it may bound the target's
                    dfree0 = dkv.num_free_blocks if dkv is not None else 0
                    cap = self.drafter.attach_prefix(r)
                    dtaken = dfree0 - dkv.num_free_blocks if dkv is not None else 0
                free0 = self.kv.num_free_blocks
                hit = self.kv.add_sequence(r.req_id, r.all_tokens,
                                           limit=None if cap is None else min(cap, r.num_tokens - 1))
                taken = free0 - self.kv.num_free_blocks  # (cached blocks nobody held count as free until taken)
            missing = r.num_tokens - hit
            feed = min(missing, left)
            final = feed == missing
            k = 0
            if final and self.drafter is not None and (feed == 1 or self.draft_prefill):
                k = self._fit(k_for([r])[0], left - feed)
            extra = k  # (a tree's k: its nodes beyond the root, the rows it adds)
            held = len(self.kv.blocks(r.req_id)) if hit or taken else 0
            blocks = taken + max(0, -(-(hit + feed + extra) // self.kv.block_size) - held)
            dblocks = 0
            if dkv is not None:
                dheld = len(dkv.blocks(r.req_id)) if dtaken or dkv.has(r.req_id) else 0
                dblocks = dtaken + max(0, -(-(hit + feed + extra + 1) // dkv.block_size) - dheld)
            if blocks > free_t or dblocks > free_d:
                if self.kv.prefix_caching:
                    self.kv.free(r.req_id)
                    if self.drafter is not None:
                        self.drafter.release(r)
                if not self.running and not items:  # nothing runs and it cannot start: it never will
                    self.waiting.popleft()
                    out.failed.append((r, f"request {r.external_id or r.req_id}: prompt of {missing} tokens needs "
                                          f"{blocks} KV blocks, the pool has {self.kv.num_free_blocks}; raise the KV "
                                          "memory budget"))
                    continue
                break
            self.waiting.popleft()
            r.prompt_shared = 0  # (a preempted request lends its blocks again once it has read them again)
            if self.kv.prefix_caching:
                if r.num_preemptions == 0:
                    r.stats.cached_tokens = min(hit, len(r.prompt_token_ids))
            else:
                self.kv.add_sequence(r.req_id)
            self.running.append(r)
            items.append(RoundItem(r, feed, final, k))
            left -= feed + k
            free_t -= blocks
            free_d -= dblocks
        out.items = items
        return out

    def _share_read_prompts(self) -> None:
        """Prefix caching: a running request whose prompt is read lends its prompt's blocks (all but the last token:
        no rollback reaches them) to requests that arrive while it runs, in the target pool and the draft's."""
        dkv = self.drafter.kv if self.drafter is not None else None
        pools = ((1, self.kv, None),) if dkv is None else ((1, self.kv, None), (2, dkv, self.drafter))
        for r in self.running:
            n = len(r.prompt_token_ids) - 1
            for bit, kv, d in pools:  # (d: the drafter, which names its own pool's positions)
                if r.prompt_shared & bit or not kv.has(r.req_id):
                    continue
                if kv.length(r.req_id) >= n - (d.prefix_shift if d else 0):
                    prompt = r.prompt_token_ids[:n]
                    kv.share_prefix(r.req_id, prompt if d is None else d.prefix_key(prompt))
                    r.prompt_shared |= bit

    def _plan(self, k_for, prefill_only: bool = False, exclude=frozenset()) -> list[RoundItem]:
        """Items for the running requests: decodes / verifies first, then prefill chunks, within the budget."""
        left = self.budget
        running = [r for r in self.running if r.req_id not in exclude]
        steady = [] if prefill_only else [r for r in running if self._missing(r) == 1]
        ks = k_for(steady) if steady else []
        items: list[RoundItem] = []
        for r, k in zip(steady, ks):
            if left < 1:
                break
            k = self._fit(k, left - 1)
            items.append(RoundItem(r, 1, True, k))
            left -= 1 + k
        for r in running:
            missing = self._missing(r)
            if missing == 1 or left <= 0:
                continue
            feed = min(missing, left)
            final = feed == missing
            drafts = final and self.drafter is not None and (feed == 1 or self.draft_prefill)
            k = self._fit(k_for([r])[0], left - feed) if drafts else 0
            items.append(RoundItem(r, feed, final, k))
            left -= feed + k
        return items

    def _fit(self, k: int, room: int) -> int:
        """Drafts that fit `room` tokens of the budget: a chain is cut, a tree (k nodes) is all or nothing."""
        if self.tree:
            return k if k <= room else 0
        return max(0, min(k, room))

    def _blocks(self, items: list[RoundItem]) -> tuple[int, int]:
        """Blocks this step needs beyond what the requests hold: (target pool, draft pool)."""
        bs, t, d = self.kv.block_size, 0, 0
        dkv = self.drafter.kv if self.drafter is not None else None
        for it in items:
            r = it.request
            base = self.kv.length(r.req_id) if self.kv.has(r.req_id) else 0
            tokens = base + it.feed + it.k  # (a tree: node j at cache position root + j, j <= k)
            have = len(self.kv.blocks(r.req_id)) if self.kv.has(r.req_id) else 0
            t += max(0, -(-tokens // bs) - have)
            if dkv is not None and (it.k or not it.final or it.feed > 1):  # (a prompt's last chunk too: the
                # drafter reads it in its round, Round._feed_drafter, drafts or not)
                d += self.drafter.blocks_needed(r, base + it.feed + it.k + 1)
        return t, d

    def _draft_free(self) -> int:
        dkv = self.drafter.kv if self.drafter is not None else None
        return dkv.num_free_blocks if dkv is not None else 1 << 62
