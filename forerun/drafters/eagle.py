"""EAGLE drafting: a one-layer head that drafts from the target's hidden states (chains and dynamic trees).

State per request:
  - the head's own paged KV cache (a ModelRunner over the head); row t pairs token x_{t+1} with the
    target feature of position t (forerun.models.eagle_head), so with N + 1 committed tokens x_0..x_N
    the rows 0..N-1 are everything committed can give: the newest token x_N pairs with f_{N-1};
  - the target features the round handed over (`observe_target`) that the cache has not taken yet.

A proposal first feeds the missing committed rows ("draft extend": SGLang's forward_draft_extend, folded
into the first draft step), whose last row's output is the distribution of x_{N+1} and the feature for
the next step; every further step feeds one drafted token with the head's own previous output as its
feature. Afterwards the cache is cut back to rows 0..N-2: row N-1 (the root) is re-fed next time, so a
proposal never depends on an output that was not kept, and the cache always holds committed rows only
(the rollback invariant of every cache: rollback(n) keeps at most n rows).

Trees (EAGLE-2 / SGLang): the root's children are the top-k tokens; each further step expands the
`topk` nodes of the newest level with the best cumulative log-probability, each by its top-k children,
for `steps` levels; the `num_nodes - 1` best nodes (ancestor-closed) are kept. Sampled requests draw
children i.i.d. from the processed draft distribution (with replacement) instead, and are never pruned by
their own values: how many children a node gets is fixed before they are drawn (top-`topk` frontier nodes
by score, each `topk` children while the node budget lasts), which is what exact multi-draft verification
(`verify_tree(rule="exact", draft_scheme="with_replacement")`) needs to stay lossless.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from ..config import CacheConfig
from ..models.eagle_head import EagleHead, load_eagle_head
from ..request import Request
from ..structured import (ALL_ALLOWED, apply_bitmask_, apply_grammar_to_draft_logits, bitmask_words, grammar_of,  # issue 14
                          tree_node_masks)
from ..runtime.runner import Chunk, ModelRunner
from ..verify.probs import SamplingTensors, logits_to_probs, sample_from_probs
from .base import DraftProposal, Drafter, TreeProposal
from .eagle_budget import TreeBudget, TreeBudgetPolicy


class EagleDrafter(Drafter):
    name = "eagle"
    times_steps = True  # head steps after the first (draft extend) are timed in propose

    def __init__(self, target: ModelRunner, head: EagleHead | str | Path, *, cache: CacheConfig | None = None,
                 dtype: torch.dtype | None = None, tree_topk: int = 4, tree_steps: int = 4, tree_nodes: int = 16,
                 max_seqs: int = 256, max_batch_tokens: int = 8192, adaptive_budget: bool = False,
                 target_cost=None) -> None:
        """target: the target's runner (its model supplies embedding, final norm and, for EAGLE-1 heads,
        the lm_head). head: a loaded EagleHead or a checkpoint folder. cache: the head's KV pool (default
        sized like a 1-layer slice of the target's). Tree budget: tree_steps levels, tree_topk children per
        expanded node and frontier width, tree_nodes nodes in all (root included): fixed, or with
        adaptive_budget (or a target_cost: anything with target_time(tokens), the engine's CostModel) the
        maximum of a per-round budget chosen from the batch size and measured costs (forerun/drafters/eagle_budget.py)."""
        if isinstance(head, (str, Path)):
            head = load_eagle_head(head, target.model, dtype=dtype or target.dtype, device=target.device)
        if tree_topk < 1 or tree_steps < 1 or tree_nodes < 2:
            raise ValueError(f"EAGLE tree needs topk >= 1, steps >= 1, nodes >= 2 (got {tree_topk}, {tree_steps}, {tree_nodes})")
        self.head = head.eval()
        self.target = target
        self.head_dtype = next(head.parameters()).dtype
        cache = cache or CacheConfig(block_size=target.kv.block_size,
                                     num_blocks=max(2, target.kv.num_blocks // 4) + 1)
        self.cache = ModelRunner(head, cache, target.device, self.head_dtype, max_batch_tokens=max_batch_tokens,
                                 max_seqs=max_seqs)
        self.target_hidden_layers = tuple(head.eagle.aux_layers)
        self.eager_rows = 64  # observe_target feeds at once when this many rows are pending
        self.tree_topk, self.tree_steps, self.tree_nodes = tree_topk, tree_steps, tree_nodes
        self.budget: TreeBudgetPolicy | None = None
        if adaptive_budget or target_cost is not None:
            self.use_target_cost(target_cost)
        self._outcome: dict[int, tuple[int, float]] = {}  # req -> (num_tokens when drafted, the tree's V)
        self._proposed: tuple[float, dict[int, int]] | None = None  # (perf_counter, req -> tree rows) for timing
        self._feats: dict[int, tuple[int, torch.Tensor]] = {}  # req -> (first position, [n, F] features)

    def use_target_cost(self, cost=None) -> TreeBudgetPolicy:
        """Turn on the per-round tree budget (the configured tree is its maximum). cost: the target's measured
        forward cost (anything with target_time(tokens): the engine's k_policy.cost); None: measured here,
        from a proposal's end to the round's target states."""
        if self.budget is None:
            self.budget = TreeBudgetPolicy(TreeBudget(self.tree_topk, self.tree_steps, self.tree_nodes), cost)
        elif cost is not None:
            self.budget.target_cost = cost
        return self.budget

    # -- target features -------------------------------------------------------------------------------
    def observe_target(self, requests: list[Request], states: list[dict[int, torch.Tensor] | None],
                       starts: list[int]) -> None:
        if self._proposed is not None and self.budget is not None and self.budget.target_cost is None:
            t, rows = self._proposed  # the round's target forward (+ verification) since the proposal
            tokens = sum(rows.get(r.req_id) or (next(iter(st.values())).shape[0] if st else 1)
                         for r, st in zip(requests, states))
            self.budget.record_target(tokens, time.perf_counter() - t)
        self._proposed = None
        with torch.inference_mode():
            for r, st, s in zip(requests, states, starts):
                if not st:
                    continue
                f = self.head.target_feature(st).to(self.head_dtype)  # [n, F]
                cur = self._feats.get(r.req_id)
                if cur is not None and cur[0] <= s <= cur[0] + cur[1].shape[0]:
                    f = torch.cat([cur[1][: s - cur[0]], f])
                    s = cur[0]
                self._feats[r.req_id] = (s, f)
            # long stretches (prefill chunks) go into the cache now, so their features need not be kept
            long = [r for r in requests if self._pending(r) >= self.eager_rows]
            if long:
                self._feed_rows(long)

    def _pending(self, r: Request) -> int:
        """Rows whose feature and token are both known but that the cache lacks."""
        have = self._feats.get(r.req_id)
        kv = self.cache.kv
        if have is None:
            return 0
        lo = kv.length(r.req_id) if kv.has(r.req_id) else 0
        hi = min(have[0] + have[1].shape[0], r.num_tokens - 1)
        return hi - lo if have[0] <= lo else 0

    def _feed_rows(self, reqs: list[Request]) -> None:
        """Feed every complete row but the newest (kept for the next proposal's first step), no logits."""
        chunks, feats = [], []
        for r in reqs:
            kv = self.cache.kv
            if not kv.has(r.req_id):
                kv.add_sequence(r.req_id)
            s0, f = self._feats[r.req_id]
            lo = kv.length(r.req_id)
            hi = min(s0 + f.shape[0], r.num_tokens - 1) - 1
            if hi <= lo:
                continue
            chunks.append(Chunk(r.req_id, r.all_tokens[lo + 1:hi + 1], logits="none"))
            feats.append(f[lo - s0:hi - s0])
            self._feats[r.req_id] = (hi, f[hi - s0:])
        if chunks:
            self._run(chunks, torch.cat(feats), from_target=True)

    def _feed_range(self, r: Request) -> tuple[int, int] | None:
        """Rows [L, N) to feed before drafting (N = newest committed position), or None: features missing."""
        kv = self.cache.kv
        if not kv.has(r.req_id):
            kv.add_sequence(r.req_id)
        n = r.num_tokens - 1
        lo = kv.length(r.req_id)
        have = self._feats.get(r.req_id)
        if n < 1 or lo >= n or have is None:
            return None
        s0, f = have
        if s0 > lo or s0 + f.shape[0] < n:
            return None
        return lo, n

    def _run(self, chunks: list[Chunk], feats: torch.Tensor, from_target: bool):
        """One head forward over the chunks; returns (outputs [R, H], draft logits [R, Vd])."""
        step = self.cache.prepare(chunks)
        with torch.inference_mode():
            out, logits = self.head(step.input_ids, feats.to(self.cache.device), step.positions, step.meta,
                                    self.cache.kv, from_target, rows=step.logits_indices)
        for seq_id, n_len in zip(step.seq_ids, step.new_lens):
            self.cache.kv.set_length(seq_id, n_len)
        return out, logits

    def _extend(self, reqs: list[Request], ranges: list[tuple[int, int]]):
        """Feed the committed rows each request misses; (root outputs [R, H], root draft logits [R, Vd])."""
        chunks, feats = [], []
        for r, (lo, n) in zip(reqs, ranges):
            s0, f = self._feats[r.req_id]
            chunks.append(Chunk(r.req_id, r.all_tokens[lo + 1:n + 1]))
            feats.append(f[lo - s0:n - s0])
        return self._run(chunks, torch.cat(feats), from_target=True)

    def _settle(self, reqs: list[Request]) -> None:
        """Cut the cache back to rows 0..N-2 and drop the features it no longer needs (kept: from N-1)."""
        for r in reqs:
            keep = r.num_tokens - 2
            kv = self.cache.kv
            if kv.length(r.req_id) > keep:
                kv.truncate(r.req_id, max(keep, 0))
            s0, f = self._feats[r.req_id]
            cut = min(max(keep - s0, 0), f.shape[0])
            self._feats[r.req_id] = (s0 + cut, f[cut:])

    def _probs(self, reqs: list[Request], draft_logits: torch.Tensor, grammar: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(target-vocabulary logits [R, V], processed draft distributions [R, V]) for one row per request.
        grammar: mask each row by its request's grammar at its draft position (issue 14: q sees p's support)."""
        full = self.head.to_target_vocab(draft_logits)
        if grammar:
            states = [grammar_of(r) for r in reqs]
            if any(st is not None for st in states):
                apply_grammar_to_draft_logits(full, states)
        st = SamplingTensors.from_params([r.params for r in reqs], full.device)
        return full, logits_to_probs(full, st.temperature, st.top_k, st.top_p, st.min_p)

    # -- chains --------------------------------------------------------------------------------------------
    def propose(self, requests: list[Request], ks: list[int]) -> DraftProposal:
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active, ranges = [], []
        for i, (r, k) in enumerate(zip(requests, ks)):
            rng = self._feed_range(r) if k > 0 else None
            if rng is not None:
                active.append(i)
                ranges.append(rng)
        if not active:
            return DraftProposal(tokens, [None] * len(requests))
        group = [requests[i] for i in active]
        out, logits = self._extend(group, ranges)
        step_times = []
        while True:
            full, q = self._probs(group, logits, grammar=True)
            greedy = torch.tensor([r.params.temperature == 0 for r in group], device=q.device)
            u = torch.stack([torch.rand((), generator=r.generator) for r in group]).to(q.device)
            picked = torch.where(greedy, full.argmax(-1), sample_from_probs(q, u)).tolist()
            still = []
            for row, i in enumerate(active):
                g = grammar_of(requests[i])
                if g is not None and not g.draft_accept(picked[row]):
                    continue  # issue 14: the grammar has ended (only a stop token was left)
                tokens[i].append(picked[row])
                probs[i].append(q[row])
                if len(tokens[i]) < ks[i]:
                    still.append(row)
            if not still:
                break
            t = time.perf_counter()
            active = [active[row] for row in still]
            group = [requests[i] for i in active]
            sel = torch.tensor(still, device=out.device)
            out, logits = self._run([Chunk(requests[i].req_id, [tokens[i][-1]]) for i in active], out[sel],
                                    from_target=False)
            step_times.append(time.perf_counter() - t)
        for r in requests:  # issue 14: grammar matchers back at the committed tokens
            if grammar_of(r) is not None:
                grammar_of(r).draft_end()
        self._settle([requests[i] for i, _ in enumerate(requests) if tokens[i]])
        return DraftProposal(tokens, [torch.stack(p) if p else None for p in probs],
                             step_seconds=sum(step_times) / len(step_times) if step_times else None)

    # -- trees ----------------------------------------------------------------------------------------------
    def propose_tree(self, requests: list[Request]) -> TreeProposal:
        v = self.head.vocab_size
        ranges = [self._feed_range(r) for r in requests]
        live = [i for i, rng in enumerate(ranges) if rng is not None]
        trees = [_Tree(r.all_tokens[-1]) for r in requests]
        t_steps = []
        shape = self.budget.choose(len(live)) if self.budget is not None and live else \
            TreeBudget(self.tree_topk, self.tree_steps, self.tree_nodes)
        topk, n_steps, n_nodes = shape.topk, shape.steps, shape.nodes
        if live and shape.drafts:
            group = [requests[i] for i in live]
            t = time.perf_counter()
            out, logits = self._extend(group, [ranges[i] for i in live])
            bank = out  # every step's outputs, stacked: a node's children's feature is row tree.hidden[node]
            self._grow(group, [trees[i] for i in live], [[0] for _ in live], out, logits, topk, n_nodes, 0)
            if self.budget is not None:
                self.budget.record_head_step(sum(n - lo for lo, n in (ranges[i] for i in live)), time.perf_counter() - t)
            for step in range(1, n_steps):
                t = time.perf_counter()
                chunks, feat_rows, sel_rows, owners = [], [], [], []
                for i in live:
                    tree, r = trees[i], requests[i]
                    sel = tree.frontier(step, topk, r.params.temperature > 0, n_nodes)
                    if not sel:
                        continue
                    nodes = tree.closure(sel)  # non-root ancestors-or-self, by depth: sel last
                    root = r.num_tokens - 1
                    chunks.append(Chunk(r.req_id, [tree.tok[j] for j in nodes],
                                        positions=[root - 1 + tree.depth[j] for j in nodes],
                                        tree_mask=tree.mask(nodes), logits=len(sel)))
                    feat_rows += [tree.hidden[tree.parent[j]] for j in nodes]
                    owners.append(i)
                    sel_rows.append(sel)
                if not chunks:
                    break
                feats = bank.index_select(0, torch.tensor(feat_rows, device=bank.device))  # one gather for all
                out, logits = self._run(chunks, feats, from_target=False)
                for i in owners:  # the tree rows are scratch: back to the committed rows
                    self.cache.kv.truncate(requests[i].req_id, requests[i].num_tokens - 1)
                base = bank.shape[0]
                bank = torch.cat([bank, out])
                self._grow([requests[i] for i in owners], [trees[i] for i in owners], sel_rows, out, logits, topk,
                           n_nodes, base)
                t_steps.append(time.perf_counter() - t)
                if self.budget is not None:
                    self.budget.record_head_step(sum(len(c.token_ids) for c in chunks), t_steps[-1])
            self._settle(group)
        toks, parents, probs = [], [], []
        sampled_values = 0
        for r, tree in zip(requests, trees):
            keep = tree.keep(n_nodes) if r.params.temperature == 0 else list(range(len(tree.tok)))
            if self.budget is not None and r.params.temperature == 0 and len(keep) > 1:
                self._outcome[r.req_id] = (r.num_tokens, sum(math.exp(tree.score[j]) for j in keep[1:]))
                if sampled_values < self.budget.sample_trees:  # V of every sub-shape of this tree
                    self.budget.record_values(self.budget.tree_values(tree.parent, tree.depth, tree.score, tree.rank))
                    sampled_values += 1
            index = {j: a for a, j in enumerate(keep)}
            toks.append([tree.tok[j] for j in keep])
            parents.append([index[tree.parent[j]] if tree.parent[j] >= 0 else -1 for j in keep])
            if r.params.temperature > 0:
                rows = torch.zeros(len(keep), v, device=self.cache.device)
                for a, j in enumerate(keep):
                    if tree.q.get(j) is not None and any(tree.parent[c] == j for c in keep):
                        rows[a] = tree.q[j].float()
            else:  # never read (greedy verification): one zero row, broadcast, on the device
                rows = torch.zeros(1, v, device=self.cache.device).expand(len(keep), v)
            probs.append(rows)
        if self.budget is not None:
            self._proposed = (time.perf_counter(), {r.req_id: len(t) for r, t in zip(requests, toks)})
        return TreeProposal(toks, parents, probs, step_seconds=sum(t_steps) / len(t_steps) if t_steps else None)

    def _grow(self, reqs: list[Request], trees: list["_Tree"], expanded: list[list[int]], out: torch.Tensor,
              draft_logits: torch.Tensor, topk: int, budget: int, base: int) -> None:
        """Children of the expanded nodes (rows of out / logits in order): top-k (greedy) or i.i.d. draws;
        topk children per node, budget nodes in all (sampled trees). An expanded node's output (its children's
        feature) is row base + its row of the proposal's output bank."""
        row_req = [a for a, sel in enumerate(expanded) for _ in sel]
        k = min(topk, self.head.draft_vocab_size)
        q = None
        states = [grammar_of(r) for r in reqs]
        constrained = any(st is not None for st in states)
        if all(reqs[a].params.temperature == 0 for a in row_req) and not constrained:
            # greedy rows only: top-k over the draft vocabulary (the target's other tokens are -inf), no
            # target-vocabulary tensors
            top = draft_logits.float().log_softmax(-1).topk(k, dim=-1)
            ids = self.head.draft_to_target[top.indices]
        else:
            full = self.head.to_target_vocab(draft_logits)  # [rows, V]
            if constrained:  # issue 14: each expanded node's children from q masked by the grammar after its path
                words = bitmask_words(full.shape[-1])
                apply_bitmask_(full, torch.cat([
                    tree_node_masks(states[a], trees[a].tok, trees[a].parent, [node]) if states[a] is not None
                    else torch.full((1, words), ALL_ALLOWED, dtype=torch.int32)
                    for a, sel in enumerate(expanded) for node in sel]))
            st = SamplingTensors.from_params([reqs[a].params for a in row_req], full.device)
            q = logits_to_probs(full, st.temperature, st.top_k, st.top_p, st.min_p)
            top = full.log_softmax(-1).topk(k, dim=-1)
            ids = top.indices
        top_ids, top_lp = ids.tolist(), top.values.tolist()  # one host read for every row
        row = 0
        for a, (r, tree, sel) in enumerate(zip(reqs, trees, expanded)):
            for node in sel:
                tree.hidden[node] = base + row
                if r.params.temperature == 0:
                    for tok, lp in zip(top_ids[row], top_lp[row]):
                        tree.add(node, tok, tree.score[node] + lp)
                else:
                    m = min(k, budget - len(tree.tok))
                    if m > 0:
                        tree.q[node] = q[row]
                        u = torch.rand(m, generator=r.generator).to(q.device)
                        drawn = sample_from_probs(q[row].expand(m, -1), u)
                        lq = q[row][drawn].clamp_min(1e-30).log()
                        for tok, lp in zip(drawn.tolist(), lq.tolist()):
                            tree.add(node, tok, tree.score[node] + lp)
                row += 1

    # -- cache bookkeeping -------------------------------------------------------------------------------
    @property
    def kv(self):
        return self.cache.kv

    def blocks_needed(self, request: Request, tokens: int) -> int:
        """Blocks for `tokens` rows plus the scratch rows of a tree (at most topk x steps beyond them)."""
        kv = self.cache.kv
        have = len(kv.blocks(request.req_id)) if kv.has(request.req_id) else 0
        return max(0, -(-(tokens + self.tree_topk * self.tree_steps) // kv.block_size) - have)

    def rollback(self, request: Request, valid_len: int) -> None:
        drafted = self._outcome.pop(request.req_id, None)
        if drafted is not None and self.budget is not None:  # a verified tree: valid_len = root + accepted + 1
            self.budget.record_outcome(drafted[1], max(0, valid_len - drafted[0]))
        kv = self.cache.kv
        if kv.has(request.req_id) and kv.length(request.req_id) > valid_len:
            kv.truncate(request.req_id, valid_len)

    def release(self, request: Request) -> None:
        self.cache.kv.free(request.req_id)
        self._feats.pop(request.req_id, None)
        self._outcome.pop(request.req_id, None)

    def cached_length(self, request: Request) -> int | None:
        kv = self.cache.kv
        return kv.length(request.req_id) if kv.has(request.req_id) else 0


class _Tree:
    """A request's growing draft tree: node 0 is the root (the newest committed token)."""

    def __init__(self, root_token: int) -> None:
        self.tok, self.parent, self.depth, self.score = [root_token], [-1], [0], [0.0]
        self.rank = [0]  # a node's index among its parent's children (greedy: its top-k rank)
        self._nchild: dict[int, int] = {}
        self.hidden: dict[int, int] = {}  # node -> row of its head output (its children's feature) in the bank
        self.q: dict[int, torch.Tensor] = {}  # node -> processed draft distribution its children were drawn from

    def add(self, parent: int, token: int, score: float) -> None:
        self.tok.append(token)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.score.append(score)
        self.rank.append(self._nchild.get(parent, 0))
        self._nchild[parent] = self.rank[-1] + 1

    def frontier(self, depth: int, width: int, sampled: bool, budget: int) -> list[int]:
        """The `width` best nodes at `depth` (by cumulative log-probability) to expand next. A sampled tree
        stops expanding when its node budget is spent (a greedy one is pruned afterwards)."""
        if sampled and len(self.tok) >= budget:
            return []
        level = [j for j, d in enumerate(self.depth) if d == depth]
        return sorted(sorted(level, key=lambda j: -self.score[j])[:width])

    def closure(self, sel: list[int]) -> list[int]:
        nodes = set()
        for j in sel:
            while j > 0:
                nodes.add(j)
                j = self.parent[j]
        return sorted(nodes, key=lambda j: (self.depth[j], j))

    def mask(self, nodes: list[int]) -> torch.Tensor:
        """[n, n] bool: row a sees b iff nodes[b] is nodes[a] or one of its ancestors."""
        pos = {j: a for a, j in enumerate(nodes)}
        m = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)
        for a, j in enumerate(nodes):
            while j > 0:
                m[a, pos[j]] = True
                j = self.parent[j]
        return m

    def keep(self, budget: int) -> list[int]:
        """SGLang's final selection: the budget - 1 best non-root nodes, ancestor-closed (a parent scores at
        least its child's score and sorts first on ties), returned breadth first."""
        order = sorted(range(1, len(self.tok)), key=lambda j: (-self.score[j], self.depth[j], j))
        kept = {0}
        for j in order:
            if len(kept) >= budget:
                break
            if self.parent[j] in kept:
                kept.add(j)
        return sorted(kept, key=lambda j: (self.depth[j], j))
