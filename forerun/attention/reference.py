"""Reference attention: plain SDPA over pages gathered into a padded batch. The readable oracle and the CPU path."""
from __future__ import annotations

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
