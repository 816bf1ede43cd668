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

Near a request's end (or its context limit) the round drafts the tree's prefix that fits: no deeper than the
request's tokens left minus one (`tree_depth_cap`) and, when the round passes `max_drafts`, at most that many
nodes beyond the root (the deepest prefix within it), rather than no tree at all.
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

    def nodes_upto(self, depth: int) -> int:
        """Nodes of the prefix of this depth (root included): breadth-first ids, so nodes 0 .. nodes_upto - 1."""
        return self.levels[min(depth, len(self.levels) - 1)][-1] + 1

    def prefix_depth(self, max_depth: int, max_drafts: int | None = None) -> int:
        """The deepest prefix (<= max_depth) whose drafts (nodes beyond the root) number at most max_drafts."""
        d = max(0, min(max_depth, len(self.levels) - 1))
        while d > 0 and max_drafts is not None and self.nodes_upto(d) - 1 > max_drafts:
            d -= 1
        return d

    def mask(self, upto: int | None = None) -> torch.Tensor:
        """[m, m] bool over the first m nodes: node i sees j iff j is i or an ancestor of i."""
        m = self.num_nodes if upto is None else upto
        return tree_attention_mask(torch.tensor(self.parents[:m]), torch.tensor([0]), torch.tensor([m]), m)


def tree_depth_cap(request: Request, max_drafts: int | None = None) -> int:
    """Deepest draft worth drafting for `request` this round: a round commits its accepted path plus one token, and
    nothing past max_tokens (`_commit` drops it), so remaining - 1; a tree of max_drafts drafts is never deeper
    than max_drafts either (the engine's cap for the context room, `Engine._k_for`). 0: no tree (a plain row)."""
    cap = request.remaining - 1
    if max_drafts is not None:
        cap = min(cap, max_drafts)
    return max(0, cap)


class TreeDrafter(ModelDrafter):
    """A draft model with its own cache (rollback / release / cached_length as ModelDrafter's); the tree
    round calls propose_tree, a chain round could still call propose. Every request gets the same fixed shape."""

    name = "draft-tree"

    def __init__(self, runner: ModelRunner, branching: tuple[int, ...]) -> None:
        super().__init__(runner)
        self.shape = TreeShape.from_branching(tuple(branching))

    def propose_tree(self, requests: list[Request], max_drafts: list[int] | None = None) -> TreeProposal:
        """Each request's tree is the prefix of the shape that fits it (`tree_depth_cap`, `TreeShape.prefix_depth`:
        max_drafts[i] nodes beyond the root at most); a request with no room gets its root alone (a plain row)."""
        kv, shape = self.runner.kv, self.shape
        caps = list(max_drafts) if max_drafts is not None else [None] * len(requests)
        depths = [shape.prefix_depth(tree_depth_cap(r, m), m) for r, m in zip(requests, caps)]
        sizes = [shape.nodes_upto(d) for d in depths]
        tokens = [[r.last_token] + [0] * (n - 1) for r, n in zip(requests, sizes)]
        probs: list[torch.Tensor | None] = [None] * len(requests)
        self.feed(requests, [r.num_tokens - 1 for r in requests])  # catch-up in budget-sized forwards
        root_pos = [r.num_tokens - 1 for r in requests]
        v = None
        for d, level in enumerate(shape.levels[:-1]):
            act = [i for i, dep in enumerate(depths) if dep > d]  # requests whose prefix goes below this level
            if not act:
                break
            reqs = [requests[i] for i in act]
            st = SamplingTensors.from_params([r.params for r in reqs], self.runner.device)
            if d == 0:  # catch-up: committed tokens the draft cache lacks, the root last
                chunks = [Chunk(r.req_id, r.all_tokens[kv.length(r.req_id):]) for r in reqs]
            else:  # the root and every node above depth d, with the tree mask
                m = level[-1] + 1
                chunks = [Chunk(requests[i].req_id, tokens[i][:m],
                                positions=[root_pos[i] + shape.depth[j] for j in range(m)],
                                tree_mask=shape.mask(m), logits=len(level)) for i in act]
            out, _ = self.runner.forward(chunks)
            for i in act:
                kv.truncate(requests[i].req_id, root_pos[i])  # keep the committed prefix only (the root is re-fed)
            v = out.logits.shape[-1]
            rows = len(level)
            states = [grammar_of(r) for r in reqs]
            if any(st_ is not None for st_ in states):  # issue 14: children drawn from the grammar-masked q, each
                masks = [tree_node_masks(g, tokens[act[a]], shape.parents, level) if g is not None  # the grammar
                         else torch.full((rows, bitmask_words(v)), ALL_ALLOWED, dtype=torch.int32)  # after each path
                         for a, g in enumerate(states)]
                apply_bitmask_(out.logits, torch.cat(masks))
            q = logits_to_probs(out.logits, st.temperature.repeat_interleave(rows), st.top_k.repeat_interleave(rows),
                                st.top_p.repeat_interleave(rows), st.min_p.repeat_interleave(rows))  # [R*rows, V]
            children = len(shape.levels[d + 1]) // rows
            for a, i in enumerate(act):
                r = requests[i]
                if probs[i] is None:
                    probs[i] = torch.zeros(sizes[i], v, device=q.device)
                qi = q[a * rows:(a + 1) * rows]  # [rows, V]
                if r.coupled:  # seeded: top-b of log q + g(seed, position of the children)
                    keys = keys_for(r.params.seed, r.num_tokens + d, 1, q.device).expand(rows)
                    picked = coupled_scores(qi, keys).topk(children, dim=-1).indices
                elif r.params.temperature == 0:
                    picked = out.logits[a * rows:(a + 1) * rows].topk(children, dim=-1).indices  # distinct tokens
                else:
                    u = torch.rand(rows, children, generator=r.generator).to(q.device)
                    picked = sample_from_probs(qi.repeat_interleave(children, 0), u.flatten()).view(rows, children)
                for b, node in enumerate(level):
                    probs[i][node] = qi[b]
                    for c in range(children):
                        tokens[i][shape.levels[d + 1][b * children + c]] = int(picked[b, c])
        for i, n in enumerate(sizes):
            if probs[i] is None:  # the root alone (no room for a draft): never verified as a tree
                probs[i] = torch.zeros(n, v or 1, device=self.runner.device)
        return TreeProposal(tokens, [list(shape.parents[:n]) for n in sizes], probs)
