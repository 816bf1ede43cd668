"""Paged KV cache: a pool of fixed-size blocks, per-sequence block tables, truncate as bookkeeping.

Prefix caching (`KVPool(prefix_caching=True)`; the engine's `enable_prefix_caching`): a finished (or preempted)
sequence hands its full blocks of known tokens to a content index instead of the free list. Each block is keyed
by a chained digest (sha256 of the key before it and the block's token ids), so one key names the whole prefix up
to that block, as vLLM's automatic prefix caching keys its blocks. A new sequence whose tokens start the same way
takes those blocks into its table (shared, counted, never written: its own writes start after them), and where
its next tokens match only the start of a cached block, those positions' keys and values are copied into a fresh
block of its own (so the match is per token, not per block, as SGLang's radix cache and llama.cpp's slot reuse
match). At least the last token is always left to compute: its logits are needed. Blocks nobody holds stay cached
and count as free; the allocator takes never-cached blocks first, then evicts the least recently released.
The engine rolls caches back after rejected drafts, so only positions the caller names as final are ever shared:
a prompt's (all but its last token) once it is read (`share_prefix`), all committed tokens but the newest when the
sequence ends (`free(seq_id, tokens)`).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
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
    shared: int = 0  # prefix caching: blocks[:shared] are cached blocks this sequence holds (read-only)
    key: bytes = b""  # prefix caching: the chained key of blocks[:shared] (b"" for none)


@dataclass
class _Cached:
    """A block in the prefix cache: its chained key, the key before it, its tokens, and live holders."""

    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    holders: int = 0


def block_key(parent: bytes, tokens) -> bytes:
    """The chained key of a block of `tokens` after the prefix keyed `parent` (b"" at the start)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class KVPool:
    """Physical storage [layers, num_blocks, block_size, kv_heads, head_dim] for keys and values, plus the allocator."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device | str,
                 num_layers: int | None = None, prefix_caching: bool = False) -> None:
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
        self.prefix_caching = prefix_caching
        self._index: dict[bytes, int] = {}  # chained key -> cached block
        self._cached: dict[int, _Cached] = {}  # cached block -> what it holds
        self._children: dict[bytes, dict[int, tuple[int, ...]]] = {}  # key -> cached blocks that follow it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, least recent first
        self.prefix_queries = 0  # tokens looked up (add_sequence with tokens)
        self.prefix_hits = 0  # ... of which found in the cache

    # -- allocator -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take now: never-cached ones and cached ones nobody holds (evicted on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def _take(self) -> int:
        """A block to write: a free one, else the least recently released cached block (evicted)."""
        if self._free:
            return self._free.pop()
        b, _ = self._evictable.popitem(last=False)
        self._forget(b)
        return b

    def _forget(self, b: int) -> None:
        c = self._cached.pop(b)
        del self._index[c.key]
        kids = self._children.get(c.parent)
        if kids is not None:
            kids.pop(b, None)
            if not kids:
                del self._children[c.parent]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block nobody holds (they go back to the free list). Returns whether the cache is
        empty now (False: running sequences still hold some; they stay cached until released)."""
        while self._evictable:
            b, _ = self._evictable.popitem(last=False)
            self._forget(b)
            self._free.append(b)
        return not self._cached

    def _release(self, b: int) -> None:
        """A sequence lets go of block b: a cached block loses a holder (cached on, evictable at none left), any
        other goes back to the free list."""
        c = self._cached.get(b)
        if c is None:
            self._free.append(b)
            return
        c.holders -= 1
        if c.holders == 0:
            self._evictable[b] = None

    def _hold(self, b: int) -> None:
        c = self._cached[b]
        if c.holders == 0:
            self._evictable.pop(b, None)
        c.holders += 1

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def add_sequence(self, seq_id: int, tokens: list[int] | None = None, limit: int | None = None) -> int:
        """A new sequence. With prefix caching and its tokens: the longest cached prefix of tokens[:limit] becomes its
        first committed positions (whole blocks shared, a last partial block copied). limit: at most this many
        positions (default len(tokens) - 1: the last token is left to compute, its logits are needed). Returns the
        tokens found."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id} already has KV blocks")
        seq = self._seqs[seq_id] = SeqBlocks()
        limit = len(tokens) - 1 if limit is None and tokens is not None else limit
        if self.prefix_caching and tokens is not None and min(limit, len(tokens)) > 0:
            self._attach(seq, tokens, min(limit, len(tokens)))
            self.prefix_queries += len(tokens)
            self.prefix_hits += seq.length
        return seq.length

    def _attach(self, seq: SeqBlocks, tokens: list[int], limit: int) -> None:
        bs, key = self.block_size, b""
        while (len(seq.blocks) + 1) * bs <= limit:  # whole blocks
            i = len(seq.blocks) * bs
            nxt = block_key(key, tokens[i: i + bs])
            b = self._index.get(nxt)
            if b is None:
                break
            self._hold(b)
            seq.blocks.append(b)
            key = nxt
        seq.shared, seq.key = len(seq.blocks), key
        seq.length = len(seq.blocks) * bs
        # the next block: the cached block after `key` that starts with the most of the next tokens
        want = tokens[seq.length: min(seq.length + bs, limit)]
        best, n = None, 0
        for b, toks in self._children.get(key, {}).items():
            m = 0
            while m < len(want) and toks[m] == want[m]:
                m += 1
            if m > n:
                best, n = b, m
        if best is None or not self._free:  # (a copy of < block_size tokens is not worth evicting a cached block)
            return
        dst = self._free.pop()
        for cache in (self.k, self.v):  # [L, blocks, block_size, Hkv, D]
            cache[:, dst, :n] = cache[:, best, :n]
        seq.blocks.append(dst)
        seq.length += n

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def length(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def blocks(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id].blocks

    def can_allocate(self, extra_tokens: int) -> bool:
        return -(-extra_tokens // self.block_size) <= self.num_free_blocks

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Make sure the sequence owns blocks for `num_tokens` tokens (allocated, not committed)."""
        seq = self._seqs[seq_id]
        need = -(-num_tokens // self.block_size) - len(seq.blocks)
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"KV pool exhausted: sequence {seq_id} needs {need} more blocks, {self.num_free_blocks} free")
        for _ in range(max(need, 0)):
            seq.blocks.append(self._take())

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
        if length < seq.shared * self.block_size:  # the next write would land in blocks others read
            raise ValueError(f"cannot truncate sequence {seq_id} to {length}: its first {seq.shared * self.block_size} "
                             "positions are shared prefix-cache blocks")
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
            self._release(seq.blocks[i])
            seq.blocks[i] = 0
        seq.dropped = max(seq.dropped, dead)

    def free(self, seq_id: int, tokens: list[int] | None = None) -> None:
        """Give the sequence's blocks back. tokens (prefix caching): the token ids whose keys and values the
        sequence's first positions are known to hold (the caller's word: positions past it may hold rejected
        drafts); its whole blocks within them and its committed length are kept in the cache for later sequences."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        if self.prefix_caching and tokens is not None and not seq.dropped:
            self._register(seq, tokens)
        for b in reversed(seq.blocks[seq.dropped:]):  # (dropped entries are the padding block; the tail first, so
            self._release(b)  # the cache evicts a prefix's last blocks before its first)

    def _register(self, seq: SeqBlocks, tokens: list[int], share: bool = False) -> None:
        """Cache seq's whole blocks within tokens, from its first unshared one. share: the sequence lives on and
        holds them as shared (never written again, truncate refuses); stops at a block already cached under the same
        key (another sequence's equal one)."""
        bs, key = self.block_size, seq.key
        for i in range(seq.shared, min(seq.length, len(tokens)) // bs):
            toks = tuple(tokens[i * bs: (i + 1) * bs])
            nxt = block_key(key, toks)
            b = seq.blocks[i]
            if nxt not in self._index:  # (an equal block already cached: this one goes back to the free list)
                self._index[nxt] = b
                self._cached[b] = _Cached(nxt, key, toks, holders=1)  # (this sequence, released at its free)
                self._children.setdefault(key, {})[b] = toks
            elif share:
                return
            key = nxt
            if share:
                seq.shared, seq.key = i + 1, key

    def share_prefix(self, seq_id: int, tokens: list[int]) -> None:
        """Prefix caching, while the sequence runs: its whole blocks within `tokens` (positions it will never write
        again, e.g. its prompt's but the last) enter the cache now, for sequences that start before it ends."""
        seq = self._seqs[seq_id]
        if self.prefix_caching and not seq.dropped:
            self._register(seq, tokens, share=True)

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
