"""A tree round's commit on the device, before the verdict is read (TreeRound's device path): every accepted
path's keys and values moved to the cache positions a chain would have written, and the path rows' hidden states
gathered, in one launch plus one per hidden layer instead of ~14 small torch kernels (each costs the device ~2-3 us
at batch 1, graph or not: docs/performance.md, session 29).

nodes [B, >= s + 1] are the accepted nodes of each request's tree (root first, -1 past its path), slots [B, n] the
cache slots the verify step wrote node j of request i to. A path's nodes have increasing ids (a child's id is above
its parent's), so node j of a path has id >= j: moving the path's nodes in order of depth never overwrites a slot
that a deeper node still has to be read from, which is what lets one program per (layer, request) move them in
place. Used where `forerun.engine.round._path_kernels` says (CUDA by default); under TRITON_INTERPRET=1 they
run on the CPU (tests/test_path_commit.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _move_rows(P, base, Slots, Nodes, r, n, s, stride_nodes, E, BLOCK: tl.constexpr):
    e = tl.arange(0, BLOCK)
    for j in range(1, s + 1):  # by depth: a write never lands on a slot still to be read
        node = tl.load(Nodes + r * stride_nodes + j)
        node = tl.where(node >= 0, node, j)  # past the path: the slot onto itself
        src = tl.load(Slots + r * n + node)
        dst = tl.load(Slots + r * n + j)
        for e0 in range(0, E, BLOCK):
            m = e0 + e < E
            x = tl.load(P + base + src * E + e0 + e, mask=m)
            tl.store(P + base + dst * E + e0 + e, x, mask=m)
        tl.debug_barrier()


@triton.jit
def _move_paths_kernel(K, V, Slots, Nodes, layer_stride, E, n, s, stride_nodes, BLOCK: tl.constexpr):
    layer = tl.program_id(0)
    r = tl.program_id(1)
    base = layer.to(tl.int64) * layer_stride
    _move_rows(K, base, Slots, Nodes, r, n, s, stride_nodes, E, BLOCK)
    _move_rows(V, base, Slots, Nodes, r, n, s, stride_nodes, E, BLOCK)


def move_paths(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, nodes: torch.Tensor, s: int) -> None:
    """k, v: the pool's caches [L, blocks, block size, kv heads, head dim] (slot = block * block size + offset);
    request i's path node j (j = 1..s) moves from slots[i, nodes[i, j]] to slots[i, j]. Requires what every tree
    verdict gives (the module docstring): node ids increasing along a path (so nodes[i, j] >= j), -1 past it;
    unlike KVPool.move it does not gather every source before the first write."""
    b, n = slots.shape
    if s < 1 or b == 0:
        return
    assert k.is_contiguous() and v.is_contiguous() and k.shape == v.shape
    assert nodes.dtype == torch.int64 and nodes.stride(1) == 1 and nodes.shape[0] == b and nodes.shape[1] > s
    assert slots.dtype == torch.int64  # (slot * row width in 64 bits)
    slots = slots.contiguous()
    e = k.shape[-2] * k.shape[-1]
    layer_stride = k[0].numel()
    _move_paths_kernel[(k.shape[0], b)](k, v, slots, nodes, layer_stride, e, n, s, nodes.stride(0),
                                        BLOCK=min(2048, triton.next_power_of_2(e)), num_warps=4)


@triton.jit
def _gather_rows_kernel(H, Out, Nodes, n, stride_nodes, stride_h, W, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1)
    node = tl.load(Nodes + r * stride_nodes + j)
    node = tl.where(node >= 0, node, j)
    src = (r * n + node).to(tl.int64) * stride_h
    dst = (r * tl.num_programs(1) + j).to(tl.int64) * W
    h = tl.arange(0, BLOCK)
    for h0 in range(0, W, BLOCK):
        m = h0 + h < W
        tl.store(Out + dst + h0 + h, tl.load(H + src + h0 + h, mask=m), mask=m)


def gather_paths(states: dict[int, torch.Tensor], nodes: torch.Tensor, n: int, s: int) -> dict[int, torch.Tensor]:
    """states[layer]: [B n, W] rows of the verify forward -> [B, s + 1, W] per layer: request i's path rows (node
    nodes[i, j], or row j past its path, as the torch path gathers), one launch per layer."""
    b = nodes.shape[0]
    assert nodes.dtype == torch.int64 and nodes.stride(1) == 1 and nodes.shape[1] > s
    out = {}
    for layer, h in states.items():
        w = h.shape[-1]
        assert h.stride(-1) == 1 and h.shape[0] == b * n
        o = torch.empty(b, s + 1, w, dtype=h.dtype, device=h.device)
        _gather_rows_kernel[(b, s + 1)](h, o, nodes, n, nodes.stride(0), h.stride(0), w,
                                       BLOCK=min(2048, triton.next_power_of_2(w)), num_warps=4)
        out[layer] = o
    return out
