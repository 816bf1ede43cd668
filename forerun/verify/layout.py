"""Batched layouts: seed 000's flattened chain rows, and padded per-request views of draft trees.

Chain: the rows of all requests flattened into one [T, V] batch.

Request r owns rows ftp[r] .. ftp[r] + seqlens_q[r] - 1 (ftp = first_token_positions). Row ftp[r] + j
verifies draft d_{j+1} (it holds the target's distribution after d_1..d_j); the last row of a request
has no draft to verify and gives the bonus token. Requests may have different draft counts (k = 0 too).

Worked example (seed 000, nextn = 5): request A has 6 rows and accepts d1, d2; request B has 4 rows
and accepts all 3 drafts.

    row          =  0  1  2  3  4  5 |  6  7  8  9
    row_to_req   =  0  0  0  0  0  0 |  1  1  1  1
    local_step   =  0  1  2  3  4  5 |  0  1  2  3
    is_verify    =  T  T  T  T  T  F |  T  T  T  F
    raw accept   =  T  T  F  T  F  T |  T  T  T  T     per-row decision (fresh rows: T)
    blocked      =  F  F  T  F  T  T |  F  F  F  T     = not (raw accept and is_verify)
    alive        =  T  T  T  F  F  F |  T  T  T  T     = no blocked row before it in its request
    eff. accept  =  T  T  F  F  F  F |  T  T  T  F     = alive and not blocked
    is_final     =  F  F  T  F  F  F |  F  F  F  T     = alive and blocked (exactly one per request)
    last_valid_offset = [2, 3]; num_generated_tokens = [2, 2, 1, 0, 0]; num_verified_tokens = [2, 2, 2, 1, 1]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


def chain_rows(ftp: Tensor, seqlens_q: Tensor, total_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """row_to_req, local_step and is_verify of every row (seed: prepare_verification_metadata).

    ftp: [R] first row of each request; seqlens_q: [R] rows per request (= k_r + 1 >= 1);
    total_rows: T = sum(seqlens_q). Requests' row blocks may come in any order but must tile 0..T-1.
    Returns (row_to_req [T] long, local_step [T] long, is_verify [T] bool). No host sync.
    """
    ftp, seqlens_q = ftp.long(), seqlens_q.long()
    num_req = ftp.shape[0]
    req = torch.repeat_interleave(torch.arange(num_req, device=ftp.device), seqlens_q, output_size=total_rows)
    start_in_req_order = torch.cumsum(seqlens_q, 0) - seqlens_q  # [R]
    step = torch.arange(total_rows, device=ftp.device) - start_in_req_order[req]  # [T] in request order
    rows = ftp[req] + step
    row_to_req = torch.empty_like(req).scatter_(0, rows, req)
    local_step = torch.empty_like(step).scatter_(0, rows, step)
    is_verify = local_step < (seqlens_q[row_to_req] - 1)
    return row_to_req, local_step, is_verify


@dataclass(frozen=True)
class AcceptPrefix:
    """How a per-row raw accept turns into each request's accepted prefix (all [T] bool but the last two)."""

    blocked: Tensor  # [T] bool: the row stops its request (reject, or a row with nothing to verify)
    alive: Tensor  # [T] bool: no blocked row before it in its request
    accepted: Tensor  # [T] bool: effective accept = alive and not blocked
    is_final: Tensor  # [T] bool: the row whose distribution gives the request's final token
    num_accepted: Tensor  # [R] long: accepted drafts (= seed's last_valid_offset)
    final_row: Tensor  # [R] long: ftp + num_accepted


def build_row_to_req(first_token_positions: Tensor, seqlens_q: Tensor, num_rows: int | None = None) -> Tensor:
    """row_to_req [T] long: the request index of every row of a flattened batch (chain or tree).

    Requests own contiguous rows: request r owns rows ftp[r] .. ftp[r] + seqlens_q[r] - 1, so for
    ftp = [0, 4], seqlens_q = [4, 1] this is [0, 0, 0, 0, 1]. It is what `SamplingTensors.probs(logits,
    row_to_req)` needs to apply each request's settings to its rows, e.g. to build `draft_probs` with the
    same transform as the target. num_rows defaults to ftp[-1] + seqlens_q[-1] (one host sync; pass it
    to avoid that). Rows past the last request, if any, are given to the last request."""
    ftp, seqlens = first_token_positions.long(), seqlens_q.long()
    if ftp.dim() != 1 or ftp.shape != seqlens.shape:
        raise ValueError(f"first_token_positions {tuple(ftp.shape)} and seqlens_q {tuple(seqlens.shape)} must be "
                         "1-D tensors of the same length (one entry per request)")
    if num_rows is None:
        num_rows = int(seqlens.sum())
    return chain_rows(ftp, seqlens, num_rows)[0]


def accept_prefix(raw_accept: Tensor, is_verify: Tensor, row_to_req: Tensor, ftp: Tensor) -> AcceptPrefix:
    """Effective accepts from raw per-row decisions (seed 000's table). raw_accept, is_verify,
    row_to_req: [T]; ftp: [R]. Each request's rows are contiguous, so an exclusive cumulative count of
    blocked rows minus its value at the request's first row counts the blocked rows before each row."""
    ftp = ftp.long()
    blocked = ~(raw_accept & is_verify)
    b = blocked.long()
    before = torch.cumsum(b, 0) - b  # exclusive, over the whole batch
    alive = (before - before[ftp][row_to_req]) == 0
    accepted = alive & ~blocked
    is_final = alive & blocked
    num_accepted = torch.zeros_like(ftp).index_add_(0, row_to_req, accepted.long())
    return AcceptPrefix(blocked, alive, accepted, is_final, num_accepted, ftp + num_accepted)


def step_counters(local_step: Tensor, accepted: Tensor, is_verify: Tensor, nextn: int) -> tuple[Tensor, Tensor]:
    """num_generated_tokens / num_verified_tokens [nextn]: accepted drafts and verify rows per step,
    scatter-added by local_step; steps past nextn - 1 go into the last slot. All inputs [T]."""
    slot = local_step.clamp(max=max(nextn, 1) - 1)
    zeros = torch.zeros(max(nextn, 1), dtype=torch.long, device=local_step.device)
    return zeros.index_add(0, slot, accepted.long()), zeros.index_add(0, slot, is_verify.long())


def rows_to_requests(values: Tensor, row_to_req: Tensor, local_step: Tensor, num_req: int, width: int,
                     fill: float | int) -> Tensor:
    """Place per-row values [T, *] into a per-request table [R, width, *] at (row_to_req, local_step);
    width must be >= the largest seqlens_q. Unwritten slots hold `fill`."""
    out = torch.full((num_req * width, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
    out.index_copy_(0, row_to_req * width + local_step, values)
    return out.view(num_req, width, *values.shape[1:])


# ---- structured output, golden override, force top-k -------------------------------------------------

def unpack_bitmask(bitmask: Tensor, vocab: int) -> Tensor:
    """xgrammar-style packed bitmask [n, ceil(V / 32)] int32 -> allowed bool [n, V]
    (token t is allowed iff bit t % 32 of word t // 32 is 1)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [n, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_token_bitmasks(logits: Tensor, token_bitmasks: Sequence[tuple[Tensor, Tensor] | None], ftp: Tensor,
                         seqlens_q: Tensor) -> Tensor:
    """Mask disallowed tokens to -inf, step by step (seed: apply_token_bitmask_by_step_inplace).

    logits: [T, V]. token_bitmasks[k] = (req_indices [n_k] long, bitmask [n_k, ceil(V/32)] int32) or
    None: it applies to row ftp[i] + k of each listed request i (skipped where k >= seqlens_q[i]).
    Returns a new tensor (the caller's logits are left as they are).
    """
    out = logits.clone()
    for step, entry in enumerate(token_bitmasks):
        if entry is None or entry[0].numel() == 0:
            continue
        req, mask = entry[0].long(), entry[1]
        keep = (step < seqlens_q.long()[req]).nonzero().squeeze(1)
        rows = ftp.long()[req[keep]] + step
        allowed = unpack_bitmask(mask[keep], logits.shape[1])
        out.index_copy_(0, rows, out.index_select(0, rows).masked_fill(~allowed, float("-inf")))
    return out


def vocab_to_columns(token_ids: Tensor, topk_index: Tensor) -> Tensor:
    """Force top-k: column of each row's token in its top-k table, -1 when the token is not in it.
    token_ids: [T] long (-1 = none); topk_index: [T, K] long vocabulary id of each column."""
    hit = topk_index == token_ids.unsqueeze(1)  # [T, K]
    col = hit.to(torch.uint8).argmax(-1)
    return torch.where(hit.any(-1) & (token_ids >= 0), col, torch.full_like(col, -1))


def columns_to_vocab(columns: Tensor, topk_index: Tensor) -> Tensor:
    """Force top-k: vocabulary ids of column indices (seed: map_lookup by_index). columns: [T] or
    [T, n] long (-1 stays -1); topk_index: [T, K] long."""
    flat = columns.unsqueeze(1) if columns.dim() == 1 else columns
    ids = topk_index.gather(1, flat.clamp(min=0))
    ids = torch.where(flat >= 0, ids, torch.full_like(ids, -1))
    return ids.squeeze(1) if columns.dim() == 1 else ids


# ---- tree layout ---------------------------------------------------------------------------------------
# A request's draft tree has n nodes in rows ftp[r] .. ftp[r] + n - 1 (n = seqlens_q[r]); node 0 is the
# root (the last committed token, its row gives the distribution of the first new token) and parents
# precede their children (parent[i] < i). `parents` holds local parent indices, -1 for the root.
# Siblings are ordered by node index.


@dataclass(frozen=True)
class TreeLayout:
    """Padded per-request view of a flattened batch of trees (R requests, n = largest tree)."""

    node_row: Tensor  # [R, n] long: global row of local node j (0 on padding)
    valid: Tensor  # [R, n] bool: j < seqlens_q[r]
    parent: Tensor  # [R, n] long: local parent, -1 for roots and padding
    ancestors: Tensor  # [R, n, n] bool: [r, i, j] = node j is an ancestor of node i, or i itself
    depth: Tensor  # [R, n] long: 0 for the root
    earlier_sibling: Tensor  # [R, n, n] bool: [r, i, j] = j < i share a parent
    sibling_rank: Tensor  # [R, n] long: number of earlier siblings
    is_child: Tensor  # [R, n] bool: a valid non-root node
    has_children: Tensor  # [R, n] bool

    @property
    def parent_row(self) -> Tensor:  # [R, n] long: global row of the parent (own row for roots)
        return self.node_row.gather(1, self.parent.clamp(min=0))


def tree_layout(parents: Tensor, ftp: Tensor, seqlens_q: Tensor, max_nodes: int | None = None,
                check: bool = True) -> TreeLayout:
    """Build the padded layout. parents: [T] long local parent of each node (-1 at each root);
    ftp, seqlens_q: [R]. max_nodes: largest seqlens_q (computed when None: one host sync)."""
    ftp, seqlens_q = ftp.long(), seqlens_q.long()
    n = int(seqlens_q.max()) if max_nodes is None else max_nodes
    j = torch.arange(n, device=ftp.device)
    valid = j.unsqueeze(0) < seqlens_q.unsqueeze(1)  # [R, n]
    node_row = torch.where(valid, ftp.unsqueeze(1) + j, torch.zeros_like(valid, dtype=torch.long))
    parent = torch.where(valid, parents.long()[node_row], -1)
    if check:
        ok = torch.where(j == 0, parent == -1, (parent >= 0) & (parent < j)) | ~valid
        if not bool(ok.all()):
            r, i = (~ok).nonzero()[0].tolist()
            raise ValueError(f"tree of request {r}: node {i} has parent {int(parent[r, i])}; node 0 must be "
                             f"the root (-1) and every other node's parent must come before it")
    eye = torch.eye(n, dtype=torch.float32, device=ftp.device).expand(len(ftp), n, n)
    step = eye + torch.zeros_like(eye).scatter_(2, parent.clamp(min=0).unsqueeze(2), (parent >= 0).float().unsqueeze(2))
    anc = step
    for _ in range(max(n - 1, 1).bit_length()):  # paths of length <= 2^m after m squarings
        anc = (anc @ anc).clamp(max=1.0)
    ancestors = anc > 0
    same = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (parent >= 0).unsqueeze(2)
    earlier = same & (j.unsqueeze(0) < j.unsqueeze(1)).unsqueeze(0)  # [r, i, j]: j < i
    is_child = valid & (parent >= 0)
    has_children = torch.zeros_like(parent).scatter_add_(1, parent.clamp(min=0), is_child.long()) > 0
    return TreeLayout(node_row, valid, parent, ancestors, ancestors.sum(-1) - 1, earlier, earlier.sum(-1), is_child,
                      has_children)


def _per_row(layout: TreeLayout, values: Tensor, num_rows: int) -> Tensor:
    """Scatter per-node values [R, n, *] back to rows [T, *] (padding dropped)."""
    flat_valid = layout.valid.reshape(-1).nonzero().squeeze(1)
    out = values.reshape(-1, *values.shape[2:]).index_select(0, flat_valid)
    return torch.empty((num_rows, *values.shape[2:]), dtype=values.dtype, device=values.device).index_copy_(
        0, layout.node_row.reshape(-1).index_select(0, flat_valid), out)


def tree_attention_mask(parents: Tensor, ftp: Tensor, seqlens_q: Tensor, max_nodes: int | None = None) -> Tensor:
    """bool [T, n]: row t (node i of request r) may attend to local node j of its own request iff j is
    an ancestor of i or i itself. Columns past the request's tree are False."""
    lay = tree_layout(parents, ftp, seqlens_q, max_nodes)
    return _per_row(lay, lay.ancestors & lay.valid.unsqueeze(1), parents.shape[0])


def tree_positions(parents: Tensor, ftp: Tensor, seqlens_q: Tensor, max_nodes: int | None = None) -> Tensor:
    """long [T]: depth of each node (root 0); add the root's absolute position for rotary positions."""
    lay = tree_layout(parents, ftp, seqlens_q, max_nodes)
    return _per_row(lay, lay.depth, parents.shape[0])


def retrive_links(parents: Tensor, ftp: Tensor, seqlens_q: Tensor, max_nodes: int | None = None
                  ) -> tuple[Tensor, Tensor]:
    """SGLang's retrive_next_token (first child) and retrive_next_sibling (next sibling in index
    order) of each node, as local indices, -1 = none. Returns two long [T]."""
    lay = tree_layout(parents, ftp, seqlens_q, max_nodes)
    n = lay.valid.shape[1]
    big = torch.full_like(lay.parent, n)
    j = torch.arange(n, device=parents.device).expand_as(lay.parent)
    child = lay.is_child
    # first child of p = smallest child index with parent p
    first = torch.full((len(ftp), n + 1), n, dtype=torch.long, device=parents.device)
    first.scatter_reduce_(1, torch.where(child, lay.parent, n), torch.where(child, j, big), reduce="amin")
    first = first[:, :n]
    # next sibling of i = smallest j > i with the same parent, i.e. j whose earlier siblings include i
    later = lay.earlier_sibling.transpose(1, 2)  # [r, i, j]: i < j siblings
    nxt = torch.where(later, j.unsqueeze(1), n).amin(-1)
    none = lambda t: torch.where(t >= n, -1, t)  # noqa: E731
    return _per_row(lay, none(first), parents.shape[0]), _per_row(lay, none(nxt), parents.shape[0])


def parents_from_retrive(next_token: Tensor, next_sibling: Tensor, ftp: Tensor, seqlens_q: Tensor) -> Tensor:
    """Inverse of `retrive_links`: local parent of every node from SGLang's links (local indices).
    next_token, next_sibling: [T] long. Returns [T] long (-1 at roots). The sibling order is dropped:
    the verifiers order siblings by node index."""
    num_rows = next_token.shape[0]
    row_to_req, local, _ = chain_rows(ftp, seqlens_q, num_rows)
    base = ftp.long()[row_to_req]  # [T]
    parent = torch.full((num_rows,), -1, dtype=torch.long, device=ftp.device)
    prev = torch.full_like(parent, -1)  # global row of the previous sibling
    has_child, has_sib = next_token >= 0, next_sibling >= 0
    parent.index_put_((base[has_child] + next_token[has_child],), local[has_child])
    prev.index_put_((base[has_sib] + next_sibling[has_sib],), torch.arange(num_rows, device=ftp.device)[has_sib])
    for _ in range(int(seqlens_q.max())):  # walk sibling chains back to a first child
        parent = torch.where((parent < 0) & (prev >= 0), parent[prev.clamp(min=0)], parent)
    return parent
