"""The drafter extension point: propose up to k tokens per request, then roll back to what was committed."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from ..request import Request


@dataclass
class DraftProposal:
    """Per request (same order as the requests given to propose):
    tokens[i]: the drafted token ids, at most k_i of them (fewer when a drafter stops early);
    probs[i]: [len(tokens[i]), V] float32 draft distributions each token was sampled from (already through
    the shared probability transform), or None for a deterministic drafter (a point mass on the token).
    step_seconds: what one more draft token costs, measured on steps that fed one token per request.

    A drafter may leave its tokens on the device (no host round trip while drafting): then `tokens` is None,
    `lengths[i]` says how many request i drafted and `device_tokens` holds them all, flat in request order;
    `resolve()` reads them (one sync: free once the verification that follows has synchronised)."""

    tokens: list[list[int]] | None
    probs: list[torch.Tensor | None]
    step_seconds: float | None = None  # mean time of one draft step (catch-up feeding excluded), for adaptive k
    lengths: list[int] | None = None
    device_tokens: torch.Tensor | None = None  # [sum(lengths)] int64
    step_timer: Callable[[], float | None] | None = None  # step_seconds, read after a later sync (CUDA events)

    def __post_init__(self) -> None:
        if self.tokens is None and (self.lengths is None or self.device_tokens is None):
            raise ValueError("a DraftProposal without host tokens needs lengths and device_tokens")
        if self.lengths is None:
            self.lengths = [len(t) for t in self.tokens]

    def resolve(self) -> list[list[int]]:
        if self.tokens is None:
            flat, self.tokens, at = self.device_tokens.tolist(), [], 0
            for n in self.lengths:
                self.tokens.append(flat[at: at + n])
                at += n
        return self.tokens

    def measured_step_seconds(self) -> float | None:
        if self.step_seconds is None and self.step_timer is not None:
            self.step_seconds, self.step_timer = self.step_timer(), None
        return self.step_seconds


@dataclass(frozen=True)
class TreeProposal:
    """Per request: a draft tree of n_i nodes, breadth-first or any order where a parent precedes its children.
    tokens[i]: [n_i] token ids, node 0 = the root (the request's newest committed token);
    parents[i]: [n_i] parent node of each node (-1 for the root); shapes may differ between requests;
    probs[i]: [n_i, V] row j = the draft distribution node j's children were drawn from (zeros for leaves);
    for greedy requests (and coupled seeded ones) the rows are never read."""

    tokens: list[list[int]]
    parents: list[list[int]]
    probs: list[torch.Tensor]
    step_seconds: float | None = None


class Drafter(ABC):
    """A source of draft tokens. Drafters that keep a KV cache keep the same invariant as the target:
    after `rollback(req, n)` their cache holds at most the first n tokens of req.all_tokens, and the next
    `propose` feeds whatever committed tokens are missing before drafting."""

    name: str = "drafter"
    # True for drafters that time their pure draft steps themselves (DraftProposal.step_seconds / step_timer):
    # a round where none was pure (a k = 1 probe, whose only step also feeds the backlog since the last draft)
    # then gives no draft-step observation, instead of its whole drafting phase (catch-up included) per token
    times_steps: bool = False
    # (tokens, seconds) of each catch-up the drafter's own cache reads (prompts, plain stretches), for a caller
    # whose device is synchronous (the engine's CPU path prices catch-ups with it: KPolicy.catch_up_pays)
    on_feed: "Callable[[int, float], None] | None" = None

    @abstractmethod
    def propose(self, requests: list[Request], ks: list[int]) -> DraftProposal: ...

    @property
    def kv(self):
        """The drafter's own KV pool (None: no cache, or it shares the target's). The scheduler counts its blocks."""
        return None

    def blocks_needed(self, request: Request, tokens: int) -> int:
        """More blocks of its own pool the request needs to hold `tokens` tokens (0 without an own pool)."""
        return 0

    def feed(self, requests: list[Request], upto: list[int]) -> None:
        """Let the cache hold at least the first upto[i] committed tokens of requests[i] (chunked prefill: the
        round passes the target's prefill chunks on, so no long catch-up is left for the first draft)."""

    def rollback(self, request: Request, valid_len: int) -> None:
        """Forget every cached position >= valid_len (the committed prefix that the target also holds)."""

    def release(self, request: Request) -> None:
        """The request finished: free its state."""

    # Prefix caching (kvcache/pool.py): a drafter's own pool caches its positions under a token sequence that names
    # what each position's keys and values depend on, and may bound how much of a new prompt the target takes from
    # its cache (a drafter that reads the target's states needs them from where its own cache stops).
    prefix_shift: int = 0  # prefix_key(tokens) names len(tokens) - prefix_shift positions

    def prefix_key(self, tokens: list[int]) -> list[int]:
        """The sequence that names the drafter's cache positions 0 .. len - 1 for `tokens`: the tokens themselves
        (position i depends on tokens[:i + 1]); a drafter whose row i also reads token i + 1 names it otherwise."""
        return tokens

    def attach_prefix(self, request: Request) -> int | None:
        """A request is admitted with prefix caching on: take the drafter's own cached prefix now. Returns how many
        leading positions the target may take from its cache (None: any; the drafter needs nothing from it)."""
        return None

    # Feature-level drafters (EAGLE) read the target's hidden states. The round asks the target forward for
    # these layers' outputs and, after verification, hands over the states of every newly committed token.
    target_hidden_layers: tuple[int, ...] = ()

    def observe_target(self, requests: list[Request], states: list[dict[int, torch.Tensor] | None],
                       starts: list[int]) -> None:
        """After a round: states[i][layer] is [n_i, hidden], the target's hidden states (after that layer) at
        absolute positions starts[i] .. starts[i] + n_i - 1 of request i, every one of them a committed token
        (None: request i fed nothing this round). Called only when target_hidden_layers is not empty."""

    def cached_length(self, request: Request) -> int | None:
        """Tokens of the request in the drafter's own cache (None: the drafter has no cache)."""
        return None


def subsequence_rows(ids, of) -> list[int] | None:
    """Where each of `ids` sits in `of` when they are a subsequence of it (same order, some left out), else None:
    a batch queued ahead that some requests have left since (EAGLE's prelaunched drafting, a queued verify step)."""
    at, rows = 0, []
    for x in ids:
        while at < len(of) and of[at] != x:
            at += 1
        if at == len(of):
            return None
        rows.append(at)
        at += 1
    return rows
