"""Prompt lookup (n-gram) drafting: propose what followed the latest earlier match of the last n tokens."""
from __future__ import annotations

from ..request import Request
from .base import DraftProposal, Drafter


def ngram_propose(tokens: list[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Try n = max_n .. min_n: find the latest earlier occurrence of tokens[-n:] and return up to k tokens that
    followed it. Returns [] when nothing matches."""
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # latest match first; must end before the tail
            if tokens[start : start + n] == tail:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramDrafter(Drafter):
    """No model, no cache: the draft is a point mass on the looked-up token (probs None)."""

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= ngram min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[Request], ks: list[int]) -> DraftProposal:
        tokens = [ngram_propose(r.all_tokens, k, self.min_n, self.max_n) for r, k in zip(requests, ks)]
        return DraftProposal(tokens, [None] * len(requests))
