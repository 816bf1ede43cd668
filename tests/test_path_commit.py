"""forerun/kernels/path_commit.py (a tree round's KV moves and path-row gathers in a few launches) against the torch
ops TreeRound's device path runs otherwise (KVPool.move, which gathers before it scatters, and an index per layer),
on the CPU under Triton's interpreter or on CUDA: random trees and accepted paths, paths whose sources are other
paths' destinations, rows past a path, several requests and layers."""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
from forerun.kernels.path_commit import gather_paths, move_paths  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")


def _random_paths(g, b, n, s):
    """[b, n] accepted nodes (root first, -1 past the path): each path's ids increase, as a tree's do."""
    nodes = torch.full((b, n), -1, dtype=torch.long)
    for i in range(b):
        depth = int(torch.randint(0, s + 1, (1,), generator=g))
        ids = sorted(torch.randperm(n - 1, generator=g)[:depth].add(1).tolist())
        nodes[i, : depth + 1] = torch.tensor([0] + ids)
    return nodes


def _reference(k, v, slots, nodes, s, states, n):
    b = slots.shape[0]
    nodes = nodes[:, : s + 1]
    nodes = torch.where(nodes >= 0, nodes, torch.arange(s + 1, device=nodes.device))
    src, dst = slots.gather(1, nodes[:, 1:]).reshape(-1), slots[:, 1: s + 1].reshape(-1)
    for cache in (k, v):
        flat = cache.view(cache.shape[0], -1, *cache.shape[-2:])
        flat.index_copy_(1, dst, flat.index_select(1, src))
    flat = (torch.arange(b, device=nodes.device)[:, None] * n + nodes).reshape(-1)
    return {layer: h[flat].view(b, s + 1, -1) for layer, h in states.items()}


@pytest.mark.parametrize("b,n,s,layers,heads,dim", [(1, 16, 4, 3, 2, 8), (3, 8, 3, 2, 1, 64), (4, 5, 4, 1, 4, 32),
                                                    (2, 12, 1, 2, 2, 16), (2, 6, 3, 1, 3, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moves_and_gathers_equal_the_torch_ops(b, n, s, layers, heads, dim, dtype):
    g = torch.Generator().manual_seed(b * 100 + n * 10 + s)
    blocks, bs = 6 * b + 4, 4
    k = torch.randn(layers, blocks, bs, heads, dim, generator=g).to(dtype).to(DEV)
    v = torch.randn(layers, blocks, bs, heads, dim, generator=g).to(dtype).to(DEV)
    # request i's tree sits in consecutive slots (its root at a random offset in its own blocks, as the verify
    # step lays it out): a path node's source is often another node's destination
    starts = torch.randperm(blocks * bs - n, generator=g)[:b]
    slots = torch.stack([torch.arange(n) + o for o in starts.tolist()])
    if b > 1:  # distinct requests own distinct slots
        slots = (torch.arange(b)[:, None] * n + torch.arange(n)[None, :]) + int(starts[0]) % bs
    slots = slots.to(DEV)
    nodes = _random_paths(g, b, n, s).to(DEV)
    width = 2100 if heads * dim > 2048 else 24  # (rows wider than a block: several chunks per row)
    states = {i: torch.randn(b * n, width + 8 * i, generator=g).to(dtype).to(DEV) for i in (3, 7)}
    k0, v0 = k.clone(), v.clone()
    want = _reference(k0, v0, slots, nodes, s, states, n)
    move_paths(k, v, slots, nodes[:, : s + 1], s)
    got = gather_paths(states, nodes[:, : s + 1], n, s)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    for layer in states:
        assert torch.equal(got[layer], want[layer])


def test_a_path_whose_sources_are_its_own_destinations():
    """Path 0 -> 2 -> 3 -> 7: node 2 moves to slot 1 while node 3 moves to slot 2 (node 2's own slot) and node 7
    to slot 3 (node 3's): moved by depth, every source is read before a write lands on it."""
    k = torch.arange(1 * 2 * 4 * 1 * 2, dtype=torch.float32).view(1, 2, 4, 1, 2).to(DEV)
    v = -k.clone()
    slots = torch.arange(8, device=DEV)[None]
    nodes = torch.tensor([[0, 2, 3, 7, -1, -1, -1, -1]], device=DEV)
    k0, v0 = k.clone(), v.clone()
    move_paths(k, v, slots, nodes, 4)
    flat0, flat = k0.view(8, 2), k.view(8, 2)
    assert torch.equal(flat[1:4], flat0[[2, 3, 7]]) and torch.equal(flat[4:], flat0[4:])
    assert torch.equal(v.view(8, 2)[1:4], v0.view(8, 2)[[2, 3, 7]])
