"""The EAGLE dynamic tree's draft budget (top-k, steps, nodes) per round, from measured costs and acceptance.

Like adaptive k (forerun/engine/k_policy.py), the budget maximises expected tokens per second of the
whole batch,

    B * (1 + c * V(shape)) / (t_target(B * nodes) + t_head_steps(B, shape)),

over a ladder of sub-shapes of the configured maximum (and "no tree": plain decoding, one row per request):

  - t_target(tokens): the target forward's seconds for a verify batch of that many rows (a linear fit
    t0 + t1 * tokens of measured rounds; the engine's `CostModel` when it hands it over, else the drafter's own
    measurement: from the end of a proposal to the target states of that round);
  - t_head_steps: the head's further steps (the first, the draft extend, runs whatever the shape): step d of a
    shape with width w feeds about w * d rows per request (the expanded nodes and their ancestors), priced by a
    linear fit of measured head steps against their rows;
  - V(shape): the tree's value, EAGLE-2's own estimate of accepted drafts: the sum over the kept nodes of
    exp(cumulative draft log-probability). Each greedy proposal gives V of every sub-shape of the tree it built
    (the nodes a smaller top-k / fewer steps / fewer nodes would have kept), averaged over recent rounds;
  - c: calibration, measured accepted drafts / V of the shapes that were drafted (the head's confidence is not
    its acceptance).

When verify rows are free (memory-bound decode) the largest tree wins; as the batch grows every extra node
multiplies by B in t_target and the budget comes down, to plain decoding when nothing is worth its rows.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, order=True)
class TreeBudget:
    """One draft tree shape: children per expanded node and frontier width, levels, nodes (root included).
    nodes == 1: no tree (plain decoding)."""

    topk: int
    steps: int
    nodes: int

    @property
    def drafts(self) -> bool:
        return self.nodes > 1


class TargetCost(Protocol):
    def target_time(self, tokens: int) -> float: ...


@dataclass
class LinearCost:
    """seconds = t0 + t1 * rows, least squares over recent observations (t1 >= 0, t0 > 0)."""

    obs: deque = field(default_factory=lambda: deque(maxlen=64))

    def record(self, rows: int, seconds: float) -> None:
        self.obs.append((float(rows), float(seconds)))

    @property
    def ready(self) -> bool:
        return len(self.obs) >= 2

    def time(self, rows: float) -> float:
        obs = list(self.obs)
        if not obs:
            return 0.0
        n = len(obs)
        mx = sum(x for x, _ in obs) / n
        my = sum(y for _, y in obs) / n
        var = sum((x - mx) ** 2 for x, _ in obs)
        slope = max(sum((x - mx) * (y - my) for x, y in obs) / var, 0.0) if var > 0 else 0.0
        return max(my - slope * mx, 1e-9) + slope * rows

    def target_time(self, tokens: int) -> float:  # so a LinearCost can stand in for the engine's CostModel
        return self.time(tokens)


def budget_ladder(topk: int, steps: int, nodes: int) -> list[TreeBudget]:
    """Sub-shapes of the maximum (topk, steps, nodes): widths 1, 2, 4, .. topk, every depth, node counts
    2, 3, 4, 6, 8, 12, 16, .. nodes (only those a shape can fill: nodes - 1 <= topk * steps, as many as
    `steps` levels of `topk` children hold), plus plain decoding."""
    widths = sorted({w for w in (1, 2, 4, 8, 16, 32) if w <= topk} | {topk})
    counts = {c for c in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128) if c < nodes} | {nodes}
    out = [TreeBudget(1, 1, 1)] + [TreeBudget(1, s, s + 1) for s in range(1, steps + 1) if s + 1 <= nodes]
    for w in widths:
        if w == 1:
            continue
        for s in range(1, steps + 1):
            cap = 1 + sum(w ** d for d in range(1, s + 1))
            for c in sorted(counts):
                if c <= cap and (c - 1) >= s:  # a shape whose levels the nodes can reach (else: fewer steps)
                    out.append(TreeBudget(w, s, c))
    return sorted(set(out))


def subtree_value(tok_parent: list[int], depth: list[int], score: list[float], child_rank: list[int],
                  shape: TreeBudget) -> float:
    """V(shape) for one greedy candidate tree: the nodes `shape` would have kept (children of rank < topk of
    the `topk` best nodes of each level, `steps` levels, then the nodes - 1 best), summed as exp(score)."""
    if not shape.drafts:
        return 0.0
    children: dict[int, list[int]] = {}
    for j in range(1, len(tok_parent)):
        children.setdefault(tok_parent[j], []).append(j)
    level, eligible = [0], []
    for d in range(1, shape.steps + 1):
        nxt = [c for p in level for c in children.get(p, ()) if child_rank[c] < shape.topk]
        if not nxt:
            break
        eligible += nxt
        level = sorted(nxt, key=lambda j: -score[j])[: shape.topk]
    best = sorted(eligible, key=lambda j: (-score[j], depth[j], j))[: shape.nodes - 1]
    return sum(math.exp(score[j]) for j in best)


class TreeBudgetPolicy:
    """Chooses a TreeBudget per round from the batch size, measured costs and measured tree values.

    max_budget: the configured (topk, steps, nodes), never exceeded. target_cost: anything with
    target_time(tokens) (the engine's CostModel), or None to measure it here (`record_target`)."""

    def __init__(self, max_budget: TreeBudget, target_cost: TargetCost | None = None, decay: float = 0.97,
                 sample_trees: int = 2) -> None:
        self.max = max_budget
        self.ladder = budget_ladder(max_budget.topk, max_budget.steps, max_budget.nodes)
        self.own_target = LinearCost()
        self.target_cost = target_cost
        self.head = LinearCost()
        self.decay = decay
        self.sample_trees = sample_trees  # greedy trees per round whose sub-shape values are recorded
        self.values: dict[TreeBudget, float] = {}  # EMA of V(shape) per tree
        self._wv: dict[TreeBudget, float] = {}
        self.accepted = 0.0  # decayed sums for the calibration c = accepted / predicted
        self.predicted = 0.0
        self.last: TreeBudget | None = None
        self.chosen: dict[str, int] = {}  # "topk,steps,nodes" -> rounds (for reports)

    # -- measurements ----------------------------------------------------------------------------------
    def record_target(self, tokens: int, seconds: float) -> None:
        self.own_target.record(tokens, seconds)

    def record_head_step(self, rows: int, seconds: float) -> None:
        self.head.record(rows, seconds)

    def record_values(self, values: dict[TreeBudget, float]) -> None:
        """One greedy tree's V per sub-shape (`tree_values`)."""
        for shape, v in values.items():
            w = self._wv.get(shape, 0.0) * self.decay + 1.0
            self.values[shape] = (self.values.get(shape, 0.0) * (w - 1.0) + v) / w
            self._wv[shape] = w

    def record_outcome(self, predicted: float, accepted: int) -> None:
        """A drafted tree's V (for the shape it was drafted with) and the drafts the target accepted."""
        self.predicted = self.predicted * self.decay + predicted
        self.accepted = self.accepted * self.decay + accepted

    def tree_values(self, parent: list[int], depth: list[int], score: list[float], child_rank: list[int]
                    ) -> dict[TreeBudget, float]:
        return {s: subtree_value(parent, depth, score, child_rank, s) for s in self.ladder if s.drafts}

    # -- the model --------------------------------------------------------------------------------------
    @property
    def calibration(self) -> float:
        """Accepted drafts per unit of V (prior 1: the head's confidence taken at its word)."""
        return (self.accepted + 1.0) / (self.predicted + 1.0)

    def _t_target(self, tokens: int) -> float:
        src = self.target_cost if self.target_cost is not None else self.own_target
        return src.target_time(tokens)

    @property
    def ready(self) -> bool:
        target_ok = self.target_cost is not None or self.own_target.ready
        return target_ok and self.head.ready and any(s in self.values for s in self.ladder if s.drafts)

    def round_seconds(self, shape: TreeBudget, batch: int) -> float:
        t = self._t_target(batch * shape.nodes)
        if shape.drafts:  # the draft extend (about two rows per request: the accepted ones), then the steps
            t += self.head.time(2 * batch)
        for d in range(1, shape.steps):
            t += self.head.time(batch * shape.topk * d)
        return t

    def expected_tokens(self, shape: TreeBudget) -> float:
        return 1.0 + self.calibration * self.values.get(shape, 0.0)

    def choose(self, batch: int, record: bool = True) -> TreeBudget:
        """The shape with the most expected tokens per second for a round of `batch` drafting requests; the
        maximum until costs and values are measured. Shapes never measured are not chosen. record=False: a look
        ahead (an overlapped round's guess at the next choice), not counted in `chosen` / `last`."""
        pick = self._pick if record else (lambda shape: shape)
        if not self.ready or batch < 1:
            return pick(self.max)
        best, best_rate = TreeBudget(1, 1, 1), -1.0
        for shape in self.ladder:
            if shape.drafts and shape not in self.values:
                continue
            rate = batch * self.expected_tokens(shape) / self.round_seconds(shape, batch)
            if rate > best_rate * 1.0001:
                best, best_rate = shape, rate
        return pick(best)

    def _pick(self, shape: TreeBudget) -> TreeBudget:
        self.last = shape
        key = f"{shape.topk},{shape.steps},{shape.nodes}"
        self.chosen[key] = self.chosen.get(key, 0) + 1
        return shape

    def table(self, batches: list[int]) -> list[dict]:
        """What choose() picks per batch size, with its expected tokens and round time (for reports)."""
        rows = []
        for b in batches:
            s = self.choose(b)
            rows.append({"batch": b, "topk": s.topk, "steps": s.steps, "nodes": s.nodes,
                         "expected_tokens": round(self.expected_tokens(s) if s.drafts else 1.0, 3),
                         "round_ms": round(1e3 * self.round_seconds(s, b), 3)})
        return rows
