"""Acceptance statistics and seed 003's formulae."""
from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E[tokens] = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a): accepted drafts plus the one target token."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """(1 - a^(k+1)) / ((1 - a)(1 + k c)): tokens per round over the round's cost in target-step units,
    when a draft step costs c target steps and verifying k+1 tokens costs as much as decoding one."""
    return expected_tokens_per_round(alpha, k) / (1.0 + k * c)


@dataclass
class RequestStats:
    rounds: int = 0  # target forward passes that produced tokens for this request
    drafted: int = 0  # draft positions offered (chain: its length k; tree: its depth), summed over rounds
    accepted: int = 0
    emitted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position i: rounds that drafted a token at i
    accepted_at: list[int] = field(default_factory=list)  # per draft position i: rounds that accepted it
    drafted_nodes: int = 0  # draft tokens the target verified (chain: = drafted; tree: every node of the tree)
    # structured output (issue 14): drafted tokens the request's grammar rejected. Chain: the tail cut from the
    # first rejected token on, never verified (not in drafted / drafted_nodes). Tree: nodes whose token or an
    # ancestor's the grammar rejects; they stay in the verified tree (in drafted_nodes) with p = 0, never accepted.
    grammar_rejected: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's num_cached_tokens; 0 with it off)

    def record(self, num_drafted: int, num_accepted: int, num_emitted: int, drafted_nodes: int | None = None) -> None:
        """One round of this request. num_drafted: draft positions (chain k, tree depth); num_accepted: drafts
        accepted; num_emitted: tokens committed; drafted_nodes: draft tokens the target scored (a tree's
        node count; defaults to num_drafted for a chain). A tree's cost is its nodes, not its depth."""
        if drafted_nodes is None:
            drafted_nodes = num_drafted
        if drafted_nodes < num_drafted:
            raise ValueError(f"drafted_nodes ({drafted_nodes}) < num_drafted ({num_drafted})")
        self.rounds += 1
        self.drafted += num_drafted
        self.drafted_nodes += drafted_nodes
        self.accepted += num_accepted
        self.emitted += num_emitted
        while len(self.drafted_at) < num_drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(num_drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < num_accepted)

    def merge(self, other: "RequestStats") -> None:
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.drafted_nodes += other.drafted_nodes
        self.accepted += other.accepted
        self.emitted += other.emitted
        self.grammar_rejected += other.grammar_rejected
        self.cached_tokens += other.cached_tokens
        for i in range(len(other.drafted_at)):
            if i >= len(self.drafted_at):
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[i] += other.drafted_at[i]
            self.accepted_at[i] += other.accepted_at[i]

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over draft tokens verified (vLLM's num_accepted_tokens / num_draft_tokens); for a
        tree the denominator is its nodes, so a wide tree is not credited as if it drafted its depth only."""
        return self.accepted / self.drafted_nodes if self.drafted_nodes else 0.0

    @property
    def position_acceptance_rate(self) -> float:
        """Accepted drafts over draft positions (chain: = acceptance_rate; tree: accepted depth / depth)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per round (the +1 target token is not counted)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds, "drafted": self.drafted, "drafted_nodes": self.drafted_nodes,
            "accepted": self.accepted, "emitted": self.emitted, "grammar_rejected": self.grammar_rejected,
            "cached_tokens": self.cached_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "position_acceptance_rate": round(self.position_acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "tokens_per_target_call": round(self.tokens_per_target_call, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
        }


def aggregate(stats: list[RequestStats]) -> RequestStats:
    total = RequestStats()
    for s in stats:
        total.merge(s)
    return total
