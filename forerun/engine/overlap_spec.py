"""Overlapped speculative rounds: the device runs round n+1 while the host commits round n.

A speculative round otherwise ends with a host read of the verdict, and the device idles while the host
commits it (stop checks, detokenisation, the k policy) and prepares the next round: ~1.3 ms of an ~11 ms round
at 4 requests on the H200 (issue 9, item 6; `online_h200_profile8_c4_k4.txt`). Here every input of the next
round is computed on the device from the verdict before it is read (seed 000's zero-overhead scheduling, as
engine/overlap.py does for plain decoding):

* per request, the target's cached length L (every committed token but the newest) and the last two
  committed tokens live on the device;
* draft step 0 feeds those two tokens at positions L - 1 and L (re-feeding L - 1 rewrites a position the draft
  holds with the same token, so the step has one shape whether the last round accepted everything or not);
  steps 1..k-1 feed one draft each; the verify feeds [newest token, d_1..d_k] at L..L+k. All of them are
  `GraphRunner.run_uniform` steps: positions and cache slots come from L inside the CUDA graph;
* greedy verification on the device: the target's argmax per row, accepted = the leading drafts equal to it;
  then L += accepted + 1 and the two newest tokens are updated on the device.

The host reserves cache blocks two rounds ahead and commits a round while the next one runs. Exactness: the
verdict is the greedy rule's (argmax, first index on ties, as plain decoding), so output equals the ordinary
rounds' token for token. A request that finishes (stop token / string, max_tokens) leaves the session between two
rounds (`regroup`, with `Engine.JOIN_IN_SESSION`, the default; without it, it ends the session); the round in
flight is still committed for the others (its inputs were theirs), and the host lengths are set back to the
rollback invariant (target: every committed token but the newest; draft: a prefix of that).

Scope: a separate draft model (ModelDrafter, own cache, no confidence stop), CUDA graphs on both runners (or
their eager stand-ins in tests), one k >= 1 for the batch, every request greedy, past its prefill, without
grammar, logprobs or golden tokens. Elsewhere the engine runs ordinary rounds.
"""
from __future__ import annotations

from typing import Callable, Generator

import torch

from ..devices import Marks, h2d, to_host_async
from ..kvcache.pool import OutOfBlocks
from ..request import Request
from .sampler import RoundSampler, forcing


def samples_in_scope(r: Request) -> bool:
    """Whether a request samples as the sessions do: greedy, no logprobs, grammar or golden tokens."""
    p = r.params
    return p.temperature == 0 and p.logprobs is None and getattr(r, "grammar", None) is None and not forcing(r)


def spec_overlap_applies(target, drafter, requests: list[Request], k: int, limit: int) -> bool:
    """Whether a session of overlapped speculative rounds may start for these requests at this k."""
    gr = target.graphs
    druns = getattr(drafter, "runner", None)
    dgr = getattr(druns, "graphs", None)
    if gr is None or dgr is None or druns is target or getattr(drafter, "shares_target_cache", True):
        return False
    if getattr(drafter, "confidence_threshold", 1.0) > 0 or not requests or k < 1:
        return False
    b = len(requests)
    if gr.bucket(b) is None or dgr.bucket(b) is None or k + 1 > gr.max_q_len or dgr.max_q_len < 2:
        return False
    return all(request_in_scope(target.kv, r, k, limit) for r in requests)


def request_in_scope(kv, r: Request, k: int, limit: int) -> bool:
    """Whether one request may take part in a session at this k: greedy and in scope, its prompt read (the target
    cache holds every committed token but the newest), unfinished, room for two rounds in its context."""
    if not samples_in_scope(r) or r.num_tokens < 2 or kv.length(r.req_id) != r.num_tokens - 1:
        return False
    return not r.finished and r.num_tokens + 2 * (k + 1) + 1 < limit  # (near max_tokens is fine: see room())


def _enter(drafter, requests: list[Request]) -> None:
    """Bring the draft cache of requests entering a session to a prefix reaching position L - 2 (step 0 feeds
    L - 1 and L, re-feeding L - 1 with the token the draft holds there)."""
    drafter.feed(requests, [r.num_tokens - 2 for r in requests])
    dkv = drafter.runner.kv
    for r in requests:
        dkv.truncate(r.req_id, min(dkv.length(r.req_id), r.num_tokens - 2))


def overlapped_spec_rounds(target, drafter, requests: list[Request], k: int, limit: int,
                           commit: Callable[[Request, list[int], int], int],
                           verdict: Callable | None = None,
                           should_stop: Callable[[], bool] | None = None,
                           max_rounds: int | None = None,
                           timing: Callable[[int, float, float, int], None] | None = None,
                           next_k: Callable[[], int] | None = None,
                           regroup: Callable[[list[Request], Callable[[], None], int], list[Request]] | None = None
                           ) -> Generator[int, None, int]:
    """Speculative rounds for `requests` with one round in flight, the first drafting k tokens. Yields the tokens
    committed per round; returns the number of rounds launched. commit(request, tokens, accepted, k) commits one
    round's tokens (stop checks included) and returns how many it took. verdict(logits, drafts) -> (tokens,
    accepted): the verification rule (default `RoundSampler.device_verdict`, greedy; the engine passes its own
    sampler's, which benchmarks replace with synthetic acceptance). Stops when should_stop()
    says so, max_rounds rounds were launched, or another round could pass a request's limits. next_k(): asked
    before every launch after the first, the k of that round (the device-side state, L and the two newest tokens,
    does not depend on k, so k may change from round to round); 0, or a k without a verify step of its length,
    ends the session. Without it every round drafts k.

    Membership. Without regroup, the session ends once a request has finished (the round in flight is committed
    for the others). With it, regroup(members, settle, k) (k: the last round's) is called before every launch
    after the first and returns the members of the next round: the caller drops finished requests (they already
    have their last tokens; the round in flight still carries their rows, skipped at its commit) and adds
    newcomers whose prompt it has read (target cache = every committed token but the newest, in the session's
    scope), calling settle() first (it waits for the round in flight, so the prompt's forward runs on an idle
    device as between sessions). Their
    draft caches are brought up here and their rows join the device-side state; an empty list ends the session.
    A join costs one round that is not overlapped, not the session's end and a restart (the others' draft
    catch-up and a first round that nothing overlaps). regroup must not change the list it is given.

    timing(k, draft_seconds, verify_seconds, batch): each committed round's k draft steps and verify forward, timed
    in stream order (CUDA events, read once the round's verdict is on the host): the k policy's cost model."""
    verdict = verdict or RoundSampler().device_verdict
    tkv, dkv = target.kv, drafter.runner.kv
    gr, dgr = target.graphs, drafter.runner.graphs
    dev = target.device
    members = list(requests)
    _enter(drafter, members)
    host_len = {r.req_id: r.num_tokens - 1 for r in members}  # L per request, as committed on the host
    L = h2d([host_len[r.req_id] for r in members], dev, torch.int64)  # [B] on the device
    last2 = h2d([r.all_tokens[-2:] for r in members], dev, torch.int64)  # [B, 2]
    everyone = {r.req_id: r for r in members}  # every request that took part (the rollback at the end)
    reading: list[Request] = []  # a newcomer whose prompt the next launch reads (run_uniform_join)

    def reserve(kk: int, ahead: int) -> None:
        """Blocks for the round in flight (`ahead` tokens) and this one past what the host has committed; the
        block-table rows follow."""
        ids = [r.req_id for r in members]
        for kv, runner in ((tkv, target), (dkv, drafter.runner)):
            for rid in ids:
                kv.reserve(rid, host_len[rid] + ahead + kk + 1)
            runner.load_block_tables(ids)

    def launch(kk: int, ahead: int):
        nonlocal L, last2, members
        rd = reading[0] if reading else None
        try:
            reserve(kk, ahead)
            if rd is not None:  # (its draft blocks too: the draft's read below must not run out of them)
                tkv.reserve(rd.req_id, rd.num_tokens)
                if not dkv.has(rd.req_id):
                    dkv.add_sequence(rd.req_id)
                dkv.reserve(rd.req_id, rd.num_tokens - 1)
        except OutOfBlocks:  # the pools ran out: the ordinary rounds preempt (a joiner not read: they read it)
            return None
        b = len(members)
        rows = torch.arange(b, device=dev)
        marks = Marks(dev) if timing is not None else None
        if marks is not None:
            marks.mark()
        # a joining prompt is read by the draft in this round's first draft step (one weight stream with the
        # members' rows) where a join graph holds it, else after the verify forward (drafter.feed below): a
        # separate read replayed its pieces after the verify and cost the next round ~2.7 ms at 4 requests on the
        # H200 (a steady round: 8.2 ms)
        dread = None if rd is None else rd.all_tokens[dkv.length(rd.req_id): rd.num_tokens - 1]
        if dread and dgr.join_len(b, len(dread)) is not None:
            logits, _ = dgr.run_uniform_join(last2, L - 1, 1, rd.req_id, dread, dkv.length(rd.req_id),
                                             drafter.num_layers)  # [B, V]: the members' rows
            dkv.set_length(rd.req_id, rd.num_tokens - 1)  # (the host's record: what the graph wrote)
        else:
            logits = dgr.run_uniform(last2, L - 1, 1, drafter.num_layers)  # [B, V]: feeds L - 1, L
        drafts = [logits.argmax(-1)]
        for j in range(1, kk):
            logits = dgr.run_uniform(drafts[-1].view(b, 1), L + j, 1, drafter.num_layers)
            drafts.append(logits.argmax(-1))
        d = torch.stack(drafts, 1)  # [B, kk]
        if marks is not None:
            marks.mark()
        verify_in = torch.cat([last2[:, 1:], d], 1)  # [B, kk+1]
        if rd is None:
            logits = gr.run_uniform(verify_in, L, kk + 1)  # [B * (kk+1), V]
        else:  # a joining prompt read in the same forward: [B * (kk+1), V] and its last row [1, V]
            ctx = tkv.length(rd.req_id)
            logits, jlogits = gr.run_uniform_join(verify_in, L, kk + 1, rd.req_id, rd.all_tokens[ctx:], ctx)
        if marks is not None:
            marks.mark()
        tokens, accepted = verdict(logits, d)
        prev = torch.where(accepted > 0, d[rows, (accepted - 1).clamp(min=0)], last2[:, 1])
        start = L.clone()
        last2 = torch.stack([prev, tokens[rows, accepted]], 1)
        L = L + accepted + 1
        rows_out = torch.cat([tokens, accepted.view(b, 1), start.view(b, 1)], 1)  # [B, kk + 3]
        reqs = list(members)
        if rd is not None:  # its first token (greedy, as every session's verdict); it is a member from now on
            n = rd.num_tokens
            first = jlogits.argmax(-1)  # [1]
            row = torch.cat([first, first.new_zeros(kk), h2d([0, n - 1], dev, torch.int64)])  # accepted 0, L n - 1
            rows_out = torch.cat([rows_out, row.view(1, kk + 3)])
            last2 = torch.cat([last2, torch.stack([h2d([rd.last_token], dev, torch.int64), first], 1)])
            L = torch.cat([L, h2d([n], dev, torch.int64)])
        out, done = to_host_async(rows_out)  # (queued before the draft's read below: the commit does not wait on it)
        if rd is not None:
            # the draft reads it now unless its first step did (after this round's draft steps, which read the
            # members' block-table rows its forward overwrites; the next launch loads them again): all but its
            # newest committed token once its first is in, the prefix step 0 of its first round expects (_enter)
            drafter.feed([rd], [n - 1])
            host_len[rd.req_id] = n - 1  # (its round commits one token: L = n)
            everyone[rd.req_id] = rd
            members = members + [rd]
            reqs.append(rd)
            reading.clear()
            marks = None  # (the prompt's rows are not a verify step's cost: not timed for the k policy)
        return out, done, marks, kk, reqs, rd

    def change(new: list[Request]) -> None:
        """The device-side state follows a new membership: rows of those who stay (in order), then newcomers'."""
        nonlocal L, last2, members
        row = {r.req_id: i for i, r in enumerate(members)}
        stay = [r for r in new if r.req_id in row]
        joining = [r for r in new if r.req_id not in row]
        if [r.req_id for r in stay] != [r.req_id for r in members]:
            keep = h2d([row[r.req_id] for r in stay], dev, torch.int64)
            L, last2 = L[keep], last2[keep]
        # a newcomer whose prompt is not read yet (it misses more than its newest token) is read in the next
        # round's verify forward (run_uniform_join), not before it: it joins the members at that launch
        unread = [r for r in joining if tkv.length(r.req_id) < r.num_tokens - 1]
        if len(unread) > 1 or (unread and reading):
            raise ValueError("a session reads one joining prompt per round")
        reading.extend(unread)
        joining = [r for r in joining if r not in unread]
        if joining:
            _enter(drafter, joining)
            for r in joining:
                host_len[r.req_id] = r.num_tokens - 1
                everyone[r.req_id] = r
            L = torch.cat([L, h2d([host_len[r.req_id] for r in joining], dev, torch.int64)])
            last2 = torch.cat([last2, h2d([r.all_tokens[-2:] for r in joining], dev, torch.int64)])
        members = stay + joining

    last_round: dict[int, tuple[int, int, int]] = {}  # req_id -> (L at the start, accepted, k) of its last commit

    def commit_round(step) -> int:
        out, done, marks, kk, reqs, rd = step
        if done is not None:
            done.synchronize()
        if marks is not None:
            timing(kk, marks.seconds(0, 1), marks.seconds(1, 2), len(reqs))
        produced = 0
        for r, row in zip(reqs, out.tolist()):
            if r.finished:  # finished in the round before (its row was computed all the same) or aborted
                continue
            rk = 0 if r is rd else kk  # (a prompt read in the round drafted nothing: its first token alone)
            acc, start = row[kk + 1], row[kk + 2]
            n = commit(r, row[: acc + 1], acc, rk)
            host_len[r.req_id] = start + acc + 1
            last_round[r.req_id] = (start, acc, rk)
            produced += n
        return produced

    def room(kk: int) -> bool:
        """Another round of kk drafts fits every request's context even if the round in flight commits all its
        tokens. A request near its max_tokens still runs: commit drops what lies past its end, and once it
        finishes it leaves (regroup) or the session ends after the round in flight is committed for the others (a
        session that stopped at the first request within 2(k + 1) tokens of its end ran ordinary rounds for the
        whole batch ~40 % of the time at 4 staggered requests of 96 tokens)."""
        return all(r.num_tokens + ahead() + kk + 1 < limit for r in members)

    def ahead() -> int:
        """Tokens the round in flight may commit."""
        return pending[3] + 1 if pending is not None else 0

    pending, launched, kk = None, 0, k
    try:
        while True:
            if launched and regroup is not None:  # those who finished leave, newcomers join
                new = regroup(list(members), lambda: pending is not None and pending[1] is not None
                              and pending[1].synchronize(), kk)
                if [r.req_id for r in new] != [r.req_id for r in members]:
                    change(new)
            go = bool(members) and room(kk) and (max_rounds is None or launched < max_rounds) \
                and not (should_stop and should_stop())
            if go and launched and next_k is not None:  # the policy decides every round
                kk = next_k()
                go = 0 < kk < gr.max_q_len and room(kk)
            step = launch(kk, ahead()) if go else None
            launched += step is not None
            if pending is not None:
                produced = commit_round(pending)
                if step is None and not produced:  # (the last round gave nothing: every member had left. The
                    return launched  # session ends in this step, not after one more that reports nothing)
                yield produced
                if regroup is None and any(r.finished for r in members):
                    if step is not None:  # computed for everyone: commit it for those still running
                        yield commit_round(step)
                    return launched
            if step is None:
                return launched
            pending = step
    finally:  # the rollback invariant on the host: target = committed but the newest; draft = a prefix of it
        for r in everyone.values():
            if r.finished or r.req_id not in last_round:
                continue
            start, acc, kk = last_round[r.req_id]
            tkv.set_length(r.req_id, r.num_tokens - 1)
            # the draft wrote up to start + kk - 1: drafts d_1..d_acc (accepted) at start + 1.., so it holds the
            # committed prefix through start + min(acc, kk - 1)
            dkv.set_length(r.req_id, min(start + min(acc, kk - 1) + 1, r.num_tokens - 1))
