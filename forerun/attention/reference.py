"""Reference attention. Two implementations of the same semantics:

* `paged_attention_padded`: plain SDPA over pages gathered into a padded batch. The readable oracle, and what
  `paged_attention_reference` runs off the CPU.
* `paged_attention_rowwise`: the CPU path. **Batch-invariant**: each query row is computed by itself from
  exactly the keys it sees (its own q row, its visible keys gathered in position order, always in the same
  memory layout), so its result depends on nothing but that row: not on how many rows share the forward, not
  on the other sequences, not on whether it is a decode row, a verify row or a prefill row. That is what makes
  greedy speculative output equal plain output bit for bit on the CPU (the quantized path's activation
  rounding turns last-bit differences into token flips). Padded SDPA is not: a row's softmax and products
  depend on the padded shape (the number of query rows, the longest sequence).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .metadata import AttnMetadata


def paged_attention_reference(
    q: torch.Tensor,  # [T, Hq, D], rotated queries of the new tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], this layer's keys (new keys already written)
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttnMetadata,
    scale: float,
    window: int | None = None,  # sliding window: a query sees keys at positions > its own - window (None: all)
) -> torch.Tensor:  # [T, Hq, D]
    if q.device.type == "cpu":
        return paged_attention_rowwise(q, k_cache, v_cache, meta, scale, window)
    return paged_attention_padded(q, k_cache, v_cache, meta, scale, window)


def paged_attention_padded(q, k_cache, v_cache, meta: AttnMetadata, scale: float, window: int | None = None):
    """Same arguments and result as `paged_attention_reference`, by padded SDPA (not batch-invariant)."""
    num_seqs, block_size = meta.num_seqs, k_cache.shape[1]
    max_kv = meta.max_seq_len
    n_blocks = (max_kv + block_size - 1) // block_size
    tables = meta.block_tables[:, :n_blocks]  # [B, nb]
    k = k_cache[tables].flatten(1, 2)[:, :max_kv]  # [B, S, Hkv, D]
    v = v_cache[tables].flatten(1, 2)[:, :max_kv]

    # Scatter the ragged queries into a padded [B, Q, Hq, D] batch.
    row_seq = meta.row_to_seq()  # [T]
    q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]  # [B]
    local = torch.arange(meta.num_tokens, device=q.device) - meta.query_start_loc[row_seq]  # [T]
    qp = q.new_zeros(num_seqs, meta.max_query_len, *q.shape[1:])
    qp[row_seq, local] = q

    # Visibility mask [B, Q, S]: the cached prefix, then causal (or tree) among the new tokens.
    key_idx = torch.arange(max_kv, device=q.device)  # [S]
    prefix = (meta.seq_lens - q_lens)[:, None, None]  # [B, 1, 1]
    qi = torch.arange(meta.max_query_len, device=q.device)[None, :, None]  # [1, Q, 1]
    kj = key_idx[None, None, :]  # [1, 1, S]
    if meta.tree_mask is None:
        mask = kj <= prefix + qi
        if window is not None:  # cache index == position without a tree
            mask = mask & (kj > prefix + qi - window)
    else:
        tree = torch.zeros(num_seqs, meta.max_query_len, meta.max_query_len, dtype=torch.bool, device=q.device)
        tree[row_seq, local] = meta.tree_mask[:, : meta.max_query_len]
        new_col = (kj - prefix).clamp(0, meta.max_query_len - 1).expand(num_seqs, meta.max_query_len, max_kv)
        mask = (kj < prefix) | torch.gather(tree, 2, new_col)
        if window is not None:
            # positions: a new token's is prefix + (new tokens it sees) - 1 (causal catch-up rows, then tree nodes
            # that see the catch-up and their ancestors: prefix + c + depth); cached keys sit at their index
            qpos = prefix + tree.sum(-1, keepdim=True) - 1  # [B, Q, 1]
            kpos = torch.where(kj < prefix, kj, torch.gather(qpos.transpose(1, 2), 2, new_col[:, :1]))  # [B, 1, S]
            mask = mask & (kpos > qpos - window)
    mask = mask & (kj < meta.seq_lens[:, None, None])
    mask = mask | (qi >= q_lens[:, None, None])  # padded query rows: see everything (discarded) to avoid NaN

    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=True,
    )  # [B, Hq, Q, D]
    return out.transpose(1, 2)[row_seq, local]


# ---------------------------------------------------------------------------------------------- batch-invariant

_plan_cache: list = [None, None, None]  # (key, plan, flat plan): every layer of one forward shares one plan


def _row_plan(meta: AttnMetadata, block_size: int, window: int | None) -> list:
    """Per sequence: (cache slots of its keys in position order [L], [(row, keys)]), where a row's keys are a
    (start, stop) range of those slots (causal rows) or an index tensor into them (tree rows). Cached by content,
    not by identity: a graph runner reuses one AttnMetadata over static buffers updated in place."""
    qsl = meta.query_start_loc.tolist()
    lens = meta.seq_lens.tolist()
    nb = -(-max(lens) // block_size) if lens else 0
    tables = meta.block_tables[:, :nb]
    key = (block_size, window, tuple(qsl), tuple(lens), tables.cpu().numpy().tobytes(),
           None if meta.tree_mask is None else meta.tree_mask.cpu().numpy().tobytes())
    if _plan_cache[0] == key and _plan_cache[1] is not None:
        return _plan_cache[1]
    tree = None if meta.tree_mask is None else meta.tree_mask.cpu()
    plan = []
    for b, length in enumerate(lens):
        r0, r1 = qsl[b], qsl[b + 1]
        n = r1 - r0
        prefix = length - n
        pos = torch.arange(length)
        slots = tables[b, pos // block_size] * block_size + pos % block_size  # [L]
        rows = []
        if tree is None:
            for i in range(n):
                stop = prefix + i + 1
                rows.append((r0 + i, (0 if window is None else max(0, stop - window), stop)))
        else:
            vis = tree[r0:r1, :n]  # [n, n] ancestors and self
            qpos = prefix + vis.sum(-1) - 1  # [n] positions of the new tokens
            for i in range(n):
                new = vis[i].nonzero().flatten()
                idx = torch.cat([torch.arange(prefix), prefix + new])
                if window is not None:
                    kpos = torch.cat([torch.arange(prefix), qpos[new]])
                    idx = idx[kpos > qpos[i] - window]
                if idx.numel() == idx[-1].item() + 1 - idx[0].item():  # a contiguous range: the causal layout
                    rows.append((r0 + i, (idx[0].item(), idx[-1].item() + 1)))
                else:
                    rows.append((r0 + i, idx))
        plan.append((slots, rows))
    _plan_cache[:] = [key, plan, None]
    return plan


def flat_row_plan(meta: AttnMetadata, block_size: int, window: int | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The C kernel's plan of a step (`_flat_plan`'s (key slots, off [T], len [T], the longest row)) straight from
    the metadata: without a window, in a few numpy operations over the whole step instead of `_row_plan`'s Python
    loop over rows (~0.2 ms a call for a 9-row tree step; an EAGLE tree round makes ~4 such calls besides the
    verify). The same keys in the same order for every row (tests/test_cpu_layer.py compares the two), so the same
    bits; rows whose keys are a prefix of their sequence's share its slot list (the kernel's items of rows), other
    tree rows get their own. Cached by content with `_row_plan`'s key."""
    if window is not None:
        return _flat_plan(_row_plan(meta, block_size, window), meta.num_tokens)
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    nb = -(-max(lens) // block_size) if lens else 0
    tables = meta.block_tables[:, :nb].cpu().numpy()
    tree = None if meta.tree_mask is None else meta.tree_mask.cpu().numpy()
    key = (block_size, window, tuple(qsl), tuple(lens), tables.tobytes(), None if tree is None else tree.tobytes())
    if _plan_cache[0] == key and _plan_cache[2] is not None:
        return _plan_cache[2]
    t = qsl[-1] if qsl else 0
    off, ln = np.zeros(t, np.int64), np.zeros(t, np.int64)
    parts, at = [], 0
    for b, length in enumerate(lens):
        r0, r1 = qsl[b], qsl[b + 1]
        n, prefix = r1 - r0, length - (r1 - r0)
        pos = np.arange(length)
        slots = tables[b, pos // block_size] * block_size + pos % block_size  # [L]
        parts.append(slots)
        base, at = at, at + length
        if tree is None:  # causal: row i sees the first prefix + i + 1 keys
            off[r0:r1], ln[r0:r1] = base, prefix + 1 + np.arange(n)
            continue
        vis = tree[r0:r1, :n].astype(bool)  # [n, n] ancestors and self
        cnt = vis.sum(1)
        contig = (vis == (np.arange(n)[None, :] < cnt[:, None])).all(1)  # sees new tokens 0 .. cnt - 1 only
        off[r0:r1], ln[r0:r1] = base, prefix + cnt
        other = np.flatnonzero(~contig)
        if other.size:
            seen = np.concatenate([np.ones((other.size, prefix), bool), vis[other]], 1)  # [rows, L]
            parts.append(np.broadcast_to(slots, seen.shape)[seen])  # row by row, each in position order
            off[r0 + other] = at + np.concatenate([[0], np.cumsum(prefix + cnt[other])[:-1]])
            at += int(seen.sum())
    keys = torch.from_numpy(np.concatenate(parts).astype(np.int64)) if parts else torch.zeros(0, dtype=torch.int64)
    flat = (keys, torch.from_numpy(off), torch.from_numpy(ln), int(ln.max()) if t else 0)
    _plan_cache[:] = [key, None, flat]
    return flat


def _flat_plan(plan: list, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The plan as flat arrays for the C kernel (cached with it): (key slots int64, off [T], len [T], the longest
    row): row r's visible keys are slots[off[r] : off[r] + len[r]], in position order."""
    if _plan_cache[1] is plan and _plan_cache[2] is not None:
        return _plan_cache[2]
    parts, at = [], 0
    off = torch.zeros(t, dtype=torch.int64)
    lens = torch.zeros(t, dtype=torch.int64)
    for slots, rows in plan:
        base = at
        parts.append(slots)
        at += slots.numel()
        for r, keys in rows:
            if isinstance(keys, tuple):
                off[r], lens[r] = base + keys[0], keys[1] - keys[0]
            else:  # a tree row: its own list of slots
                parts.append(slots[keys])
                off[r], lens[r] = at, keys.numel()
                at += keys.numel()
    keys = torch.cat(parts).contiguous() if parts else torch.zeros(0, dtype=torch.int64)
    flat = (keys, off, lens, int(lens.max()) if t else 0)
    if _plan_cache[1] is plan:
        _plan_cache[2] = flat
    return flat


def paged_attention_rowwise(q, k_cache, v_cache, meta: AttnMetadata, scale: float, window: int | None = None):
    """Same arguments and result as `paged_attention_reference`, one query row at a time (batch-invariant).

    A row's keys are always a [Hkv, D, L] view with the same strides (a slice of its sequence's gathered
    [L, Hkv, D] keys, or the same layout gathered for a tree row), its products are [Hkv, g, D] x [Hkv, D, L]
    and [Hkv, g, L] x [Hkv, L, D] with L its own number of visible keys, and its softmax runs over exactly
    those L scores: every shape and stride a row's arithmetic sees is a function of that row alone."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    kf, vf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    qs = (q * scale).view(t, hkv, g, d)
    if q.dtype == torch.float32:  # the C kernel (forerun/kernels/cpu_layer.c): the same rows, one call
        from ..kernels.cpu_layer import attention_rows

        fast = attention_rows(qs.reshape(t, hq, d), kf, vf, *flat_row_plan(meta, k_cache.shape[1], window))
        if fast is not None:
            return fast
    plan = _row_plan(meta, k_cache.shape[1], window)
    out = q.new_empty(t, hkv, g, d)
    threads = torch.get_num_threads()
    if threads > 1:  # row-sized ops gain nothing from a thread pool, and lose a wake-up per op on a busy machine
        torch.set_num_threads(1)
    try:
        _rows(qs, kf, vf, out, plan)
    finally:
        if threads > 1:
            torch.set_num_threads(threads)
    return out.view(t, hq, d)


def _rows(qs, kf, vf, out, plan) -> None:
    for slots, rows in plan:
        k, v = kf[slots], vf[slots]  # [L, Hkv, D]
        kt, vt = k.permute(1, 2, 0), v.transpose(0, 1)  # [Hkv, D, L], [Hkv, L, D]
        for r, keys in rows:
            if isinstance(keys, tuple):
                ks, vs = kt[:, :, keys[0]:keys[1]], vt[:, keys[0]:keys[1]]
            else:
                ks, vs = k[keys].permute(1, 2, 0), v[keys].transpose(0, 1)
            p = torch.softmax(torch.matmul(qs[r], ks), dim=-1)  # [Hkv, g, L]
            torch.matmul(p, vs, out=out[r])
