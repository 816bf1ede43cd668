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

The tree is built on the device with fixed shapes (`grow_tree`: candidates in static slots, frontier and final
choice by pairwise ranks, the head run over static buffers), on the CPU and the GPU alike; the drafting phase
reads the host once, at its end. On CUDA (with a capturable attention backend) greedy batches replay CUDA
graphs: one for the draft extend per (batch bucket, rows), one for the whole tree per (batch bucket, shape)
(`_StaticDrafting`; `EagleDrafter(cuda_graphs=False)` runs the same code eagerly).

Overlapped rounds (`prelaunch`): in TreeRound's device path the next round's drafting (extend over the accepted
path + the whole tree) is queued from the device verdict, before the host reads it, so the GPU drafts while the
host commits, schedules and prepares the next verify step. The next proposal takes that tree when its plan (same
requests, same shape, no per-request caps, the rows the host verdict committed) is the one the prelaunch assumed;
otherwise it drafts again (the prelaunch wrote only head-cache rows the new drafting overwrites).
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from ..attention.metadata import AttnMetadata
from ..config import CacheConfig
from ..devices import Marks, h2d, kernels_on
from ..models.eagle_head import EagleHead, load_eagle_head
from ..request import Request
from ..structured import (ALL_ALLOWED, apply_bitmask_, apply_grammar_to_draft_logits, bitmask_words, grammar_of,  # issue 14
                          tree_node_masks)
from ..runtime.cuda_graph import capturing
from ..runtime.runner import Chunk, ModelRunner
from ..verify.probs import SamplingTensors, logits_to_probs, sample_from_probs
from ..kvcache.pool import OutOfBlocks
from .base import DraftProposal, Drafter, TreeProposal, subsequence_rows
from .eagle_budget import TreeBudget, TreeBudgetPolicy
from .tree_drafter import tree_depth_cap

MAX_EXTEND = 16  # draft extends of up to this many rows per request run from static buffers (graphs on CUDA)
HEAD_QUANTIZE_CHOICES = ("auto", "none", "int8", "int4")


def head_layout(target: ModelRunner, quantize: str | None = None) -> str:
    """The layout an EAGLE head's linears get next to this target (see EagleDrafter's `quantize`)."""
    choice = quantize or os.environ.get("FORERUN_EAGLE_QUANTIZE") or "auto"
    if choice not in HEAD_QUANTIZE_CHOICES:
        raise ValueError(f"EAGLE head quantize must be one of {', '.join(HEAD_QUANTIZE_CHOICES)}; got {choice!r}")
    if choice == "auto":
        layout = getattr(target.model, "quantization", "none")
        return layout if layout in ("int4", "int8") and torch.device(target.device).type == "cpu" else "none"
    if choice != "none" and torch.device(target.device).type != "cpu":
        raise ValueError(f"EAGLE head quantize={choice!r} is a CPU layout (the head is on {target.device})")
    return choice


def quantize_eagle_head(head: EagleHead, layout: str) -> EagleHead:
    """Hold the head's linears (fc, the layer's q/k/v and o, its MLP, the draft lm_head) quantized on the CPU,
    in place: every nn.Linear becomes what `forerun.models.quant.make_quantized_linear` builds for the target's
    own layers in `layout` ("int4": group-wise int4 through forerun's C kernel (Q4Linear) where it runs,
    else torch's int4pack, int8 for shapes int4 cannot take; "int8": per-row W8A8). Why: a drafting step streams
    the head's weights like a target decode streams the target's; fp32 made a head step (~220 MB) a large
    fraction of an int4 target decode (~1 GB). The norms, the target's embedding and a v1 head's target lm_head
    are left as they are. Training needs the float head (a quantized head is inference only)."""
    from torch import nn

    from ..models.quant import make_quantized_linear

    if layout not in ("int4", "int8"):
        raise ValueError(f"quantize_eagle_head: layout must be int4 or int8, got {layout!r}")
    if head.device.type != "cpu":
        raise ValueError(f"quantize_eagle_head: quantized linears are CPU modules (the head is on {head.device})")
    with torch.no_grad():
        for path, mod in list(head.named_modules()):
            if type(mod) is not nn.Linear:
                continue
            bias = None if mod.bias is None else mod.bias.detach().float()
            q = make_quantized_linear([mod.weight.detach().float()], bias, layout)
            parent, _, leaf = path.rpartition(".")
            setattr(head.get_submodule(parent) if parent else head, leaf, q)
    head.quantization = layout
    return head


class EagleDrafter(Drafter):
    name = "eagle"
    times_steps = True  # head steps after the first (draft extend) are timed in propose

    def __init__(self, target: ModelRunner, head: EagleHead | str | Path, *, cache: CacheConfig | None = None,
                 dtype: torch.dtype | None = None, tree_topk: int = 4, tree_steps: int = 4, tree_nodes: int = 16,
                 max_seqs: int = 256, max_batch_tokens: int = 8192, adaptive_budget: bool = False,
                 target_cost=None, cuda_graphs: bool | None = None, quantize: str | None = None,
                 tree_confidence: float = 0.0) -> None:
        """target: the target's runner (its model supplies embedding, final norm and, for EAGLE-1 heads,
        the lm_head). head: a loaded EagleHead or a checkpoint folder. cache: the head's KV pool (default
        sized like a 1-layer slice of the target's). Tree budget: tree_steps levels, tree_topk children per
        expanded node and frontier width, tree_nodes nodes in all (root included): fixed, or with
        adaptive_budget (or a target_cost: anything with target_time(tokens), the engine's CostModel) the
        maximum of a per-round budget chosen from the batch size and measured costs (forerun/drafters/eagle_budget.py).
        cuda_graphs: None (default) captures the tree drafting on CUDA when the attention backend allows it;
        False runs the same device code eagerly (debugging; or FORERUN_EAGLE_GRAPHS=0 in the environment).
        quantize: the head's linears on the CPU (`head_layout`): None / "auto" (default; FORERUN_EAGLE_QUANTIZE in
        the environment overrides it) = the target's layout when the target is a quantized CPU model (int4 / int8,
        forerun.models.quant, the same modules and kernels), else as loaded; "none" keeps the head as loaded (fp32);
        "int4" / "int8" pick one. A head passed in as a module is quantized in place.
        tree_confidence: 0 (default) verifies every kept node; c > 0 keeps, in each greedy tree, only the nodes whose
        cumulative draft probability (the product of the head's probabilities along the path from the root) is at
        least c, at most tree_nodes (the root always): each round's tree as large as the head's confidence makes
        it worth verifying, where every verify row costs (a CPU). What llama.cpp's --draft-p-min does for a chain.
        Sampled trees keep their static slots (the exact rule fixes them before any draw). The kept count is read
        on the host before the verify step (a synchronisation on a GPU, where the option has little to gain)."""
        if not 0.0 <= tree_confidence < 1.0:
            raise ValueError(f"EAGLE tree_confidence must be in [0, 1), got {tree_confidence}")
        if isinstance(head, (str, Path)):
            head = load_eagle_head(head, target.model, dtype=dtype or target.dtype, device=target.device)
        self.head_layout = head_layout(target, quantize)
        if self.head_layout != "none":
            quantize_eagle_head(head, self.head_layout)
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
        self.tree_confidence = float(tree_confidence)
        self.budget: TreeBudgetPolicy | None = None
        if adaptive_budget or target_cost is not None:
            self.use_target_cost(target_cost)
        self._outcome: dict[int, tuple[int, float]] = {}  # req -> (num_tokens when drafted, the tree's V)
        self._proposed: tuple[float, dict[int, int]] | None = None  # (perf_counter, req -> tree rows) for timing
        self._feats: dict[int, tuple[int, torch.Tensor]] = {}  # req -> (first position, [n, F] features)
        self.cuda_graphs = cuda_graphs
        self.static: _StaticDrafting | None = None  # static buffers + graphs of the drafting phase (first use)
        self.last_tree: DeviceTree | None = None  # the last proposal's tree on the device (tests, debugging)
        # queue the next round's drafting from the device verdict (TreeRound's device path): None = where the
        # drafting replays CUDA graphs (on the CPU the host runs the work itself: nothing to overlap), True / False
        # force it (tests run it on the CPU); FORERUN_EAGLE_PRELAUNCH=0 turns the automatic choice off
        self.overlap_trees: bool | None = None
        self._pre: _Prelaunch | None = None
        # used: taken by the next proposal (partial: for some of its requests, the others having finished)
        self.prelaunch_stats = {"launched": 0, "used": 0, "discarded": 0, "partial": 0}
        self._zero_row: torch.Tensor | None = None  # a greedy tree's draft probabilities (never read), broadcast

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
        with torch.inference_mode():
            feats = [self.head.target_feature(st).to(self.head_dtype) if st else None for st in states]  # [n, F]
        self._observe_features(requests, feats, starts)

    def observe_target_batch(self, requests: list[Request], states: dict[int, torch.Tensor], counts: list[int],
                             starts: list[int], features: torch.Tensor | None = None) -> None:
        """`observe_target` for rows laid out [R, m, H] per layer (states[layer][i, :counts[i]] are request i's
        newly committed rows, from position starts[i]): the features made in one call, and, when every request
        keeps the same number of earlier rows (the common case after a tree round: the root's), joined with
        them in one copy; rows past counts[i] are ignored. features: [R, m, F], those states' features already
        made (`prelaunch` made them)."""
        b = len(requests)
        if not b:
            return
        pre = self._pre
        if pre is not None and pre.req_ids == tuple(r.req_id for r in requests) and pre.roots == list(starts):
            pre.expect = [s + c for s, c in zip(starts, counts)]  # the newest committed position the host verdict gave
        feats = features if features is not None else self._batch_features(states)
        keep = []
        for r, s in zip(requests, starts):
            cur = self._feats.get(r.req_id)
            keep.append(s - cur[0] if cur is not None and cur[0] <= s <= cur[0] + cur[1].shape[0] else -1)
        if keep[0] < 0 or any(k != keep[0] for k in keep):  # the general bookkeeping, request by request
            return self._observe_features(requests, [feats[i, :c] for i, c in enumerate(counts)], starts)
        self._record_target(requests, counts)
        k = keep[0]
        with torch.inference_mode():
            if k:
                prev = torch.stack([self._feats[r.req_id][1][:k] for r in requests])
                feats = torch.cat([prev, feats], 1)
        for i, (r, s, c) in enumerate(zip(requests, starts, counts)):
            self._feats[r.req_id] = (s - k, feats[i, : k + c])
        long = [r for r in requests if self._pending(r) >= self.eager_rows]
        if long:
            self._feed_rows(long)

    def _batch_features(self, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """Target states [R, m, H] per layer -> the head's features [R, m, F] in one call."""
        b, m = next(iter(states.values())).shape[:2]
        with torch.inference_mode():
            feats = self.head.target_feature({layer: h.reshape(b * m, -1) for layer, h in states.items()})
            return feats.to(self.head_dtype).view(b, m, -1)

    def _record_target(self, requests: list[Request], counts: list[int]) -> None:
        if self._proposed is not None and self.budget is not None and self.budget.target_cost is None:
            t, rows = self._proposed  # the round's target forward (+ verification) since the proposal
            tokens = sum(rows.get(r.req_id) or c or 1 for r, c in zip(requests, counts))
            self.budget.record_target(tokens, time.perf_counter() - t)
        self._proposed = None

    def _observe_features(self, requests: list[Request], feats: list[torch.Tensor | None], starts: list[int]) -> None:
        """observe_target with the features already made (one [n_i, F] tensor per request; None: nothing new)."""
        self._record_target(requests, [0 if f is None else f.shape[0] for f in feats])
        with torch.inference_mode():
            for r, f, s in zip(requests, feats, starts):
                if f is None:
                    continue
                cur = self._feats.get(r.req_id)
                if cur is not None and cur[0] <= s <= cur[0] + cur[1].shape[0]:
                    f = torch.cat([cur[1][: s - cur[0]], f])
                    s = cur[0]
                self._feats[r.req_id] = (s, f)
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
        self._pre = None  # chains draft from the cache's rows as they are
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
        # greedy batches without grammars: argmax over the draft vocabulary, no target-vocabulary distributions
        # (greedy verification never reads q: probs None, a point mass, as the draft model's greedy rows)
        argmax_only = all(r.params.temperature == 0 and grammar_of(r) is None for r in group)
        out, logits = self._extend(group, ranges)
        step_times = []
        while True:
            if argmax_only:
                q = None
                picked = self.head.draft_to_target[logits.argmax(-1)].tolist()
            else:
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
                if q is not None:
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
    def propose_tree(self, requests: list[Request], max_drafts: list[int] | None = None) -> TreeProposal:
        return self.propose_tree_async(requests, max_drafts).result()

    @property
    def supports_async_tree(self) -> bool:
        """TreeRound may call `propose_tree_async` (not when a subclass drafts its trees another way)."""
        return type(self).propose_tree is EagleDrafter.propose_tree

    def propose_tree_async(self, requests: list[Request], max_drafts: list[int] | None = None) -> "TreeDraft":
        """Launch the drafting of every request's tree; the host read is deferred to `TreeDraft.result()` (its copy
        to the host is queued at once), so a round can launch the verification from the device tree first.
        `TreeDraft.device`: the tree batch on the device when every request drafted a tree of the same node count
        (all greedy, or all sampled), else None.

        Each tree fits its request (`_tree_caps`): no deeper than its tokens left minus one (`tree_depth_cap`) and
        at most max_drafts[i] nodes beyond the root (the engine's context room); a request with no room for one
        draft gets its root alone (a plain row)."""
        v = self.head.vocab_size
        pre, self._pre = self._pre, None  # a prelaunched tree is taken now or never (its buffers are reused)
        ranges = [self._feed_range(r) for r in requests]
        node_caps = list(max_drafts) if max_drafts is not None else [None] * len(requests)
        depth_caps = [tree_depth_cap(r, m) for r, m in zip(requests, node_caps)]
        live = [i for i, rng in enumerate(ranges) if rng is not None and depth_caps[i] > 0]
        shape = self.budget.choose(len(live)) if self.budget is not None and live else \
            TreeBudget(self.tree_topk, self.tree_steps, self.tree_nodes)
        self.last_tree = None
        tree = lay = marks = None
        dev_batch = used = None
        sizes = [1] * len(requests)
        reduced = False
        if live and shape.drafts:
            group = [requests[i] for i in live]
            lay, caps, live_sizes = self._tree_caps(group, shape, [depth_caps[i] for i in live],
                                                    [node_caps[i] for i in live])
            reduced = lay.steps < shape.steps or lay.nodes < shape.nodes
            rows = None if pre is None else pre.matches(requests, ranges, len(live), shape, lay, caps,
                                                         self.static.writes)
            if rows is not None:  # drafted during the last verification (for these requests and maybe others)
                marks, tree = pre.marks, pre.tree if rows == list(range(len(pre.req_ids))) else pre.tree.select(rows)
                for i in live:
                    self.cache.kv.set_length(requests[i].req_id, ranges[i][1])
                self.prelaunch_stats["used"] += 1
                self.prelaunch_stats["partial"] += len(rows) < len(pre.req_ids)
                pre, used = None, (pre.tree, rows)
            else:
                marks = Marks(self.cache.device)
                marks.mark()  # 0: drafting starts (1: launched)
                tree = self._draft_tree(group, [ranges[i] for i in live], lay, caps)
                marks.mark()
                if tree.kept is not None:  # the confidence cut: each tree's kept nodes (a prefix of its columns)
                    live_sizes = [min(n, int(row[-1])) for n, row in zip(live_sizes, tree.host)]
            tree.start_host_copy()
            self._settle(group)
            for i, n in zip(live, live_sizes):
                sizes[i] = n
            n = sizes[live[0]]
            if len(live) == len(requests) and n > 1 and all(sizes[i] == n for i in live):
                roots = h2d([r.last_token for r in requests], self.cache.device, torch.int64)
                parents = tree.parents[:, :n]  # a graph's output: the next prelaunch may overwrite it before a re-check
                dev_batch = DeviceTreeBatch(
                    n, torch.cat([roots[:, None], tree.tokens[:, 1:n]], 1),
                    parents.clone() if self._overlap_on() else parents,
                    tree.mask[:, :n, :n], tree.depth[:, :n], None if tree.probs is None else tree.probs[:, :n],
                    lay.steps)
            self.last_tree = tree
        if pre is not None:
            self.prelaunch_stats["discarded"] += 1
        if self.budget is not None:
            self._proposed = (time.perf_counter(), {r.req_id: s for r, s in zip(requests, sizes)})

        def finish() -> TreeProposal:
            toks = [[r.last_token] for r in requests]
            parents: list[list[int]] = [[-1] for _ in requests]
            probs: list[torch.Tensor | None] = [None] * len(requests)
            if tree is not None:
                host = tree.host  # the one host read of the drafting phase
                n_out = tree.nodes.shape[1]
                sampled_values = 0
                for a, i in enumerate(live):
                    r, row, n = requests[i], host[a], sizes[i]
                    toks[i] = [r.last_token] + [int(x) for x in row[1:n]]
                    parents[i] = [-1] + [int(x) for x in row[n_out + 1: n_out + n]]
                    if r.params.temperature > 0:
                        probs[i] = tree.probs[a, :n]
                    elif self.budget is not None and n > 1:
                        base = 2 * n_out
                        self._outcome[r.req_id] = (r.num_tokens, sum(math.exp(s) for s in row[base + 1: base + n]))
                        if sampled_values < self.budget.sample_trees and not reduced:  # V of every sub-shape
                            m = lay.num_slots
                            score = row[base + n_out: base + n_out + m]
                            par = [int(x) for x in row[base + n_out + m: base + n_out + 2 * m]]
                            self.budget.record_values(self.budget.tree_values(par, lay.depth, score, lay.rank))
                            sampled_values += 1
                if self.budget is not None:  # head cost: the mean step (extend + tree steps) at its mean rows
                    steps = 1 + tree.steps_run
                    rows = sum(n - lo for lo, n in (ranges[i] for i in live)) + len(live) * lay.topk * sum(
                        range(1, tree.steps_run + 1))
                    self.budget.record_head_step(rows / steps, marks.seconds(0, 1) / steps)
            for i in range(len(requests)):
                if probs[i] is None:  # greedy (never read): one zero row, broadcast, on the device (made once)
                    if self._zero_row is None or self._zero_row.shape[1] != v:
                        self._zero_row = torch.zeros(1, v, device=self.cache.device)
                    probs[i] = self._zero_row.expand(len(toks[i]), v)
            return TreeProposal(toks, parents, probs)

        return TreeDraft(finish, dev_batch, None if marks is None else (lambda: marks.seconds(0, 1)), prelaunched=used)

    def _overlap_on(self) -> bool:
        if self.overlap_trees is not None:
            return self.overlap_trees
        return self._graphs_on() and os.environ.get("FORERUN_EAGLE_PRELAUNCH", "1") != "0"

    def prelaunch(self, requests: list[Request], tree: DeviceTreeBatch, verdict, states: dict[int, torch.Tensor],
                  roots: list[int]) -> torch.Tensor | None:
        """Queue the next round's drafting from this round's device verdict, before the host reads it (TreeRound's
        device path, after the verification, the KV move and the gather of the committed rows' states).

        tree: this round's trees (n nodes each, node 0 the root at position roots[i]); verdict: the device
        verdict (num_accepted [R], accepted_nodes [R, n] root first, output_token_ids [R, n]: the a accepted
        drafts then the bonus token); states[layer]: [R, s + 1, H] target states of the path's rows (root
        first, rows past the path unused). If request i accepts a drafts, the next proposal feeds head rows
        roots[i] - 1 .. roots[i] + a (the kept root row again, the path, the bonus token: a + 2 rows, laid out
        as s + 2 with padding) and grows its tree from ctx = roots[i] + a + 1: all of it from the device, in the
        extend graph of s + 2 rows and the tree graph the next proposal would replay.

        Returns the path rows' features [R, s + 1, F] (for `observe_target_batch`), or None when nothing was
        queued: overlap off, a sampled or grammar-constrained request, a head cache not at roots[i] - 1, a
        budget that may cap the next tree, a confidence cut (its tree size is read on the host), or too few free
        head-cache blocks."""
        if not self._overlap_on() or self.static is None or not requests or self.tree_confidence > 0:
            return None
        if any(r.params.temperature > 0 or grammar_of(r) is not None for r in requests):
            return None
        kv, st = self.cache.kv, self.static
        b = len(requests)
        s = next(iter(states.values())).shape[1] - 1
        qe = s + 2
        prev_rows = []
        for r, root in zip(requests, roots):  # the kept root row's feature (position root - 1) and the cache there
            have = self._feats.get(r.req_id)
            if not kv.has(r.req_id) or kv.length(r.req_id) != root - 1 or have is None:
                return None
            s0, f = have
            if not s0 <= root - 1 < s0 + f.shape[0]:
                return None
            prev_rows.append(f[root - 1 - s0])
        shape = self.budget.choose(b, record=False) if self.budget is not None else \
            TreeBudget(self.tree_topk, self.tree_steps, self.tree_nodes)
        if not shape.drafts:
            return None
        lay = TreeLayout.get(min(shape.topk, self.head.draft_vocab_size), shape.steps, shape.nodes)
        # worth it only if the next tree is uncapped whatever this round accepts
        if any(r.remaining - (s + 1) - 1 < lay.steps for r in requests):
            return None
        graphs = self._graphs_on()
        if qe > st.max_extend or (graphs and st.bucket(b) is None):
            return None
        ends = [max(root + s + 1 + lay.topk * (lay.steps - 1), root - 1 + qe) for root in roots]
        need = sum(max(0, -(-e // kv.block_size) - len(kv.blocks(r.req_id))) for r, e in zip(requests, ends))
        if kv.num_free_blocks < need + b:  # keep a spare block per request for the scheduler's own reservations
            return None
        try:
            for r, e in zip(requests, ends):
                kv.reserve(r.req_id, e)
        except OutOfBlocks:
            return None
        dev = self.cache.device
        feats = self._batch_features(states)  # [R, s + 1, F]
        with torch.inference_mode():
            marks = Marks(dev)
            marks.mark()
            st.extend_from_verdict(requests, roots, tree.tokens, verdict, torch.stack(prev_rows), feats, graphs)
            max_len = max(ends)
            out = st.tree_graph(lay, b, max_len) if graphs else st.tree_eager(lay, b, None, max_len)
            marks.mark()
        out.start_host_copy()
        self._pre = _Prelaunch(tuple(r.req_id for r in requests), list(roots), shape, lay, out, marks, st.writes)
        self.prelaunch_stats["launched"] += 1
        return feats

    def prelaunched(self) -> tuple["DeviceTree", int] | None:
        """The tree batch the last `prelaunch` queued and the node count per tree that the next proposal keeps of it
        when it takes it (uncapped greedy trees), or None (nothing queued)."""
        pre = self._pre
        if pre is None:
            return None
        lay = pre.lay
        return pre.tree, min(lay.greedy_nodes, lay.slots_upto(lay.steps), pre.shape.nodes)

    def _tree_caps(self, group: list[Request], shape: TreeBudget, depth_caps: list[int],
                   max_drafts: list[int | None]) -> tuple["TreeLayout", tuple[list[int], list[int]] | None, list[int]]:
        """The batch's layout and each tree's size when trees must fit their requests. The layout is the shape cut
        to the deepest and largest tree any request takes (steps = max depth cap, nodes = max node cap); request i
        keeps at most depth_caps[i] levels and 1 + max_drafts[i] nodes: a greedy tree its best candidates of depth
        <= its cap, a sampled one the first of its static slots (ids are breadth first, so a prefix is
        ancestor-closed; which slots are kept is fixed before any draw, as the exact rule needs).
        Returns (layout, caps, sizes): caps = (depth caps, nodes kept, root included) for `grow_tree` when some
        request keeps less than the layout gives it, else None; sizes = nodes kept per request."""
        k = min(shape.topk, self.head.draft_vocab_size)
        dc = [min(shape.steps, d) for d in depth_caps]
        nc = [shape.nodes - 1 if m is None else min(shape.nodes - 1, m) for m in max_drafts]
        lay = TreeLayout.get(k, max(dc), min(shape.nodes, 1 + max(nc)))
        sizes, capped = [], False
        for r, d, c in zip(group, dc, nc):
            if r.params.temperature == 0:
                full = lay.greedy_nodes
                n = min(full, lay.slots_upto(d), 1 + c)
                capped |= d < lay.steps
            else:
                full = len(lay.s_nodes)
                n = min(full, lay.s_upto(d), 1 + c)
            capped |= n < full
            sizes.append(n)
        return lay, ((dc, sizes) if capped else None), sizes

    def capture_graphs(self, batch_sizes=(1,), shapes: list[tuple[int, int, int]] | None = None,
                       extend_rows: list[int] | None = None) -> int:
        """Capture the drafting graphs before serving or timing (otherwise each is captured on its first use):
        the draft extend per batch bucket and extend length (default 1 .. steps + 2, what a round after an
        accepted path feeds) and the tree per bucket and shape (default the configured one and the same cut to
        each fewer number of steps, what a request near its end drafts: `_tree_caps`), each also in its variant with
        per-request caps (a batch whose requests are at different distances from their ends). Returns how many
        graphs exist; 0 when graphs are off (CPU, an attention backend that cannot be captured,
        cuda_graphs=False). `Engine.warmup` calls it for the engine's batch buckets."""
        if not self._graphs_on():
            return 0
        self._pre = None  # capturing replays every graph over dummy inputs
        if self.static is None:
            self.static = _StaticDrafting(self)
        shapes = shapes or [(self.tree_topk, s, self.tree_nodes) for s in range(self.tree_steps, 0, -1)]
        rows = extend_rows or list(range(1, max(s for _, s, _ in shapes) + 3))
        for b in batch_sizes:
            for qe in rows:
                self.static.capture(b, qe=qe)
            for k, s, n in shapes:
                lay = TreeLayout.get(min(k, self.head.draft_vocab_size), s, n)
                for capped in (False, True):
                    self.static.capture(b, lay=lay, capped=capped)
        return len(self.static.graphs)

    def _graphs_on(self) -> bool:
        """Capture the drafting phase in CUDA graphs: on CUDA with a capturable attention backend (the target's,
        which the head shares), unless turned off (`cuda_graphs=False`)."""
        if self.cuda_graphs is False or self.cache.device.type != "cuda":
            return False
        if self.cuda_graphs is None and os.environ.get("FORERUN_EAGLE_GRAPHS", "1") == "0":  # debugging switch
            return False
        return bool(getattr(self.target.model.backend, "supports_cuda_graphs", False))

    def _draft_tree(self, group: list[Request], ranges: list[tuple[int, int]], lay: "TreeLayout",
                    caps: tuple[list[int], list[int]] | None = None) -> "DeviceTree":
        """Draft extend + the whole dynamic tree on the device. Greedy batches without grammars replay one CUDA
        graph for the extend (per batch bucket and extend length) and one for the tree (per bucket and shape; trees
        capped per request, `_tree_caps`, have their own) when graphs are on; every other batch runs the same code
        eagerly."""
        if self.static is None:
            self.static = _StaticDrafting(self)
        st = self.static
        graphs = self._graphs_on()
        sampled = any(r.params.temperature > 0 for r in group)
        states = [grammar_of(r) for r in group]
        constrained = any(s is not None for s in states)
        tree_graph = graphs and not sampled and not constrained
        kv = self.cache.kv
        qe = max(n - lo for lo, n in ranges)
        for r, (lo, n) in zip(group, ranges):  # room for the extend's padding and the tree's scratch rows
            kv.reserve(r.req_id, max(n + lay.topk * (lay.steps - 1), lo + qe))
        st.extend(group, ranges, graphs)
        for r, (lo, n) in zip(group, ranges):
            kv.set_length(r.req_id, n)
        max_len = max(n for _, n in ranges) + lay.topk * (lay.steps - 1)
        if caps is not None:
            st.set_caps(caps, len(group), lay)
        if tree_graph:
            return st.tree_graph(lay, len(group), max_len, capped=caps is not None)
        sample = None
        if sampled or constrained:
            dev = self.cache.device
            greedy = h2d([r.params.temperature == 0 for r in group], dev, torch.bool)
            u = torch.full((len(group), lay.num_slots), 0.5)
            idx = torch.tensor(lay.s_nodes[1:], dtype=torch.long)
            for a, r in enumerate(group):  # drawn in node order, as the host tree drew them
                if r.params.temperature > 0 and idx.numel():
                    u[a, idx] = torch.rand(idx.numel(), generator=r.generator)
            roots = h2d([r.last_token for r in group], dev, torch.int64)
            hook = self._grammar_hook(group, states, lay) if constrained else None
            sample = _Sampling(greedy, SamplingTensors.from_params([r.params for r in group], dev), h2d(u, dev),
                               roots, hook)
        return st.tree_eager(lay, len(group), sample, max_len, capped=caps is not None)

    def _grammar_hook(self, group: list[Request], states: list, lay: "TreeLayout"):
        """issue 14: each expanded node's children come from q masked by the grammar after its path (host work:
        the partial tree is read back once per step; grammar-constrained batches never run in a graph)."""
        sampled = [r.params.temperature > 0 for r in group]

        def hook(t: int, parents: torch.Tensor, full: torch.Tensor, tok: torch.Tensor, par: torch.Tensor) -> None:
            words = bitmask_words(full.shape[-1])
            tl, pl, nl = tok.tolist(), par.tolist(), parents.tolist()
            rows = []
            for a, g in enumerate(states):
                for f, node in enumerate(nl[a]):
                    valid = not sampled[a] or f < lay.s_front[t]
                    rows.append(tree_node_masks(g, tl[a], pl[a], [node]) if g is not None and valid
                                else torch.full((1, words), ALL_ALLOWED, dtype=torch.int32))
            apply_bitmask_(full, torch.cat(rows))

        return hook

    # -- cache bookkeeping -------------------------------------------------------------------------------
    @property
    def kv(self):
        return self.cache.kv

    def blocks_needed(self, request: Request, tokens: int) -> int:
        """Blocks for `tokens` rows plus scratch rows: a tree's (topk x (steps - 1) beyond them) or the static
        extend's padding (up to its max_extend rows)."""
        kv = self.cache.kv
        have = len(kv.blocks(request.req_id)) if kv.has(request.req_id) else 0
        return max(0, -(-(tokens + max(self.tree_topk * self.tree_steps, MAX_EXTEND)) // kv.block_size) - have)

    def rollback(self, request: Request, valid_len: int) -> None:
        drafted = self._outcome.pop(request.req_id, None)
        if drafted is not None and self.budget is not None:  # a verified tree: valid_len = root + accepted + 1
            self.budget.record_outcome(drafted[1], max(0, valid_len - drafted[0]))
        kv = self.cache.kv
        if kv.has(request.req_id) and kv.length(request.req_id) > valid_len:
            kv.truncate(request.req_id, valid_len)

    def release(self, request: Request) -> None:
        kv = self.cache.kv
        kv.free(request.req_id, self.prefix_key(request.committed_prefix) if kv.prefix_caching else None)
        self._feats.pop(request.req_id, None)
        self._outcome.pop(request.req_id, None)

    # -- prefix caching: the head's row i reads the target's state at i and token i + 1, so its pool names rows by
    # token pairs (a cached row is reused only where both match); the target may take from its own cache no more
    # positions than the head holds, since the head is fed the target's states from where its cache stops
    prefix_shift = 1

    def prefix_key(self, tokens: list[int]) -> list[int]:
        return [(a << 32) | b for a, b in zip(tokens, tokens[1:])]

    def attach_prefix(self, request: Request) -> int | None:
        kv = self.cache.kv
        if not kv.prefix_caching:
            return None
        if not kv.has(request.req_id):  # every row the tokens name (the next row reads a token not sampled yet)
            key = self.prefix_key(request.all_tokens)
            kv.add_sequence(request.req_id, key, limit=len(key))
        return kv.length(request.req_id)

    def cached_length(self, request: Request) -> int | None:
        kv = self.cache.kv
        return kv.length(request.req_id) if kv.has(request.req_id) else 0


class _Prelaunch:
    """A next round's drafting queued from a device verdict (`EagleDrafter.prelaunch`) and what it assumed."""

    def __init__(self, req_ids: tuple, roots: list[int], shape: TreeBudget, lay: "TreeLayout", tree: "DeviceTree",
                 marks: Marks, writes: int) -> None:
        self.req_ids, self.roots, self.shape, self.lay, self.tree, self.marks = req_ids, roots, shape, lay, tree, marks
        self.writes = writes  # the static buffers' write count after it (a later write reuses its outputs)
        self.expect: list[int] | None = None  # per request the newest committed position (observe_target_batch)

    def matches(self, requests: list[Request], ranges: list, live: int, shape: TreeBudget, lay: "TreeLayout",
                caps, writes: int) -> list[int] | None:
        """The proposal's plan is the one drafted: its requests among those drafted for, in the same order (some
        may have finished since), all drafting, the same shape and layout, no per-request caps, each request
        feeding rows roots - 1 .. the committed end, and nothing run over the static buffers since. Returns the
        drafted rows of the requests (one each), or None."""
        if not (self.expect is not None and writes == self.writes and live == len(requests) and caps is None
                and shape == self.shape and lay is self.lay):
            return None
        rows = subsequence_rows([r.req_id for r in requests], self.req_ids)
        if rows is None or any(rng != (self.roots[j] - 1, self.expect[j]) for rng, j in zip(ranges, rows)):
            return None
        return rows



# -- the dynamic tree on the device ---------------------------------------------------------------------------
def _not_capturing(device: torch.device) -> None:
    """Constants made inside a CUDA graph capture would only be filled by its replays: they are made in the warm-up
    runs before it (`_StaticDrafting._get`)."""
    assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), "a tree constant made while capturing"


class TreeLayout:
    """Where every candidate of a dynamic tree (topk K, steps S, nodes n) lives: fixed shapes for the device.

    Node 0 is the root; level 1 holds the root's K children (nodes 1..K, by rank); level d >= 2 holds K children of
    each of the K frontier nodes of level d - 1 (frontier position f, rank r: node lo[d] + f * K + r). That is the
    order a host-built tree adds nodes in, so a greedy tree's node ids are the host tree's.
    Greedy trees keep the n - 1 best candidates; sampled trees (children drawn i.i.d.; counts fixed before the
    draws while the node budget lasts) use a static subset of the slots (`s_valid`, `s_nodes`)."""

    _cache: dict = {}

    @classmethod
    def get(cls, topk: int, steps: int, nodes: int) -> "TreeLayout":
        key = (topk, steps, nodes)
        if key not in cls._cache:
            cls._cache[key] = cls(topk, steps, nodes)
        return cls._cache[key]

    def __init__(self, topk: int, steps: int, nodes: int) -> None:
        if topk < 1 or steps < 1 or nodes < 2:
            raise ValueError(f"tree needs topk >= 1, steps >= 1, nodes >= 2 (got {topk}, {steps}, {nodes})")
        k = topk
        self.topk, self.steps, self.nodes = topk, steps, nodes
        self.size = [1, k] + [k * k] * (steps - 1)  # nodes per level 0..S
        self.lo = [0, 1]
        for d in range(2, steps + 1):
            self.lo.append(self.lo[-1] + self.size[d - 1])
        self.num_slots = self.lo[steps] + self.size[steps]  # M
        self.depth = [d for d in range(steps + 1) for _ in range(self.size[d])]
        self.rank = [0] + [i % k for d in range(1, steps + 1) for i in range(self.size[d])]
        self.greedy_nodes = min(nodes, self.num_slots)
        # sampled trees: the root gets min(k, n - 1) children; step t expands the best min(k, level) nodes of level
        # t (none once the budget is spent), each by min(k, what is left) children, in frontier order
        valid = [True] + [False] * (self.num_slots - 1)
        self.s_front = [1] + [0] * (steps - 1)  # frontier nodes per step (step 0: the root)
        self.s_children = [[0] * k for _ in range(steps)]  # [step][frontier position]
        count = 1
        m = min(k, nodes - count)
        self.s_children[0][0] = m
        for r in range(m):
            valid[1 + r] = True
        count += m
        for t in range(1, steps):
            if count >= nodes:
                break
            lvl = sum(valid[self.lo[t]: self.lo[t] + self.size[t]])
            self.s_front[t] = min(k, lvl)
            for f in range(self.s_front[t]):
                m = max(0, min(k, nodes - count))
                self.s_children[t][f] = m
                for r in range(m):
                    valid[self.lo[t + 1] + f * k + r] = True
                count += m
        self.s_valid = valid
        self.s_nodes = [j for j in range(self.num_slots) if valid[j]]
        self.s_steps = max(t for t in range(steps) if self.s_front[t] > 0)  # tree steps a sampled tree needs
        # bank slot of a frontier node (0: the root; 1 + (t-1) k + f: step t's f-th): has it children (sampled)?
        self.s_bank_children = [self.s_children[0][0] > 0] + [
            self.s_children[t][f] > 0 for t in range(1, steps) for f in range(k)]
        self._dev: dict = {}

    def slots_upto(self, depth: int) -> int:
        """Candidate slots of depth <= depth, root included (slots are in depth order)."""
        d = min(depth, self.steps)
        return self.lo[d] + self.size[d]

    def s_upto(self, depth: int) -> int:
        """A sampled tree's nodes of depth <= depth, root included (a prefix of `s_nodes`)."""
        return sum(1 for j in self.s_nodes if self.depth[j] <= depth)

    def consts(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Index tensors on the device (made once, outside any capture)."""
        key = str(device)
        if key not in self._dev:
            _not_capturing(device)
            k, s = self.topk, self.steps
            rows = max((s - 1) * k, 1)
            self._dev[key] = dict(
                depth=torch.tensor(self.depth, dtype=torch.long, device=device),
                s_valid=torch.tensor(self.s_valid, dtype=torch.bool, device=device),
                s_nodes=torch.tensor(self.s_nodes, dtype=torch.long, device=device),
                s_bank_children=torch.tensor(self.s_bank_children, dtype=torch.bool, device=device),
                row_depth=torch.arange(rows, device=device) // k + 1,  # frontier row -> its depth
                eye=torch.eye(rows, dtype=torch.bool, device=device),
                ar=torch.arange(max(self.num_slots, rows) + 2, device=device),
            )
        return self._dev[key]

    def step_rows(self, device: torch.device, r_: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a batch of r_ trees, per tree step t (row t - 1): the head's query starts [S-1, R+1] (t K rows per
        request) and the rows whose logits are wanted [S-1, R K] (each request's last K); made once per batch."""
        key = (str(device), "rows", r_)
        if key not in self._dev:
            _not_capturing(device)
            k, s = self.topk, self.steps
            tk = torch.arange(1, max(s, 2), device=device)[:, None] * k  # [S-1, 1] (one dummy row when S = 1)
            ar_r = torch.arange(r_ + 1, device=device)
            qsl = ar_r[None, :] * tk
            want = ar_r[None, :r_, None] * tk[:, :, None] + (tk - k)[:, :, None] + torch.arange(k, device=device)
            self._dev[key] = (qsl.contiguous(), want.reshape(tk.shape[0], r_ * k).contiguous())
        return self._dev[key]


class _Sampling:
    """What the eager (non-graph) tree needs beyond greedy: per request a greedy flag, the sampling parameters,
    uniforms per slot (drawn on the host from each request's generator, in node order), the root tokens, and
    an optional grammar hook(step, parents, full logits, tok, par) that masks `full` in place."""

    def __init__(self, greedy, st, u, roots, hook=None, all_sampled: bool = False) -> None:
        self.greedy, self.st, self.u, self.roots, self.hook = greedy, st, u, roots, hook
        self.all_sampled = all_sampled  # no greedy request: stop once the sampled trees' budget is spent


class DeviceTreeBatch:
    """R trees of n nodes each, on the device, as the verification wants them: tokens [R, n] (root included),
    parents [R, n] (local, -1 at the root), mask [R, n, n] (ancestor-or-self), depth [R, n], probs [R, n, V]
    (sampled batches; None for greedy ones), max_depth (a bound on any node's depth)."""

    def __init__(self, n, tokens, parents, mask, depth, probs, max_depth) -> None:
        self.n, self.tokens, self.parents, self.mask, self.depth = n, tokens, parents, mask, depth
        self.probs, self.max_depth = probs, max_depth


class TreeDraft:
    """A launched tree proposal: `device` (a DeviceTreeBatch, or None when the trees' sizes differ) at once,
    the host TreeProposal from `result()` (which waits for the drafting phase's one host read); `seconds()`: the
    drafting phase's device time (None: nothing drafted), also when it was queued during the last round."""

    def __init__(self, finish, device: DeviceTreeBatch | None, seconds=None,
                 prelaunched: "tuple[DeviceTree, list[int]] | None" = None) -> None:
        self._finish, self.device, self._prop = finish, device, None
        self.seconds = seconds
        # when this is the tree batch the last round's `prelaunch` queued: (that batch, the rows of it taken, one per
        # request: all of them, or those of the requests still running when some finished)
        self.prelaunched = prelaunched

    def result(self) -> TreeProposal:
        if self._prop is None:
            self._prop = self._finish()
        return self._prop


class DeviceTree:
    """A drafted tree batch on the device (fixed shapes), plus its host copy after the one read.

    nodes [R, n]: kept node ids (root first, ascending = breadth first); tokens [R, n] (column 0 unset: the
    root's token is the host's); parents [R, n]: parent's column (-1 for the root); depth [R, n] and mask
    [R, n, n] (column j is node i or one of its ancestors: the verify tree mask), made by the drafting body (also
    inside its graph), or computed from parents on first use; probs [R, n, V] (sampled batches only); packed [R, *] float64: tokens, parents, kept scores, every
    candidate's score and parent. After a graph replay these are the graph's tensors: valid until the next
    proposal."""

    def __init__(self, out: dict[str, torch.Tensor], batch: int, steps_run: int) -> None:
        self.nodes, self.tokens, self.parents = (out[k][:batch] for k in ("nodes", "tokens", "parents"))
        self.packed = out["packed"][:batch]
        self.probs = out["probs"][:batch] if out.get("probs") is not None else None
        # kept nodes per request, root included, under the drafter's tree_confidence (None without one): also the
        # last column of `packed`, so the host reads it with the tree
        self.kept = out["kept"][:batch] if out.get("kept") is not None else None
        self.steps_run = steps_run
        self._host = None
        # (mask, depth) when the drafting computed them (the static drafting's graphs do), else made on first use
        self._mask = (out["mask"][:batch], out["depth"][:batch]) if out.get("mask") is not None else None

    def select(self, rows: list[int]) -> "DeviceTree":
        """These requests' rows (copies: a prelaunched batch taken after some of its requests finished)."""
        idx = h2d(rows, self.tokens.device, torch.int64)
        pick = lambda x: None if x is None else x.index_select(0, idx)  # noqa: E731
        mask, depth = self.mask, self.depth
        t = DeviceTree({"nodes": pick(self.nodes), "tokens": pick(self.tokens), "parents": pick(self.parents),
                        "packed": pick(self.packed), "probs": pick(self.probs), "mask": pick(mask),
                        "depth": pick(depth), "kept": pick(self.kept)}, len(rows), self.steps_run)
        return t

    @property
    def mask(self) -> torch.Tensor:
        """[R, n, n] verify tree mask: the drafting graph's output, or computed on the device on first use."""
        if self._mask is None:
            self._mask = tree_mask_and_depth(self.parents, self.steps_run + 1)
        return self._mask[0]

    @property
    def depth(self) -> torch.Tensor:
        self.mask
        return self._mask[1]

    def start_host_copy(self) -> None:
        """Queue the copy of `packed` to (pinned) host memory now; `host` then waits for this copy only, not for
        work queued after it (the verification launched from the device tree)."""
        if self.packed.device.type != "cuda" or self._host is not None or getattr(self, "_event", None) is not None:
            return
        self._pinned = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
        self._pinned.copy_(self.packed, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    @property
    def host(self) -> list[list[float]]:
        if self._host is None:
            if getattr(self, "_event", None) is not None:
                self._event.synchronize()
                self._host = self._pinned.tolist()
            else:
                self._host = self.packed.tolist()  # the drafting phase's only synchronisation
        return self._host


def _rank(key: torch.Tensor, tri: torch.Tensor) -> torch.Tensor:
    """[R, L] -> each entry's place in a stable ascending sort (ties: lower index first), by pairwise
    comparison: fixed shapes, elementwise kernels, identical on every device (no sort kernel)."""
    a, b = key[:, :, None], key[:, None, :]  # [R, i, 1], [R, 1, j]
    return ((b < a) | ((b == a) & tri)).sum(-1)


def _first(chosen: torch.Tensor, count: int, first: torch.Tensor | None = None) -> torch.Tensor:
    """[R, L] bool with `count` True per row -> their indices [R, count], ascending (entries with `first` False
    after those with it True)."""
    r, n = chosen.shape
    if first is None:
        pos = chosen.long().cumsum(1) - 1
    else:
        a, b = chosen & first, chosen & ~first
        pos = torch.where(a, a.long().cumsum(1) - 1, a.long().sum(1, keepdim=True) + b.long().cumsum(1) - 1)
    pos = torch.where(chosen, pos, torch.full_like(pos, count))
    out = torch.zeros(r, count + 1, dtype=torch.long, device=chosen.device)
    out.scatter_(1, pos, torch.arange(n, device=chosen.device).expand(r, n))
    return out[:, :count]


def grow_tree(head: EagleHead, kv, lay: TreeLayout, root_out: torch.Tensor, root_logits: torch.Tensor,
              ctx: torch.Tensor, tables: torch.Tensor, block_size: int, max_seq_len: int,
              sample: _Sampling | None = None,
              caps: tuple[torch.Tensor, torch.Tensor] | None = None,
              min_score: float | None = None) -> dict[str, torch.Tensor]:
    """The dynamic tree of R requests, with fixed-shape device ops only (no host reads, no data-dependent shapes):
    capturable in one CUDA graph when `sample` is None (every request greedy, no grammar).

    root_out [R, H], root_logits [R, Vd]: the draft extend's last row (the root's output and its children's
    logits); ctx [R]: rows in the head's cache (the root's row is ctx - 1); tables [R, W]: the head's block tables
    (the tree's scratch rows ctx .. ctx + K (S-1) - 1 reserved). Step t (1..S-1) selects the K best nodes of level
    t (cumulative log-probability, float64, ties to the lower id) and runs the head over every frontier node of
    steps 1..t (K t rows per request, at positions ctx - 1 + depth, each seeing the committed rows and its own
    ancestors: the tree mask), whose last K outputs give the next level. Greedy requests keep the n - 1 best
    candidates (ancestor-closed: a parent never scores below its child and sorts first on ties).
    caps (depth [R], nodes [R], root included; `EagleDrafter._tree_caps`): request i keeps at most nodes[i] nodes
    of depth <= depth[i] (greedy: its best such candidates; sampled: the first nodes[i] of its static slots); the
    columns past nodes[i] of every output hold no node (id M) and are never read.
    min_score (log of the drafter's tree_confidence): greedy requests keep only candidates whose cumulative
    log-probability is >= min_score (ancestor-closed too: a child never scores above its parent); `kept` [R] (also
    packed's last column) then holds each request's kept node count, root included. On the CPU a greedy batch
    stops growing at the first level where no candidate reaches it (the slots not grown score -inf).
    Greedy trees on CUDA whose shape fits (`fused_tree_kernels`) keep the bookkeeping between the head's steps in
    forerun/kernels/eagle_tree.py's few Triton launches (the same arithmetic) and return the verify step's mask and
    depth too (`mask` / `depth`)."""
    dev = root_out.device
    c = lay.consts(dev)
    r_, k, s = root_out.shape[0], lay.topk, lay.steps
    m_, hid = lay.num_slots, root_out.shape[1]
    rows_max = max((s - 1) * k, 1)
    full_path = sample is not None
    if sample is None and min_score is None and fused_tree_kernels(dev, lay):
        return _grow_tree_fused(head, kv, lay, root_out, root_logits, ctx, tables, block_size, max_seq_len, caps)
    steps_run = lay.s_steps if sample is not None and sample.all_sampled else s - 1
    tok, score, par, bank, anc, front, fpar = _tree_buffers(lay, root_out, torch.bool)
    if sample is not None:
        tok[:, 0] = sample.roots
    qbank = None
    valid = None
    if sample is not None:
        g = sample.greedy[:, None]
        valid = g | c["s_valid"][None, :]  # [R, M]
        qbank = torch.zeros(r_, 1 + rows_max, head.vocab_size, dtype=torch.float32, device=dev)

    def expand(t: int, parents: torch.Tensor, logits: torch.Tensor) -> None:
        """Children of the level-t parents [R, P] (rows of logits in order) into level t + 1."""
        p = parents.shape[1]
        lo = lay.lo[t + 1]
        if not full_path:  # greedy only: top-k over the draft vocabulary
            top = logits.float().log_softmax(-1).topk(k, dim=-1)
            ids, lp = head.draft_to_target[top.indices], top.values
        else:
            full = head.to_target_vocab(logits)
            if sample.hook is not None:
                sample.hook(t, parents, full, tok, par)
            st = sample.st
            q = logits_to_probs(full, st.temperature.repeat_interleave(p), st.top_k.repeat_interleave(p),
                                st.top_p.repeat_interleave(p), st.min_p.repeat_interleave(p))  # [R P, V]
            top = full.log_softmax(-1).topk(k, dim=-1)
            u = sample.u[:, lo: lo + p * k].reshape(-1)
            drawn = sample_from_probs(q.repeat_interleave(k, 0), u).view(r_ * p, k)
            lq = q.gather(1, drawn).clamp_min(1e-30).log()
            gr = sample.greedy.repeat_interleave(p)[:, None]
            ids, lp = torch.where(gr, top.indices, drawn), torch.where(gr, top.values, lq)
            slots = 0 if t == 0 else slice(1 + (t - 1) * k, 1 + t * k)
            qbank[:, slots] = q.view(r_, p, -1) if t else q
        blk = slice(lo, lo + p * k)
        tok[:, blk] = ids.reshape(r_, p * k)
        score[:, blk] = (score.gather(1, parents)[:, :, None] + lp.double().view(r_, p, k)).reshape(r_, p * k)
        par[:, blk] = parents[:, :, None].expand(r_, p, k).reshape(r_, p * k)

    expand(0, torch.zeros(r_, 1, dtype=torch.long, device=dev), root_logits)
    if steps_run:
        pos_all, slots_all = _frontier_rows(lay, ctx, tables, block_size)
        ar_r = torch.arange(r_ + 1, device=dev)
    # a confidence cut on the CPU: once no candidate of a level reaches min_score none deeper can (a child never
    # scores above its parent), so the head's remaining steps are skipped (a host read a step: nothing is captured
    # in a graph there; greedy batches only, a sampled tree's slots are static)
    stop_early = min_score is not None and sample is None and dev.type == "cpu"
    for t in range(1, steps_run + 1):
        lo, size = lay.lo[t], lay.size[t]
        if stop_early and not bool((score[:, lo: lo + size] >= min_score).any()):
            score[:, lo:] = float("-inf")  # (this level and the ones never grown: all below the cut)
            break
        key = -score[:, lo: lo + size] + 0.0  # + 0.0: no -0.0
        ok = None
        if valid is not None:
            ok = valid[:, lo: lo + size]
            key = torch.where(ok, key, torch.full_like(key, float("inf")))
        tri = c["ar"][None, :size] < c["ar"][:size, None]  # [i, j]: j < i
        chosen = _rank(key, tri[None]) < k
        sel = _first(chosen, k, ok)  # [R, K] level positions, ascending (sampled: valid ones first)
        rows = slice((t - 1) * k, t * k)
        front[:, rows] = lo + sel
        ar_k = c["ar"][:k]
        if t == 1:
            fpar[:, rows] = 0
        else:
            ppos = sel // k  # the parent's frontier position at step t - 1
            fpar[:, rows] = 1 + (t - 2) * k + ppos
            anc[:, rows] = anc.gather(1, ((t - 2) * k + ppos)[:, :, None].expand(r_, k, rows_max))
        anc[:, rows] |= c["eye"][rows]  # a frontier row sees itself
        # the head over the frontier rows of steps 1..t
        n = t * k
        ids = tok.gather(1, front[:, :n])  # [R, n]
        feats = bank.gather(1, fpar[:, :n, None].expand(r_, n, hid)).reshape(r_ * n, hid)
        positions = pos_all[:, :n].reshape(-1)
        meta = AttnMetadata(query_start_loc=ar_r * n, seq_lens=ctx + n, block_tables=tables,
                            slot_mapping=slots_all[:, :n].reshape(-1), max_query_len=n, max_seq_len=max_seq_len,
                            tree_mask=anc[:, :n, :n].reshape(r_ * n, n))
        want = (ar_r[:r_, None] * n + ((t - 1) * k + ar_k)[None, :]).reshape(-1)
        out, logits = head(ids.reshape(-1), feats, positions, meta, kv, False, rows=want)
        bank[:, 1 + (t - 1) * k: 1 + t * k] = out.view(r_, k, hid)
        expand(t, lo + sel, logits)

    # final selection: greedy trees keep the n - 1 best candidates (SGLang's), sampled trees every valid slot
    nodes = _greedy_kept(score, lay, c, caps, min_score)
    n_out = lay.greedy_nodes
    if sample is not None:
        ns = len(lay.s_nodes)
        n_out = max(n_out, ns)
        pad = lambda x, fill: torch.cat([x, torch.full((r_, n_out - x.shape[1]), fill, dtype=x.dtype, device=dev)], 1)  # noqa: E731
        nodes = torch.where(sample.greedy[:, None], pad(nodes, m_), pad(c["s_nodes"][None].expand(r_, ns), m_))
        if caps is not None:  # sampled trees: the first ncap slots (breadth first: ancestor-closed)
            nodes = torch.where(c["ar"][None, :n_out] < caps[1][:, None], nodes, torch.full_like(nodes, m_))
    nodes_c, tokens, parents, packed = _kept_tree(nodes, tok, par, score)
    kept = None
    if min_score is not None:
        kept = (nodes < m_).sum(1)
        packed = torch.cat([packed, kept.double()[:, None]], 1)
    probs = None
    if qbank is not None:
        fslot = torch.full((r_, m_ + 1), -1, dtype=torch.long, device=dev)
        fslot[:, 0] = 0
        nf = steps_run * k
        if nf:
            fslot.scatter_(1, front[:, :nf], 1 + torch.arange(nf, device=dev).expand(r_, nf))
        bslot = fslot.gather(1, nodes_c)  # bank slot of each kept node if it was expanded, else -1
        has = (bslot >= 0) & c["s_bank_children"][bslot.clamp_min(0)] & (nodes < m_)
        if caps is not None:  # a kept node whose children were all cut is a leaf: its row is zero, as for any leaf
            live_par = torch.where((nodes < m_) & (parents >= 0), parents, torch.full_like(parents, n_out))
            has_child = torch.zeros(r_, n_out + 1, dtype=torch.bool, device=dev)
            has_child.scatter_(1, live_par, torch.ones_like(live_par, dtype=torch.bool))
            has = has & has_child[:, :n_out]
        probs = qbank.gather(1, bslot.clamp_min(0)[:, :, None].expand(r_, n_out, qbank.shape[-1]))
        probs = probs * has[:, :, None]
    return dict(nodes=nodes, tokens=tokens, parents=parents, probs=probs, packed=packed, kept=kept)


def _tree_buffers(lay: "TreeLayout", root_out: torch.Tensor, anc_dtype: torch.dtype, init: bool = True):
    """grow_tree's per-request state (R = root_out's rows, M slots, RM frontier rows): tok [R, M], score [R, M]
    float64, par [R, M] (-1), bank [R, 1 + RM, H] (expanded nodes' outputs, the root's first), anc [R, RM, RM]
    (frontier row sees frontier row), front [R, RM] (frontier row -> node id), fpar [R, RM] (frontier row -> its
    feature's bank slot). init=False: left empty (the fused path's `tree_init` sets what is read before written)."""
    r_, hid = root_out.shape
    m_, rows_max, dev = lay.num_slots, max((lay.steps - 1) * lay.topk, 1), root_out.device
    new = torch.zeros if init else torch.empty
    tok = new(r_, m_, dtype=torch.long, device=dev)
    score = new(r_, m_, dtype=torch.float64, device=dev)
    par = torch.full((r_, m_), -1, dtype=torch.long, device=dev) if init else new(r_, m_, dtype=torch.long, device=dev)
    bank = new(r_, 1 + rows_max, hid, dtype=root_out.dtype, device=dev)
    if init:
        bank[:, 0] = root_out
    anc = new(r_, rows_max, rows_max, dtype=anc_dtype, device=dev)
    front = new(r_, rows_max, dtype=torch.long, device=dev)
    fpar = new(r_, rows_max, dtype=torch.long, device=dev)
    return tok, score, par, bank, anc, front, fpar


def _frontier_rows(lay: "TreeLayout", ctx: torch.Tensor, tables: torch.Tensor, block_size: int):
    """RoPE positions and cache slots [R, RM] of every frontier row (each step's rows are a prefix of them; the
    slots are the scratch rows after ctx)."""
    c = lay.consts(ctx.device)
    rows_max = max((lay.steps - 1) * lay.topk, 1)
    pos_all = ctx[:, None] - 1 + c["row_depth"][None, :]
    return pos_all, cache_slots(tables, ctx[:, None] + c["ar"][None, :rows_max], block_size)


def cache_slots(tables: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache positions pos [R, q] of R sequences (KV block tables [R, W]) -> their cache slots [R, q] (the kernels'
    `_slot_of`)."""
    return tables.gather(1, pos // block_size) * block_size + pos % block_size


def _greedy_kept(score: torch.Tensor, lay: "TreeLayout", c: dict, caps, min_score: float | None = None
                 ) -> torch.Tensor:
    """grow_tree's greedy final selection: [R, n] node ids (root first, then the n - 1 best candidates ascending;
    with caps, columns past a request's node cap hold M and deeper candidates rank last; with min_score, only
    candidates scoring >= it are kept, the columns past them M)."""
    r_, m_ = score.shape
    key = -score[:, 1:] + 0.0
    tri = c["ar"][None, : m_ - 1] < c["ar"][: m_ - 1, None]
    ng = lay.greedy_nodes
    if caps is None and min_score is None:
        kept = _first(_rank(key, tri[None]) < ng - 1, ng - 1) + 1  # [R, n - 1] ascending ids
    else:  # candidates deeper than the request's cap (or below min_score) rank last (ties keep them last too)
        inf = torch.full_like(key, float("inf"))
        want = torch.full((r_, 1), ng - 1, dtype=torch.long, device=score.device)  # [R, 1] candidates kept
        if caps is not None:
            dcap, ncap = caps
            key = torch.where(c["depth"][None, 1:] <= dcap[:, None], key, inf)
            want = ncap.clamp_max(ng)[:, None] - 1
        if min_score is not None:
            key = torch.where(score[:, 1:] >= min_score, key, inf)
            want = torch.minimum(want, (key < float("inf")).sum(1, keepdim=True))
        kept = _first(_rank(key, tri[None]) < want, ng - 1) + 1
        kept = torch.where(c["ar"][None, : ng - 1] < want, kept, torch.full_like(kept, m_))
    return torch.cat([torch.zeros(r_, 1, dtype=torch.long, device=score.device), kept], 1)


def _kept_tree(nodes: torch.Tensor, tok: torch.Tensor, par: torch.Tensor, score: torch.Tensor):
    """Kept node ids [R, n] (M: none) -> (ids clamped to a slot, tokens, parent columns (-1: the root, or a
    parent not kept), packed [R, 3 n + 2 M] float64: tokens, parents, kept scores, every slot's score and parent)."""
    r_, n_out = nodes.shape
    m_ = score.shape[1]
    nodes_c = nodes.clamp_max(m_ - 1)
    inv = torch.full((r_, m_ + 1), -1, dtype=torch.long, device=nodes.device)
    inv.scatter_(1, nodes, torch.arange(n_out, device=nodes.device).expand(r_, n_out))
    pnode = par.gather(1, nodes_c)
    parents = torch.where(pnode >= 0, inv.gather(1, pnode.clamp_min(0)), torch.full_like(pnode, -1))
    parents[:, 0] = -1
    tokens = tok.gather(1, nodes_c)
    packed = torch.cat([tokens.double(), parents.double(), score.gather(1, nodes_c), score, par.double()], 1)
    return nodes_c, tokens, parents, packed


def fused_kernels_on(device: torch.device) -> bool:
    """Whether drafting uses forerun/kernels/eagle_tree.py's kernels (the tree's bookkeeping, the extend's inputs):
    on CUDA by default (FORERUN_EAGLE_FUSED=0: the torch ops; =1: also elsewhere, e.g. the CPU under Triton's
    interpreter)."""
    return kernels_on("FORERUN_EAGLE_FUSED", device)


def fused_tree_kernels(device: torch.device, lay: TreeLayout) -> bool:
    """Whether greedy trees of this shape grow with the kernels (`fused_kernels_on` and a shape they take)."""
    if not fused_kernels_on(device):
        return False
    from forerun.kernels.eagle_tree import fits
    return fits(lay.topk, lay.num_slots, max((lay.steps - 1) * lay.topk, 1), lay.greedy_nodes)


def _grow_tree_fused(head: EagleHead, kv, lay: TreeLayout, root_out: torch.Tensor, root_logits: torch.Tensor,
                     ctx: torch.Tensor, tables: torch.Tensor, block_size: int, max_seq_len: int,
                     caps: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """grow_tree for greedy trees, its bookkeeping in Triton kernels (one step: select_step, the feature gather,
    the head, the bank write, expand_topk's two launches); the same tensors and arithmetic as the torch path."""
    from forerun.kernels.eagle_tree import expand_topk, final_select, select_step, tree_init
    dev = root_out.device
    c = lay.consts(dev)
    r_, k, s = root_out.shape[0], lay.topk, lay.steps
    hid, rows_max = root_out.shape[1], max((s - 1) * k, 1)
    d2t = head.draft_to_target
    # (each small torch kernel costs ~2-3 us of the device even inside a graph: the state starts empty, one launch
    # sets the root's slot, the frontier rows' positions and slots are made inside select_step)
    tok, score, par, bank, anc, front, fpar = _tree_buffers(lay, root_out, torch.uint8, init=False)
    tree_init(tok, score, par, bank, root_out)
    expand_topk(root_logits, k, d2t, c["ar"][:1].expand(r_, 1), score, tok, par, lay.lo[1])  # parent: slot 0
    qsl, want = lay.step_rows(dev, r_)
    for t in range(1, s):
        lo, size, n = lay.lo[t], lay.size[t], t * k
        ids, positions, slots, tmask, seq_lens, fidx = select_step(
            score, tok, front, fpar, anc, ctx, tables, block_size, lo, size, t, k)
        feats = bank.view(r_ * (1 + rows_max), hid).index_select(0, fidx)
        meta = AttnMetadata(query_start_loc=qsl[t - 1], seq_lens=seq_lens, block_tables=tables,
                            slot_mapping=slots, max_query_len=n, max_seq_len=max_seq_len, tree_mask=tmask)
        out, logits = head(ids, feats, positions, meta, kv, False, rows=want[t - 1])
        bank[:, 1 + (t - 1) * k: 1 + t * k] = out.view(r_, k, hid)
        expand_topk(logits, k, d2t, front[:, (t - 1) * k: t * k], score, tok, par, lay.lo[t + 1])
    return final_select(score, tok, par, c["depth"], lay.greedy_nodes, s, caps)


def tree_mask_and_depth(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [R, n] (parent columns, -1 at the root) -> (ancestor-or-self mask [R, n, n], depth [R, n]): the
    verification's tree mask and RoPE offsets, by max_depth pointer hops on the device (fixed shapes)."""
    r, n = parents.shape
    cols = torch.arange(n, device=parents.device)
    mask = (cols[:, None] == cols[None, :]).expand(r, n, n).clone()
    depth = torch.zeros(r, n, dtype=torch.long, device=parents.device)
    cur = cols[None].expand(r, n)
    for _ in range(max_depth):
        cur = torch.where(cur >= 0, parents.gather(1, cur.clamp_min(0)), cur)
        mask |= (cur[:, :, None] == cols[None, None, :]) & (cur[:, :, None] >= 0)
        depth += (cur >= 0).long()
    return mask, depth


class _Captured:
    def __init__(self, graph, body, out) -> None:
        self.graph, self.body, self.out = graph, body, out


class _StaticDrafting:
    """Static buffers for the drafting phase and its CUDA graphs (as forerun/runtime/cuda_graph.py captures the
    target's steps: warm-up on a side stream, inputs copied into static tensors, outputs read from the graph's).

    Extend: every request feeds q_e rows (its missing committed rows, then padding rows in scratch positions
    after them that nothing reads), one graph per (batch bucket, q_e <= max_extend); the root's output and logits
    land in `root_out` / `root_logits`. Tree: one graph per (batch bucket, tree shape) over those buffers.
    Padding sequences of a bucket live in KV block 0 (the pool never hands it out), as the target's do."""

    def __init__(self, drafter: "EagleDrafter", batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                 max_extend: int = MAX_EXTEND) -> None:
        runner, head = drafter.cache, drafter.head
        self.drafter, self.head, self.kv = drafter, head, runner.kv
        dev = self.device = runner.device
        self.bs = runner.kv.block_size
        self.max_seqs = runner.buffers.max_seqs
        self.width = runner.buffers.max_blocks
        self.max_seq_len = self.width * self.bs
        self.batch_sizes = tuple(b for b in sorted(set(batch_sizes)) if b <= self.max_seqs)
        self.max_extend = max_extend
        self.fused_inputs = fused_kernels_on(dev)  # the extend's positions / slots / rows in one launch
        self._qsl: dict[tuple[int, int], torch.Tensor] = {}  # the extend's query starts per (batch, rows)
        big = self.batch_sizes[-1] if self.batch_sizes else 1
        i64 = dict(dtype=torch.long, device=dev)
        self.ids = torch.zeros(big * max_extend, **i64)
        self.feats = torch.zeros(big * max_extend, head.eagle.feature_size, dtype=drafter.head_dtype, device=dev)
        self.lo = torch.zeros(self.max_seqs, **i64)
        self.nlast = torch.zeros(self.max_seqs, **i64)
        self.ctx = torch.zeros(self.max_seqs, **i64)
        self.tables = torch.zeros(self.max_seqs, self.width, **i64)
        self.root_out = torch.zeros(self.max_seqs, head.config.hidden_size, dtype=drafter.head_dtype, device=dev)
        self.root_logits = torch.zeros(self.max_seqs, head.draft_vocab_size, dtype=torch.float32, device=dev)
        self.dcap = torch.zeros(self.max_seqs, **i64)  # per request: deepest level kept (trees capped per request)
        self.ncap = torch.ones(self.max_seqs, **i64)  # per request: nodes kept, root included
        self.graphs: dict[tuple, _Captured] = {}
        self._pool = None
        self.replays = 0
        self.writes = 0  # runs of any body over the static buffers (a prelaunched tree is valid while unchanged)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= n), None)

    # -- bodies (fixed shapes over the static buffers) ---------------------------------------------------------
    def _extend_body(self, b: int, qe: int, max_seq_len: int | None = None):
        """max_seq_len: a bound on the batch's KV lengths (graphs: the tables' capacity; an eager call passes the
        real one, which the reference attention off the CPU sizes its gather by)."""
        head, kv, bs = self.head, self.kv, self.bs
        dev = self.device
        max_seq_len = max_seq_len or self.max_seq_len

        fused = self.fused_inputs
        qsl = self._qsl.get((b, qe))  # (made once per shape, outside any graph: the body is built on every call)
        if qsl is None:
            qsl = self._qsl[(b, qe)] = torch.arange(b + 1, device=dev) * qe

        def body() -> None:
            tables = self.tables[:b]
            if fused:  # one launch instead of ~10 small kernels (each ~2-3 us of the device, graph or not)
                from forerun.kernels.eagle_tree import extend_rows
                pos, slots, seq_lens, rows = extend_rows(self.lo[:b], self.nlast[:b], tables, bs, qe)
            else:
                pos = self.lo[:b, None] + torch.arange(qe, device=dev)[None, :]  # [b, qe]
                slots = cache_slots(tables, pos, bs).reshape(-1)
                pos = pos.reshape(-1)
                seq_lens = self.lo[:b] + qe
                rows = torch.arange(b, device=dev) * qe + self.nlast[:b]
            meta = AttnMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables, slot_mapping=slots,
                                max_query_len=qe, max_seq_len=max_seq_len)
            out, logits = head(self.ids[: b * qe], self.feats[: b * qe], pos, meta, kv, True, rows=rows)
            self.root_out[:b].copy_(out)
            self.root_logits[:b].copy_(logits)

        return body

    def _tree_body(self, lay: TreeLayout, b: int, sample: _Sampling | None = None, max_seq_len: int | None = None,
                   capped: bool = False):
        """capped: per-request depth and node caps from `dcap` / `ncap` (set_caps)."""
        hops = (lay.s_steps if sample is not None and sample.all_sampled else lay.steps - 1) + 1
        conf = self.drafter.tree_confidence
        min_score = math.log(conf) if conf > 0 else None

        def body() -> dict[str, torch.Tensor]:
            out = grow_tree(self.head, self.kv, lay, self.root_out[:b], self.root_logits[:b], self.ctx[:b],
                            self.tables[:b], self.bs, max_seq_len or self.max_seq_len, sample,
                            (self.dcap[:b], self.ncap[:b]) if capped else None, min_score)
            # the verify step's tree mask and depths in the same graph (~30 small kernels launched for free; the
            # fused kernels make them with the final selection)
            if out.get("mask") is None:
                out["mask"], out["depth"] = tree_mask_and_depth(out["parents"], hops)
            return out

        return body

    def set_caps(self, caps: tuple[list[int], list[int]], n: int, lay: TreeLayout) -> None:
        """Per-request caps of n requests (one host -> device copy); the padding rows of any bucket keep the root."""
        dc, nc = caps
        both = h2d(list(dc) + list(nc), self.device, torch.long)
        self.dcap[:n].copy_(both[:n])
        self.ncap[:n].copy_(both[n:])
        self.dcap[n:].fill_(lay.steps)
        self.ncap[n:].fill_(1)

    # -- capture ---------------------------------------------------------------------------------------------
    def _dummy(self, b: int, qe: int) -> None:
        """An all-padding batch (block 0 only) for warm-up and capture."""
        self.tables[:b].zero_()
        self.lo[:b].zero_()
        self.nlast[:b].fill_(qe - 1)
        self.ctx[:b].fill_(qe)
        self.ids[: b * qe].zero_()
        self.feats[: b * qe].zero_()

    def _get(self, key: tuple, body, b: int, qe: int) -> _Captured:
        cap = self.graphs.get(key)
        if cap is not None:
            return cap
        if self.device.type != "cuda":  # CPU (tests): the same bodies and bucket padding, run eagerly
            cap = self.graphs[key] = _Captured(None, body, None)
            return cap
        self.writes += 1
        with torch.inference_mode():
            self._dummy(b, qe)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles Triton kernels, sets up cuBLAS
                    body()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self._pool):
                out = body()
        cap = self.graphs[key] = _Captured(graph, body, out)
        return cap

    def capture(self, n: int, qe: int | None = None, lay: TreeLayout | None = None, capped: bool = False) -> None:
        """Capture the extend graph (qe rows) or the tree graph (lay; capped: its per-request-capped variant, as
        `tree_graph` keys it) of n requests' bucket ahead of use (between rounds: the static inputs are refilled by
        every call)."""
        b = self.bucket(n)
        if b is None:
            return
        if qe is not None and qe <= self.max_extend and b * qe <= self.ids.numel():
            self._get(("extend", b, qe), self._extend_body(b, qe), b, qe)
        if lay is not None:
            self._get(self._tree_key(b, lay, capped), self._tree_body(lay, b, capped=capped), b, 1)

    @staticmethod
    def _tree_key(b: int, lay: TreeLayout, capped: bool) -> tuple:
        """A tree graph's key: bucket, shape, and whether it reads per-request caps."""
        return ("tree", b, lay.topk, lay.steps, lay.nodes) + (("capped",) if capped else ())

    def _replay(self, cap: _Captured):
        self.replays += 1
        self.writes += 1
        if cap.graph is None:
            with torch.inference_mode():
                return cap.body()
        cap.graph.replay()
        return cap.out

    # -- the two phases ----------------------------------------------------------------------------------------
    def _fill_ints(self, n: int, b: int, lo: list[int], nlast: list[int], ctx: list[int], reqs: list[Request]) -> None:
        """lo / nlast / ctx and block tables of n real sequences (one host -> device copy), padding up to b."""
        kv = self.kv
        tables = [kv.blocks(r.req_id) for r in reqs]
        w = max(len(t) for t in tables)
        flat = [x for t in tables for x in t + [0] * (w - len(t))]
        dev = h2d(lo + nlast + ctx + flat, self.device, torch.long)
        parts = dev.split([n, n, n, n * w])
        self.lo[:n].copy_(parts[0])
        self.nlast[:n].copy_(parts[1])
        self.ctx[:n].copy_(parts[2])
        self.tables[:n, :w].copy_(parts[3].view(n, w))
        if b > n:  # padding sequences: block 0 only
            self.tables[n:b].zero_()
            self.lo[n:b].zero_()
            self.ctx[n:b].fill_(1)

    def extend(self, reqs: list[Request], ranges: list[tuple[int, int]], graphs: bool) -> None:
        """Feed the rows each request misses; the root's output / logits into root_out / root_logits[:len]."""
        self.writes += 1
        d = self.drafter
        n = len(reqs)
        qe = max(hi - lo for lo, hi in ranges)
        b = self.bucket(n) if graphs else n
        if qe > self.max_extend or b is None or b * qe > self.ids.numel():  # long or big: one ragged forward
            out, logits = d._extend(reqs, ranges)
            self.root_out[:n].copy_(out)
            self.root_logits[:n].copy_(logits)
            self._fill_ints(n, self.bucket(n) if graphs and self.bucket(n) else n, [lo for lo, _ in ranges],
                            [0] * n, [hi for _, hi in ranges], reqs)
            return
        cap = self._get(("extend", b, qe), self._extend_body(b, qe), b, qe) if graphs else None
        body = self._extend_body(b, qe, max(lo for lo, _ in ranges) + qe) if cap is None else None
        ids, feats = [], []
        zf = self.feats[:0]
        zero = torch.zeros(max(qe, (b - n) * qe), zf.shape[1], dtype=zf.dtype, device=zf.device)  # padding rows
        for r, (lo, hi) in zip(reqs, ranges):
            s0, f = d._feats[r.req_id]
            m = hi - lo
            ids += r.all_tokens[lo + 1: hi + 1] + [0] * (qe - m)
            feats.append(f[lo - s0: hi - s0])
            if m < qe:
                feats.append(zero[: qe - m])
        if b > n:
            ids += [0] * ((b - n) * qe)
            feats.append(zero[: (b - n) * qe])
        self.ids[: b * qe].copy_(h2d(ids, self.device, torch.long))
        self.feats[: b * qe].copy_(torch.cat(feats))
        self._fill_ints(n, b, [lo for lo, _ in ranges], [hi - lo - 1 for lo, hi in ranges],
                        [hi for _, hi in ranges], reqs)
        if b > n:
            self.nlast[n:b].fill_(qe - 1)
        if cap is None:
            with torch.inference_mode():
                body()
        else:
            self._replay(cap)

    def extend_from_verdict(self, reqs: list[Request], roots: list[int], tree_tokens: torch.Tensor, verdict,
                            prev: torch.Tensor, feats: torch.Tensor, graphs: bool) -> None:
        """`extend` over each request's accepted path, its rows laid out on the device from the verdict
        (EagleDrafter.prelaunch): request i feeds s + 2 rows from position roots[i] - 1 (the kept root row, the
        path, the bonus token, padding past it) and ends at roots[i] + a_i + 1. tree_tokens [n, >= s + 1] (this
        round's trees, the root's token first), verdict: num_accepted [n], accepted_nodes [n, >= s + 1],
        output_token_ids [n, >= s + 1]; prev [n, F] the features at roots[i] - 1, feats [n, s + 1, F] the path rows'.
        Ids, features, lengths and block tables go into the static buffers in one launch on CUDA
        (forerun/kernels/round_prep.py `extend_inputs`). The caller checked s + 2 <= max_extend and, with graphs,
        the bucket."""
        n, qe = feats.shape[0], feats.shape[1] + 1
        b = self.bucket(n) if graphs else n
        cap = self._get(("extend", b, qe), self._extend_body(b, qe), b, qe) if graphs else None  # (a capture
        self.writes += 1  # runs over dummy inputs: before the inputs go in)
        table = self.kv.block_table([r.req_id for r in reqs])  # [n, W], padded with block 0
        stage = h2d(torch.cat([torch.tensor(list(roots) + [root - 1 for root in roots]), table.reshape(-1)]),
                    self.device, torch.long)  # one copy: roots, lo, block tables
        if kernels_on("FORERUN_PREP_KERNELS", self.device):
            from ..kernels.round_prep import extend_inputs as prep
        else:
            from ..kernels.round_prep import extend_inputs_torch as prep
        prep(tree_tokens, verdict.accepted_nodes, verdict.output_token_ids, verdict.num_accepted, stage, prev, feats,
             self.ids, self.feats, self.lo, self.nlast, self.ctx, self.tables)
        if b > n:  # padding sequences: block 0 only
            self.ids[n * qe: b * qe].zero_()
            self.feats[n * qe: b * qe].zero_()
            self.tables[n:b].zero_()
            self.lo[n:b].zero_()
            self.ctx[n:b].fill_(1)
            self.nlast[n:b].fill_(qe - 1)
        if cap is not None:
            self._replay(cap)
        else:
            self._extend_body(b, qe, max(roots) - 1 + qe)()

    def tree_graph(self, lay: TreeLayout, n: int, max_len: int | None = None, capped: bool = False) -> DeviceTree:
        """The greedy tree of n requests from the static buffers: a graph replay (bucket padded; eager beyond the
        largest bucket, with max_len bounding the KV lengths). capped: per-request caps (set_caps), a graph of its own."""
        b = self.bucket(n)
        if b is None:
            return self.tree_eager(lay, n, None, max_len, capped)
        key = self._tree_key(b, lay, capped)
        cap = self.graphs.get(key)
        if cap is None:  # capture over a dummy batch, then put this round's inputs back
            saved = [x[:b].clone() for x in (self.lo, self.nlast, self.ctx, self.tables, self.root_out,
                                              self.root_logits)]
            cap = self._get(key, self._tree_body(lay, b, capped=capped), b, 1)
            for x, y in zip((self.lo, self.nlast, self.ctx, self.tables, self.root_out, self.root_logits), saved):
                x[:b].copy_(y)
        return DeviceTree(self._replay(cap), n, lay.steps - 1)

    def tree_eager(self, lay: TreeLayout, n: int, sample: _Sampling | None, max_seq_len: int | None = None,
                   capped: bool = False) -> DeviceTree:
        self.writes += 1
        with torch.inference_mode():
            out = self._tree_body(lay, n, sample, max_seq_len, capped)()
        steps = lay.s_steps if sample is not None and sample.all_sampled else lay.steps - 1
        return DeviceTree(out, n, steps)


class _Tree:
    """A candidate tree as host lists (node 0 the root; parent, depth, cumulative score, rank among siblings):
    what `TreeBudgetPolicy.tree_values` reads. Drafting builds its trees on the device (`grow_tree`); this record
    is for tables built by hand (tests, benchmarks)."""

    def __init__(self, root_token: int) -> None:
        self.tok, self.parent, self.depth, self.score, self.rank = [root_token], [-1], [0], [0.0], [0]
        self._nchild: dict[int, int] = {}

    def add(self, parent: int, token: int, score: float) -> None:
        self.tok.append(token)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.score.append(score)
        self.rank.append(self._nchild.get(parent, 0))
        self._nchild[parent] = self.rank[-1] + 1
