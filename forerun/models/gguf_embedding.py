"""The token embedding of a GGUF kept in its quantized blocks, rows dequantized as they are looked up (CPU layouts).

Why: the embedding is read a row per token, never streamed, yet the fp32 table is the largest tensor of a small
model: Qwen2.5-Coder-1.5B's 151,936 x 1,536 table is 933 MB in fp32 against 125 MiB of Q4_K blocks, the 0.5B's
545 MB against 89 MiB of Q5_0. `GGUFEmbedding` holds the blocks as a view of the memory-mapped file (the page
cache holds them; only the rows prompts use are ever read) and dequantizes the looked-up rows with gguf's own row
dequantization: each row is exactly the row the fp32 table held (tests/test_quant.py), so outputs do not change.
llama.cpp keeps its embedding quantized the same way (`ggml_get_rows` on the quantized tensor).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def row_dequantizer(type_name: str):
    """gguf's row dequantization for a quantized GGML type (blocks [n, row bytes] -> float32 [n, row]), or None."""
    from gguf import quants

    cls = getattr(quants, type_name, None)
    if type_name in FLOAT_TYPES or cls is None or not hasattr(cls, "dequantize_rows"):
        return None
    cls.init_grid()
    return cls.dequantize_rows


class GGUFEmbedding(nn.Module):
    """nn.Embedding's forward over a GGUF's quantized embedding blocks (loader.GGUFQuantized, 2-D, unpermuted).
    Outputs float32 on the CPU. ``weight`` materializes the whole fp32 table (for tools that need the matrix, such
    as EAGLE training; the inference path never touches it)."""

    def __init__(self, blocks) -> None:
        super().__init__()
        rows = row_dequantizer(blocks.type_name)
        if rows is None or blocks.data.ndim != 2 or blocks.unpermute_heads:
            raise ValueError(f"{blocks.where}: GGML type {blocks.type_name} is not a quantized row layout")
        self.num_embeddings, self.embedding_dim = (int(d) for d in blocks.shape)
        self.type_name = blocks.type_name
        self._blocks = blocks  # .data: [num_embeddings, row bytes] uint8, a view of the mapped file
        self._rows = rows
        # Rows of recent small lookups (decode, verify and drafting steps), dequantized once: gguf's numpy
        # dequantization costs ~0.25 ms a call whatever the row count (an EAGLE head looks up 1-9 rows ~4 times a
        # round). Bounded; cleared when full. The same float32 rows either way.
        self._cache: dict[int, torch.Tensor] = {}
        self._cache_rows = max(0, self.CACHE_BYTES // (4 * self.embedding_dim))

    @property
    def quantized_bytes(self) -> int:
        return int(self._blocks.data.nbytes)

    @property
    def weight(self) -> torch.Tensor:
        return self._blocks.dequantize()

    CACHE_BYTES = 32 << 20  # dequantized rows kept for small lookups
    CACHE_LOOKUP = 64  # lookups of at most this many rows use (and fill) the cache; prompts do not

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        if 0 < flat.size <= self.CACHE_LOOKUP and self._cache_rows:
            return self._cached(flat.tolist()).reshape(*ids.shape, self.embedding_dim)
        out = self._rows(self._blocks.data[flat]) if flat.size else \
            np.zeros((0, self.embedding_dim), np.float32)
        return torch.from_numpy(out).reshape(*ids.shape, self.embedding_dim)

    def _cached(self, ids: list[int]) -> torch.Tensor:
        cache = self._cache
        rows = [cache.get(i) for i in ids]  # (get: another thread may clear the cache meanwhile)
        miss = sorted({i for i, r in zip(ids, rows) if r is None})
        if miss:
            got = dict(zip(miss, torch.from_numpy(self._rows(self._blocks.data[np.asarray(miss)]))))
            if len(cache) + len(miss) > self._cache_rows:
                cache.clear()
            cache.update(got)
            rows = [got[i] if r is None else r for i, r in zip(ids, rows)]
        return torch.stack(rows)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.type_name} blocks ({self.quantized_bytes / 2**20:.0f} MiB)"
