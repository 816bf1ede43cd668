"""AttnMetadata: everything attention needs to run one flattened, ragged batch over the paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttnMetadata:
    """A step over B sequences with T new tokens in all.

    Sequence b owns query rows query_start_loc[b] .. query_start_loc[b+1]-1. Its new tokens are written
    to cache slots slot_mapping[rows] and occupy its logical cache positions seq_lens[b] - q_len_b ..
    seq_lens[b] - 1 (the cached prefix comes first). Without a tree mask, query i of sequence b sees
    every cached key up to and including its own slot (causal). With a tree mask, it sees the whole
    cached prefix plus the new tokens j of its sequence with tree_mask[row, j] true (its ancestors and
    itself); RoPE positions then come from `positions` (prefix length + depth), not from the slot.
    """

    query_start_loc: torch.Tensor  # [B + 1] int64, cumulative query lengths (cu_seqlens_q)
    seq_lens: torch.Tensor  # [B] int64, KV length of each sequence after this step's writes
    block_tables: torch.Tensor  # [B, max_blocks] int64, physical block ids (padding: 0)
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot (block * block_size + offset) of each new token
    max_query_len: int
    max_seq_len: int
    tree_mask: torch.Tensor | None = None  # [T, max_query_len] bool, visibility among the sequence's new tokens

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def row_to_seq(self) -> torch.Tensor:
        """[T] int64: which sequence each query row belongs to."""
        q_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
        return torch.repeat_interleave(torch.arange(self.num_seqs, device=q_lens.device), q_lens, output_size=self.num_tokens)
