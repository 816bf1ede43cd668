"""Tree drafting with a draft model: several candidate continuations checked in one target forward.

The tree has a fixed shape, `branching[d]` children for every node at depth d (so (2, 2, 1) gives
1 + 2 + 4 + 4 = 11 nodes, root included). Nodes are numbered breadth first; node 0 is the root, the last
committed token. Children of a node are drawn from the draft distribution q at that node:
  - greedy requests (temperature 0): the top-b tokens of q (distinct), verified by the greedy tree walk;
  - sampled requests: b i.i.d. draws from q (with replacement), verified by exact multi-draft recursive
    rejection sampling (`verify_tree(rule="exact", draft_scheme="with_replacement")`), which needs exactly
    this scheme to keep the output distributed as the target's.
Each depth is one batched draft forward over the whole tree so far with a tree mask (every node sees the
committed prefix and its ancestors only); afterwards the draft cache is cut back to the committed prefix,
and the accepted tokens are fed on the next proposal like any other catch-up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request import Request
from ..structured import ALL_ALLOWED, apply_bitmask_, bitmask_words, grammar_of, tree_node_masks  # issue 14
from ..runtime.runner import Chunk, ModelRunner
from ..verify.coupling import coupled_scores, keys_for
from ..verify.layout import tree_attention_mask
from ..verify.probs import SamplingTensors, logits_to_probs, sample_from_probs
from .base import TreeProposal
from .model_drafter import ModelDrafter


@dataclass(frozen=True)
class TreeShape:
    """Parents (breadth-first, -1 at the root), depth of every node, and the nodes of each depth."""

    parents: tuple[int, ...]
    depth: tuple[int, ...]
    levels: tuple[tuple[int, ...], ...]

    @classmethod
    def from_branching(cls, branching: tuple[int, ...]) -> "TreeShape":
        if not branching or any(b < 1 for b in branching):
            raise ValueError(f"tree branching must be positive counts per depth, got {branching}")
        parents, depth, levels = [-1], [0], [(0,)]
        for d, b in enumerate(branching, start=1):
            level = []
            for p in levels[-1]:
                for _ in range(b):
                    parents.append(p)
                    depth.append(d)
                    level.append(len(parents) - 1)
            levels.append(tuple(level))
        return cls(tuple(parents), tuple(depth), tuple(levels))

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def mask(self, upto: int | None = None) -> torch.Tensor:
        """[m, m] bool over the first m nodes: node i sees j iff j is i or an ancestor of i."""
        m = self.num_nodes if upto is None else upto
        return tree_attention_mask(torch.tensor(self.parents[:m]), torch.tensor([0]), torch.tensor([m]), m)


class TreeDrafter(ModelDrafter):
    """A draft model with its own cache (rollback / release / cached_length as ModelDrafter's); the tree
    round calls propose_tree, a chain round could still call propose. Every request gets the same fixed shape."""

    name = "draft-tree"

    def __init__(self, runner: ModelRunner, branching: tuple[int, ...]) -> None:
        super().__init__(runner)
        self.shape = TreeShape.from_branching(tuple(branching))

    def propose_tree(self, requests: list[Request]) -> TreeProposal:
        kv, shape = self.runner.kv, self.shape
        n = shape.num_nodes
        tokens = [[r.all_tokens[-1]] + [0] * (n - 1) for r in requests]
        probs: list[torch.Tensor | None] = [None] * len(requests)
        self.feed(requests, [r.num_tokens - 1 for r in requests])  # catch-up in budget-sized forwards
        root_pos = [r.num_tokens - 1 for r in requests]
        st = SamplingTensors.from_params([r.params for r in requests], self.runner.device)
        greedy = [r.params.temperature == 0 for r in requests]
        for d, level in enumerate(shape.levels[:-1]):
            if d == 0:  # catch-up: committed tokens the draft cache lacks, the root last
                chunks = [Chunk(r.req_id, r.all_tokens[kv.length(r.req_id):]) for r in requests]
            else:  # the root and every node above depth d, with the tree mask
                m = level[-1] + 1
                chunks = [Chunk(r.req_id, tokens[i][:m], positions=[root_pos[i] + shape.depth[j] for j in range(m)],
                                tree_mask=shape.mask(m), logits=len(level)) for i, r in enumerate(requests)]
            out, _ = self.runner.forward(chunks)
            for r, pos in zip(requests, root_pos):
                kv.truncate(r.req_id, pos)  # keep the committed prefix only (the root is re-fed)
            v = out.logits.shape[-1]
            rows = len(level)
            states = [grammar_of(r) for r in requests]
            if any(st_ is not None for st_ in states):  # issue 14: children drawn from the grammar-masked q, each
                masks = [tree_node_masks(g, tokens[i], shape.parents, level) if g is not None  # the grammar after
                         else torch.full((rows, bitmask_words(v)), ALL_ALLOWED, dtype=torch.int32)  # each node's path
                         for i, g in enumerate(states)]
                apply_bitmask_(out.logits, torch.cat(masks))
            q = logits_to_probs(out.logits, st.temperature.repeat_interleave(rows), st.top_k.repeat_interleave(rows),
                                st.top_p.repeat_interleave(rows), st.min_p.repeat_interleave(rows))  # [R*rows, V]
            children = len(shape.levels[d + 1]) // rows
            for i, r in enumerate(requests):
                if probs[i] is None:
                    probs[i] = torch.zeros(n, v, device=q.device)
                qi = q[i * rows:(i + 1) * rows]  # [rows, V]
                if r.coupled:  # seeded: top-b of log q + g(seed, position of the children)
                    keys = keys_for(r.params.seed, r.num_tokens + d, 1, q.device).expand(rows)
                    picked = coupled_scores(qi, keys).topk(children, dim=-1).indices
                elif greedy[i]:
                    picked = out.logits[i * rows:(i + 1) * rows].topk(children, dim=-1).indices  # distinct tokens
                else:
                    u = torch.rand(rows, children, generator=r.generator).to(q.device)
                    picked = sample_from_probs(qi.repeat_interleave(children, 0), u.flatten()).view(rows, children)
                for a, node in enumerate(level):
                    probs[i][node] = qi[a]
                    for c in range(children):
                        tokens[i][shape.levels[d + 1][a * children + c]] = int(picked[a, c])
        return TreeProposal(tokens, [list(shape.parents)] * len(requests), probs)
