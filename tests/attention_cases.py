"""Random paged-attention cases for the attention tests (CPU interpreter and CUDA alike)."""
from __future__ import annotations

import torch

from forerun.attention.metadata import AttnMetadata

# name -> (q_lens, prefixes, tree, window): the step shapes the Triton attention tests run through
STEP_CASES = {
    "one token": ([1], [45], False, None),
    "decode": ([1, 1, 1, 1], [0, 7, 8, 45], False, None),
    "causal": ([3, 5, 1], [9, 30, 17], False, None),
    "tree": ([6, 4, 1], [13, 24, 5], True, None),
    "window": ([1, 3, 5, 1], [0, 9, 30, 17], False, 7),
    "decode window": ([1, 1, 1], [0, 20, 45], False, 7),
}


def paged_case(q_lens, prefixes, hq, hkv, d, page, device, dtype, seed=0, tree=False):
    """A ragged batch over a paged KV cache with shuffled blocks (block 0 unused): sequence b has prefixes[b] cached
    tokens and q_lens[b] new ones. tree: a random tree among each sequence's new tokens (each sees its ancestors
    and itself) as the tree mask. Returns q [T, hq, d], k / v caches [blocks, page, hkv, d], AttnMetadata."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefixes, q_lens)]
    nblk = [-(-s // page) for s in seq_lens]
    perm = (torch.randperm(sum(nblk) + 2, generator=g) + 1).tolist()
    tables = torch.zeros(len(q_lens), max(nblk) + 1, dtype=torch.int64)
    at = 0
    for b, n in enumerate(nblk):
        tables[b, :n] = torch.tensor(perm[at:at + n])
        at += n
    k = torch.randn(sum(nblk) + 3, page, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(sum(nblk) + 3, page, hkv, d, generator=g).to(device, dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(device, dtype)
    qsl = torch.tensor([0] + torch.cumsum(torch.tensor(q_lens), 0).tolist())
    slots = torch.cat([tables[b, torch.arange(p, p + n) // page] * page + torch.arange(p, p + n) % page
                       for b, (p, n) in enumerate(zip(prefixes, q_lens))])
    mask = random_tree_mask(q_lens, qsl, g) if tree else None
    meta = AttnMetadata(qsl.to(device), torch.tensor(seq_lens, device=device), tables.to(device), slots.to(device),
                        max(q_lens), max(seq_lens), tree_mask=None if mask is None else mask.to(device))
    return q, k, v, meta


def random_tree_mask(q_lens, qsl, g: torch.Generator) -> torch.Tensor:
    """[T, max(q_lens)] bool: a random tree among each sequence's new tokens (qsl: their start rows), each node
    seeing its ancestors and itself; the parents drawn from g."""
    mask = torch.zeros(sum(q_lens), max(q_lens), dtype=torch.bool)
    for b, n in enumerate(q_lens):
        parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        for i in range(n):
            j = i
            while j >= 0:
                mask[int(qsl[b]) + i, j] = True
                j = parent[j]
    return mask
