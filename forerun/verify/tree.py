"""Tree verification: greedy, SGLang's target-only sampling, exact multi-draft sampling, typical.

Input (SGLang's layout, flattened like the chain): request r's tree has n_r = seqlens_q[r] nodes in
rows ftp[r] .. ftp[r] + n_r - 1; node 0 is the root (the last committed token); `parents` [T] holds
local parent indices (-1 at roots, parent[i] < i); node_token_ids [T] the token of each node (ignored
at roots); row i's target logits are the distribution of the token after node i's path. Siblings are
ordered by node index. `layout.tree_layout` / `tree_attention_mask` / `tree_positions` /
`retrive_links` build what the model needs from the same parents array.

Every rule picks, at the accepted node, at most one child to continue with; the accepted path runs
from the root to the deepest node whose ancestors were all picked (the "final node"), and the final
token is drawn at the final node's row. Coins: uniforms[i, 0] is, for "target_only", the coin shared
by node i's children and, for "exact", node i's own accept coin; uniforms[final, 1] samples the final
token. Everything is vectorised over requests and nodes; only "exact" loops over sibling slots.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from .chain import ratio_accept, residual_weights, typical_threshold
from .layout import TreeLayout, chain_rows, tree_layout
from .probs import SamplingTensors, check_logits, check_probs, sample_from_probs

TREE_RULES = ("auto", "greedy", "target_only", "exact", "typical")


def _flat(t: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """t[rows, cols] for index tensors of one shape (t: [T, V])."""
    return t.reshape(-1)[rows * t.shape[1] + cols]


def _first_among_siblings(flag: Tensor, lay: TreeLayout) -> Tensor:
    """flag [R, n] -> flag and no earlier sibling flagged: the child a sibling walk stops at."""
    return flag & ~(lay.earlier_sibling & flag.unsqueeze(1)).any(-1)


def _deepest_on_path(picked: Tensor, lay: TreeLayout) -> Tensor:
    """Final node [R]: the deepest node whose every non-root ancestor-or-self is picked."""
    ok = picked.clone()
    ok[:, 0] = True
    on_path = lay.valid & ~(lay.ancestors & ~ok.unsqueeze(1)).any(-1)
    return torch.where(on_path, lay.depth, -1).argmax(-1)


def greedy_tree_pick(argmax: Tensor, tokens: Tensor, lay: TreeLayout) -> Tensor:
    """Greedy tree (SGLang verify_tree_greedy): at the accepted node take the target argmax and look
    for it among the children (first in index order); stop when absent and emit the argmax. Exact: the
    path is the target's own greedy continuation. argmax: [T]; tokens: [R, n]. Returns picked [R, n]."""
    return _first_among_siblings(lay.is_child & (tokens == argmax[lay.parent_row]), lay)


def target_only_pick(probs: Tensor, tokens: Tensor, uniforms: Tensor, lay: TreeLayout,
                     threshold_single: float, threshold_acc: float) -> Tensor:
    """SGLang's tree_speculative_sampling_target_only (sgl-kernel speculative_sampling.cuh, current
    form). At the accepted node, with its coin c = uniforms[node, 0], walk the children in order
    accumulating prob_acc += p(child); accept the first child with

        p(child) > 0  and  (c < prob_acc / max(threshold_acc, 1e-9)  or  p(child) >= threshold_single).

    If none is accepted (or the node is a leaf) the final token is drawn from relu(p - d), where SGLang's
    "draft_probs" buffer d is zero except that every rejected child's token holds its target
    probability: i.e. p with the rejected children's tokens removed (see `_target_only_final`), with
    u = coin * total mass. No draft probabilities are used.

    Exactness: NOT exact in general. With threshold_single = threshold_acc = 1 and distinct sibling
    tokens it is exact: child i is accepted iff c lands in [F_{i-1}, F_i) (F = cumulative target mass of
    the children), probability p(child i), and otherwise the residual is p conditioned on not being a
    child, i.e. plain inverse-CDF sampling of p with the children listed first. threshold_acc < 1 or
    threshold_single < 1 inflate the children's mass (lossy, faster); duplicate sibling tokens count
    a token's mass twice. SGLang's older "c <= prob_acc" could accept a zero-probability child at c = 0;
    the current strict form (used here) cannot. probs: [T, V]; tokens: [R, n]; uniforms: [T, 2]."""
    p_child = _flat(probs, lay.parent_row, tokens.clamp(min=0)).double()  # [R, n]
    p_child = torch.where(lay.is_child, p_child, 0.0)
    prob_acc = p_child + (lay.earlier_sibling.double() @ p_child.unsqueeze(2)).squeeze(2)
    coin = uniforms[:, 0].double()[lay.parent_row]
    hit = (coin < prob_acc / max(threshold_acc, 1e-9)) | (p_child >= threshold_single)
    return _first_among_siblings(lay.is_child & (p_child > 0) & hit, lay)


def _target_only_final(probs_final: Tensor, final: Tensor, tokens: Tensor, lay: TreeLayout) -> Tensor:
    """p at the final node with its (all rejected) children's tokens zeroed; p itself if that is empty."""
    rejected = (lay.parent == final.unsqueeze(1)) & lay.is_child  # [R, n]
    hits = torch.zeros_like(probs_final).scatter_add_(1, tokens.clamp(min=0), rejected.to(probs_final.dtype))
    res = probs_final.masked_fill(hits > 0, 0.0)
    return torch.where(res.sum(-1, keepdim=True) > 0, res, probs_final)


def normalised_residual(p: Tensor, q: Tensor) -> Tensor:
    """p_i = norm(max(p_{i-1} - q_{i-1}, 0)) of the recursion below (p_{i-1} where empty). p, q: [N, V]."""
    res = residual_weights(p, q)
    return res / res.sum(-1, keepdim=True)


def exact_pick(probs: Tensor, draft_probs: Tensor, tokens: Tensor, uniforms: Tensor, lay: TreeLayout,
               without_replacement: bool) -> Tensor:
    """Exact multi-draft tree sampling (recursive rejection sampling: SpecTr / SpecInfer / Yang et al.
    "multi-candidate speculative decoding"; Jeon et al. "recursive speculative decoding" without
    replacement). At a node with target p_0 = p and draft q, for children c_1..c_m in index order:
    accept c_i with min(1, p_{i-1}(c_i) / q_{i-1}(c_i)) (coin uniforms[c_i, 0]); on reject
    p_i = norm(max(p_{i-1} - q_{i-1}, 0)) (p_{i-1} when empty); if all are rejected the final token is
    drawn from p_m. With replacement q_i = q; without replacement q_i = q_{i-1} with c_i removed,
    renormalised.

    Drafting scheme the drafter MUST use (else the rule is not exact): the children of a node are drawn
    from that node's draft distribution q (draft_probs at the node's row, after `logits_to_probs`),
    either i.i.d. (with replacement, duplicates allowed) or sequentially without replacement, matching
    `draft_scheme`; their number may depend on anything but their values. Deterministic top-k children
    (EAGLE) are not such draws: use "target_only" or "greedy" for those.

    Proof of exactness, by induction on the remaining children: step i is the standard accept /
    residual rule with target p_{i-1} and proposal q_{i-1}, and c_i ~ q_{i-1} given the earlier
    children (i.i.d. draws, or sampling without replacement). It emits y through acceptance with
    probability min(p_{i-1}, q_{i-1})(y) and rejects with probability Z_i = sum max(p_{i-1} - q_{i-1}, 0);
    by the induction hypothesis (which holds for any proposal, so also for q_i that depends on c_i) the
    rest emits p_i, and min(p_{i-1}, q_{i-1}) + Z_i p_i = p_{i-1}. With no child left it samples p_m.
    So the token after the node is distributed as p; an accepted child's subtree was drafted from q at
    that child independently of the coins above, so the same holds at the next level, and the emitted
    sequence follows the target token by token. A rejected c_i has p_{i-1}(c_i) < q_{i-1}(c_i), so
    p_i(c_i) = 0: removing it from q (without replacement) leaves p_i's support intact.

    probs: [T, V] processed target (overwritten with the residual p_m of every node); draft_probs:
    [T, V]; tokens: [R, n]; uniforms: [T, 2]. Returns picked [R, n]."""
    picked = torch.zeros_like(lay.valid)
    if not bool(lay.is_child.any()):
        return picked
    num_req, n = lay.valid.shape
    slots = int(lay.sibling_rank[lay.is_child].max()) + 1
    child_at = torch.full((num_req, n * slots + 1), -1, dtype=torch.long, device=tokens.device)
    where = torch.where(lay.is_child, lay.parent * slots + lay.sibling_rank, n * slots)
    child_at.scatter_(1, where, torch.arange(n, device=tokens.device).expand(num_req, n).contiguous())
    child_at = child_at[:, : n * slots].view(num_req, n, slots)  # [R, n(parent), slot] local child
    q = draft_probs.float().contiguous()
    q = q.clone() if without_replacement and q is draft_probs else q
    open_ = torch.ones_like(lay.valid)
    for s in range(slots):
        c = child_at[:, :, s]
        has = (c >= 0) & open_
        c0 = c.clamp(min=0)
        tok = tokens.gather(1, c0).clamp(min=0)
        p_x, q_x = _flat(probs, lay.node_row, tok), _flat(q, lay.node_row, tok)
        accept = has & ratio_accept(p_x, q_x, uniforms[:, 0][lay.node_row.gather(1, c0)])
        picked |= torch.zeros_like(picked).scatter_(1, c0, accept)
        open_ &= ~accept
        reject = has & ~accept
        rows = lay.node_row[reject]
        if rows.numel():
            q_rows = q.index_select(0, rows)
            probs.index_copy_(0, rows, normalised_residual(probs.index_select(0, rows), q_rows))
            if without_replacement:
                q_rows.scatter_(1, tok[reject].unsqueeze(1), 0.0)
                zq = q_rows.sum(-1, keepdim=True)
                q.index_copy_(0, rows, torch.where(zq > 0, q_rows / zq.clamp_min(1e-38), q_rows))
    picked[:, 0] = False
    return picked & lay.is_child


def typical_final_node(probs: Tensor, tokens: Tensor, lay: TreeLayout, epsilon: float, delta: float) -> Tensor:
    """Typical acceptance over a tree (Medusa), LOSSY: a node passes if p_parent(token) >
    min(epsilon, delta exp(-H(p_parent))); keep the longest passing prefix over all root-to-node paths,
    ties broken by the largest path log-likelihood (Medusa), then by the lowest node index. Returns the
    final node [R]; the final token is sampled from p at its row."""
    parent_row = lay.parent_row
    p_child = _flat(probs, parent_row, tokens.clamp(min=0))  # [R, n]
    ok = lay.is_child & (p_child > typical_threshold(probs, epsilon, delta)[parent_row])
    ok[:, 0] = True
    path_ok = lay.valid & ~(lay.ancestors & ~ok.unsqueeze(1)).any(-1)
    step_ll = torch.where(ok & lay.is_child, p_child.double().log(), 0.0)  # finite where used
    loglik = (lay.ancestors.double() @ step_ll.unsqueeze(2)).squeeze(2)
    best = torch.where(path_ok, lay.depth, -1).amax(-1, keepdim=True)
    score = torch.where(path_ok & (lay.depth == best), loglik, float("-inf"))
    return score.argmax(-1)


@dataclass(frozen=True)
class TreeVerifyResult:
    """Per-request outcome of `verify_tree` (R requests, n = largest tree)."""

    num_accepted: Tensor  # [R] long: accepted draft nodes (= depth of the final node)
    accepted_nodes: Tensor  # [R, n] long: local nodes of the accepted path, root first, -1 padded
    accepted_rows: Tensor  # [R, n] long: the same as global rows (KV slots to keep), -1 padded
    output_token_ids: Tensor  # [R, n] long: accepted tokens then the final token, -1 padded
    num_emitted: Tensor  # [R] long: num_accepted + 1
    sampled_token_ids: Tensor  # [R] long: the final token
    final_node: Tensor  # [R] long: local index of the last accepted node
    accepted_mask: Tensor  # [T] bool: node on the accepted path (roots excluded)
    draft_tok: Tensor  # [R] long: draft nodes + 1 (= seqlens_q)
    accept_tok: Tensor  # [R] long: accepted + 1


def verify_tree(
    target_logits: Tensor,  # [T, V]: row i = distribution of the token after node i
    node_token_ids: Tensor,  # [T] long: token of each node (ignored at roots)
    parents: Tensor,  # [T] long: local parent index, -1 at roots, parent[i] < i
    first_token_positions: Tensor,  # [R] long/int
    seqlens_q: Tensor,  # [R] long/int: nodes per tree, root included
    sampling: SamplingTensors,  # per request
    uniforms: Tensor,  # [T, 2] in [0, 1): column 0 accept coins, column 1 final-sample coin
    draft_probs: Tensor | None = None,  # [T, V]: row i = draft distribution node i's children were drawn from
    rule: str = "auto",  # the same default as verify_chain
    *,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    draft_scheme: str = "with_replacement",  # or "without_replacement" (rule "exact")
    typical_epsilon: float = 0.09,
    typical_delta: float = 0.3,
    max_nodes: int | None = None,
    check: bool = True,
    any_sampled: bool | None = None,
) -> TreeVerifyResult:
    """Verify a flattened batch of draft trees. rule: "greedy" (exact argmax walk), "target_only"
    (SGLang; exact only for thresholds 1 and distinct siblings), "exact" (recursive rejection sampling;
    needs draft_probs and the drafting scheme of `exact_pick`), "typical" (lossy), "auto" (greedy for
    temperature-0 requests, exact otherwise). Temperature-0 requests are greedy under every rule.
    Host synchronisations: none with check=False, max_nodes given and (rule "auto") any_sampled given (whether
    any request has temperature > 0, as the caller knows from its parameters), for rules greedy / auto on
    greedy batches; the sampled rules read a few sizes back."""
    if rule not in TREE_RULES:
        raise ValueError(f"rule must be one of {TREE_RULES}, got {rule!r}")
    if draft_scheme not in ("with_replacement", "without_replacement"):
        raise ValueError(f"draft_scheme must be 'with_replacement' or 'without_replacement', got {draft_scheme!r}")
    num_rows, device = target_logits.shape[0], target_logits.device
    ftp, seqlens = first_token_positions.long(), seqlens_q.long()
    lay = tree_layout(parents, ftp, seqlens, max_nodes, check=check)
    row_to_req = chain_rows(ftp, seqlens, num_rows)[0]
    if check:
        check_logits(target_logits, row_to_req=row_to_req, name="target_logits")
    tokens = torch.where(lay.is_child, node_token_ids.long()[lay.node_row], -1)  # [R, n]
    greedy_req = sampling.temperature <= 0 if rule == "auto" else torch.full((len(ftp),), rule == "greedy", device=device)
    if rule in ("greedy", "auto"):
        argmax = target_logits.argmax(-1)  # [T]
        final = _deepest_on_path(greedy_tree_pick(argmax, tokens, lay), lay)
        final_token = argmax[lay.node_row.gather(1, final.unsqueeze(1)).squeeze(1)]
    if any_sampled is None and rule == "auto":
        any_sampled = bool((~greedy_req).any())
    if rule != "greedy" and (rule != "auto" or any_sampled):
        probs = sampling.probs(target_logits, row_to_req, check=False)  # [T, V]
        if rule in ("auto", "exact"):
            if draft_probs is None:
                raise ValueError(f"rule {rule!r} with sampled requests needs draft_probs")
            if check:
                check_probs(draft_probs, lay.node_row[lay.has_children & ~greedy_req.unsqueeze(1)], row_to_req=row_to_req)
        sampled_final, sampled_token = _sampled_final(
            rule, probs, draft_probs, tokens, uniforms, lay, threshold_single=threshold_single,
            threshold_acc=threshold_acc, without_replacement=draft_scheme == "without_replacement",
            epsilon=typical_epsilon, delta=typical_delta)
        if rule == "auto":
            final = torch.where(greedy_req, final, sampled_final)
            final_token = torch.where(greedy_req, final_token, sampled_token)
        else:
            final, final_token = sampled_final, sampled_token
    return _tree_result(lay, final, final_token, tokens, seqlens, num_rows)


@dataclass
class GreedyTreeVerdict:
    """`greedy_tree_verdict`'s result: the fields of TreeVerifyResult a round on the device reads, as views of
    `packed` [R, 2 + 2 n] int64 (what the round copies to the host in one piece): accepted, path nodes, output
    tokens, a non-finite flag."""

    packed: Tensor

    @property
    def num_accepted(self) -> Tensor:  # [R] long
        return self.packed[:, 0]

    @property
    def accepted_nodes(self) -> Tensor:  # [R, n] long: local node ids root first, -1 past the path
        return self.packed[:, 1: 1 + (self.packed.shape[1] - 2) // 2]

    @property
    def output_token_ids(self) -> Tensor:  # [R, n] long: accepted drafts, then the final token, -1 after
        n = (self.packed.shape[1] - 2) // 2
        return self.packed[:, 1 + n: 1 + 2 * n]

    @property
    def bad(self) -> Tensor:  # [R] long: nonzero where a target row's maximum is not finite (the kernel flags that
        return self.packed[:, -1]  # request, the torch ops every request of the batch)

    @property
    def finite(self) -> Tensor:  # [] bool: every row's maximum is finite (a row with NaN, +Inf or nothing but -inf is not)
        return (self.bad == 0).all()


def greedy_tree_verdict(target_logits: Tensor, tokens: Tensor, parents: Tensor, ancestors: Tensor,
                        depth: Tensor, kernel: bool | None = None) -> GreedyTreeVerdict:
    """The greedy tree rule (`verify_tree(rule="greedy")`: take the target's argmax at the accepted node, look for it
    among the children, first in index order) for R trees of n nodes each whose layout is already on the device:
    tokens [R, n] (root first), parents [R, n] (-1 at the root, parent before child), ancestors [R, n, n] bool
    (ancestor-or-self), depth [R, n]; target_logits [R * n, V], tree-major. The same verdict as verify_tree in
    ~20 device ops instead of ~100 (no layout to build: a drafter's device tree carries its mask and depths) and no
    host synchronisation. kernel (None: on CUDA unless FORERUN_TREE_VERDICT_KERNEL=0): the same in two Triton
    launches (forerun/kernels/tree_verdict.py; the flag then per request)."""
    if kernel is None:  # (trees past 128 nodes: the kernel's [n, n] tiles take minutes to compile)
        kernel = (target_logits.is_cuda and tokens.shape[1] <= 128
                  and os.environ.get("FORERUN_TREE_VERDICT_KERNEL", "") != "0")
    if kernel:
        from ..kernels.tree_verdict import greedy_tree_verdict_packed
        return GreedyTreeVerdict(greedy_tree_verdict_packed(target_logits, tokens, parents, ancestors, depth))
    r, n = tokens.shape
    am = target_logits.argmax(-1).view(r, n)  # [R, n]: the target's next token after each node
    child = parents >= 0
    match = child & (tokens == am.gather(1, parents.clamp(min=0)))  # [R, n]
    j = torch.arange(n, device=tokens.device)
    earlier = (parents[:, :, None] == parents[:, None, :]) & (j[None, None, :] < j[None, :, None])  # [R, i, j<i]
    picked = match & ~(earlier & match[:, None, :]).any(-1)  # the first matching sibling
    accepted, nodes = deepest_picked_path(picked | ~child, ancestors, depth)  # (~child: the root)
    out = torch.where(nodes >= 0, am.gather(1, nodes.clamp(min=0)), -1)  # argmax after each path node
    # (argmax lands on a NaN, on +Inf, or on -inf when nothing else is left: one gather checks every row)
    bad = ~torch.isfinite(target_logits.gather(1, am.view(-1, 1))).all()
    return GreedyTreeVerdict(pack_verdict(accepted, nodes, out, bad))


def pack_verdict(accepted: Tensor, nodes: Tensor, out: Tensor, bad: Tensor) -> Tensor:
    """A tree verdict as the one int64 piece a round copies to the host: [R, 2 + 2 n] = accepted [R], path nodes
    [R, n], output tokens [R, n], the non-finite flag (bad: [] for the batch, or [R])."""
    return torch.cat([accepted[:, None], nodes, out, bad.long().reshape(-1, 1).expand(accepted.shape[0], 1)], 1)


def deepest_picked_path(ok: Tensor, ancestors: Tensor, depth: Tensor) -> tuple[Tensor, Tensor]:
    """ok [R, n]: nodes picked (at most one child per node, the root always): the path to the deepest node whose
    every ancestor-or-self is picked. Returns (its depth = drafts accepted [R], its nodes by depth [R, n], -1 past
    it). ancestors [R, n, n] bool (ancestor-or-self), depth [R, n]."""
    r, n = ok.shape
    on_path = ~(ancestors & ~ok[:, None, :]).any(-1)  # every ancestor-or-self picked
    final = torch.where(on_path, depth, -1).argmax(-1)  # [R] the deepest (one per depth: picks are unique)
    path = ancestors.gather(1, final.view(r, 1, 1).expand(r, 1, n)).squeeze(1)  # [R, n] nodes on its path
    j = torch.arange(n, device=ok.device)
    nodes = torch.full((r, n + 1), -1, dtype=torch.long, device=ok.device).scatter_(
        1, torch.where(path, depth, n), j.expand(r, n))[:, :n]  # by depth
    return depth.gather(1, final[:, None]).squeeze(1), nodes


def _sampled_final(rule: str, probs: Tensor, draft_probs: Tensor | None, tokens: Tensor, uniforms: Tensor,
                   lay: TreeLayout, *, threshold_single: float, threshold_acc: float, without_replacement: bool,
                   epsilon: float, delta: float) -> tuple[Tensor, Tensor]:
    """Final node [R] and final token [R] of the sampling rules ("auto" = "exact")."""
    if rule == "typical":
        final = typical_final_node(probs, tokens, lay, epsilon, delta)
    elif rule == "target_only":
        final = _deepest_on_path(target_only_pick(probs, tokens, uniforms, lay, threshold_single, threshold_acc), lay)
    else:
        final = _deepest_on_path(exact_pick(probs, draft_probs, tokens, uniforms, lay, without_replacement), lay)
    row = lay.node_row.gather(1, final.unsqueeze(1)).squeeze(1)
    weights = probs[row]  # exact: the residual p_m left in probs by exact_pick
    if rule == "target_only":
        weights = _target_only_final(weights, final, tokens, lay)
    return final, sample_from_probs(weights, uniforms[row, 1])


def _tree_result(lay: TreeLayout, final: Tensor, final_token: Tensor, tokens: Tensor, seqlens: Tensor,
                 num_rows: int) -> TreeVerifyResult:
    """Accepted path = ancestors-or-self of the final node, laid out by depth."""
    num_req, n = lay.valid.shape
    on_path = lay.ancestors[torch.arange(num_req, device=final.device), final]  # [R, n]
    slot = torch.where(on_path, lay.depth, n)  # depth is unique along a path
    j = torch.arange(n, device=final.device).expand(num_req, n)
    nodes = torch.full((num_req, n + 1), -1, dtype=torch.long, device=final.device).scatter_(1, slot, j)[:, :n]
    rows = torch.where(nodes >= 0, lay.node_row.gather(1, nodes.clamp(min=0)), -1)
    depth = lay.depth.gather(1, final.unsqueeze(1)).squeeze(1)  # [R]
    out = torch.where(nodes[:, 1:] >= 0, tokens.gather(1, nodes[:, 1:].clamp(min=0)), -1)
    out = torch.cat([out, torch.full_like(out[:, :1], -1)], 1).scatter_(1, depth.unsqueeze(1), final_token.unsqueeze(1))
    flag = on_path & lay.is_child  # (a scatter, not a boolean index: no host sync)
    idx = torch.where(flag, lay.node_row, num_rows).reshape(-1)
    accepted_mask = torch.zeros(num_rows + 1, dtype=torch.bool, device=final.device).scatter_(
        0, idx, flag.reshape(-1))[:num_rows]
    return TreeVerifyResult(depth, nodes, rows, out, depth + 1, final_token, final, accepted_mask, seqlens, depth + 1)
