"""Paged KV cache: a pool of fixed-size blocks, per-sequence block tables, truncate as bookkeeping."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import CacheConfig, ModelConfig


class OutOfBlocks(RuntimeError):
    """The pool has no free block left for a growing sequence."""


@dataclass
class SeqBlocks:
    """One sequence's view of the pool: its blocks in order and its committed length (tokens with valid KV).

    `blocks` may hold more capacity than `length` needs: slots past `length` are allocated but not
    committed (speculative writes land there and are simply overwritten next round)."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0
    dropped: int = 0  # sliding window: blocks[:dropped] were given back (their entries are the padding block 0)


class KVPool:
    """Physical storage [layers, num_blocks, block_size, kv_heads, head_dim] for keys and values, plus the allocator."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device | str,
                 num_layers: int | None = None) -> None:
        self.num_layers = num_layers if num_layers is not None else model.num_layers
        self.block_size = cache.block_size
        per_block = 2 * self.num_layers * cache.block_size * model.num_kv_heads * model.head_dim * dtype.itemsize
        num_blocks = cache.num_blocks or max(2, cache.memory_budget_bytes // per_block)
        shape = (self.num_layers, num_blocks, cache.block_size, model.num_kv_heads, model.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # block 0 is kept as the padding block
        self._seqs: dict[int, SeqBlocks] = {}
        self.window = model.sliding_window  # None, or blocks wholly outside the window are given back (truncate)

    # -- allocator -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id} already has KV blocks")
        self._seqs[seq_id] = SeqBlocks()

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def length(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def blocks(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id].blocks

    def can_allocate(self, extra_tokens: int) -> bool:
        return -(-extra_tokens // self.block_size) <= len(self._free)

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Make sure the sequence owns blocks for `num_tokens` tokens (allocated, not committed)."""
        seq = self._seqs[seq_id]
        need = -(-num_tokens // self.block_size) - len(seq.blocks)
        if need > len(self._free):
            raise OutOfBlocks(f"KV pool exhausted: sequence {seq_id} needs {need} more blocks, {len(self._free)} free")
        for _ in range(max(need, 0)):
            seq.blocks.append(self._free.pop())

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Flat slot ids [end - start] of logical positions start .. end-1 (must be reserved)."""
        blocks = torch.tensor(self._seqs[seq_id].blocks, dtype=torch.int64)
        pos = torch.arange(start, end, dtype=torch.int64)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def set_length(self, seq_id: int, length: int) -> None:
        """Commit `length` tokens (they must be reserved). Used after a forward wrote them."""
        seq = self._seqs[seq_id]
        if length > len(seq.blocks) * self.block_size:
            raise ValueError(f"sequence {seq_id}: length {length} exceeds reserved capacity")
        seq.length = length

    def truncate(self, seq_id: int, length: int) -> None:
        """Roll back to `length` committed tokens: bookkeeping only, nothing is copied or cleared.
        Blocks stay with the sequence (over-allocation reused next round) until free()."""
        seq = self._seqs[seq_id]
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot truncate sequence {seq_id} of length {seq.length} to {length}")
        if seq.dropped and length < seq.dropped * self.block_size + self.window - 1:  # a query at `length` needs them
            raise ValueError(f"cannot truncate sequence {seq_id} to {length}: its keys before position "
                             f"{seq.dropped * self.block_size} left the sliding window and were freed")
        seq.length = length
        if self.window is not None:
            self._drop_outside_window(seq)

    def _drop_outside_window(self, seq: SeqBlocks) -> None:
        """Sliding-window models: truncate receives the committed length (every later query sits at a position
        >= length, and no rollback goes below it), and a query at position i reads keys > i - window only, so
        blocks wholly before length - window are never read again: they go back to the pool, and their table
        entries become the padding block 0 (masked by the window in attention). This is the paged form of
        seed 000's ring of window + largest-draft slots: the draft's slots are simply the blocks past `length`,
        kept until verification has decided, because blocks are only given back here, after the rollback."""
        dead = min(max(0, seq.length - self.window) // self.block_size, len(seq.blocks))
        for i in range(seq.dropped, dead):
            self._free.append(seq.blocks[i])
            seq.blocks[i] = 0
        seq.dropped = max(seq.dropped, dead)

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks[seq.dropped:]))  # dropped entries are the padding block

    def block_table(self, seq_ids: list[int], width: int | None = None) -> torch.Tensor:
        """[B, width] int64 block tables, padded with block 0."""
        width = width or max((len(self._seqs[s].blocks) for s in seq_ids), default=1) or 1
        table = torch.zeros(len(seq_ids), width, dtype=torch.int64)
        for i, s in enumerate(seq_ids):
            b = self._seqs[s].blocks
            table[i, : len(b)] = torch.tensor(b, dtype=torch.int64)
        return table

    # -- storage -----------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values [T, Hkv, D] at flat slots [T]."""
        self.k[layer].view(-1, *self.k.shape[-2:])[slots] = k
        self.v[layer].view(-1, *self.v.shape[-2:])[slots] = v

    def move(self, seq_id: int | None, src_positions, dst_positions) -> None:
        """Copy keys/values of logical positions src -> dst (all layers), e.g. compacting an accepted tree path
        into contiguous positions. Gathered before scattering, so overlapping moves are safe.
        seq_id None: src / dst are flat cache slots already (int64 tensors on the cache's device, dst distinct),
        e.g. every request's path of a round at once; nothing is read back to the host."""
        if seq_id is None:
            src, dst = src_positions, dst_positions
            if src.numel() == 0:
                return
        else:
            if not src_positions:
                return
            blocks, bs = self._seqs[seq_id].blocks, self.block_size
            src = torch.tensor([blocks[p // bs] * bs + p % bs for p in src_positions], dtype=torch.int64)
            dst = torch.tensor([blocks[p // bs] * bs + p % bs for p in dst_positions], dtype=torch.int64)
            if self.k.device.type == "cuda":
                src, dst = src.to(self.k.device, non_blocking=True), dst.to(self.k.device, non_blocking=True)
        for cache in (self.k, self.v):
            flat = cache.view(cache.shape[0], -1, *cache.shape[-2:])  # [L, slots, Hkv, D]
            flat.index_copy_(1, dst, flat.index_select(1, src))
