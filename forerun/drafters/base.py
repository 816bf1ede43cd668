"""The drafter extension point: propose up to k tokens per request, then roll back to what was committed."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..request import Request


@dataclass(frozen=True)
class DraftProposal:
    """Per request (same order as the requests given to propose):
    tokens[i]: the drafted token ids, at most k_i of them (fewer when a drafter stops early);
    probs[i]: [len(tokens[i]), V] float32 draft distributions each token was sampled from (already through
    the shared probability transform), or None for a deterministic drafter (a point mass on the token).
    step_seconds: what one more draft token costs, measured on steps that fed one token per request."""

    tokens: list[list[int]]
    probs: list[torch.Tensor | None]
    step_seconds: float | None = None  # mean time of one draft step (catch-up feeding excluded), for adaptive k


class Drafter(ABC):
    """A source of draft tokens. Drafters that keep a KV cache keep the same invariant as the target:
    after `rollback(req, n)` their cache holds at most the first n tokens of req.all_tokens, and the next
    `propose` feeds whatever committed tokens are missing before drafting."""

    name: str = "drafter"

    @abstractmethod
    def propose(self, requests: list[Request], ks: list[int]) -> DraftProposal: ...

    def rollback(self, request: Request, valid_len: int) -> None:
        """Forget every cached position >= valid_len (the committed prefix that the target also holds)."""

    def release(self, request: Request) -> None:
        """The request finished: free its state."""

    def cached_length(self, request: Request) -> int | None:
        """Tokens of the request in the drafter's own cache (None: the drafter has no cache)."""
        return None
