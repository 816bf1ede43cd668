"""The inputs of a queued tree verify step in one launch (TreeRound._queue_verify -> GraphRunner.replay_tree).

The next round's verify step is laid out on the device from this round's verdict and the prelaunched tree: node
0's token is the bonus token (out_tokens[i, a_i]), nodes 1.. the tree's drafts, the root sits at ctx_i = roots_i
+ a_i + 1, node j's key goes to cache position ctx_i + j (its slot through the block table) and its RoPE position
is ctx_i + depth[i, j]; the graph's static buffers take ids, positions, slots, sequence lengths, query starts, the
block-table rows and the tree mask rows. As torch ops that is ~20 small kernels and copies, each costing the device
~3-5 us between the verify forwards (benchmarks/gpu_gaps.py, session 48); here it is one launch after one host ->
device copy of the roots and block tables (`stage`). `verify_inputs_torch` is the same in torch ops (the CPU, and
the reference tests/test_round_prep.py checks the kernel against under Triton's interpreter). Used where
`forerun.devices.kernels_on("FORERUN_PREP_KERNELS", device)` says (CUDA by default)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def verify_inputs_torch(out_tokens: torch.Tensor, num_accepted: torch.Tensor, stage: torch.Tensor,
                        tree_tokens: torch.Tensor, depth: torch.Tensor, mask: torch.Tensor, block_size: int,
                        input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_tables: torch.Tensor,
                        tree_rows: torch.Tensor) -> torch.Tensor:
    """out_tokens [B, >= max a + 1] (the verdict's accepted drafts then the bonus token), num_accepted [B];
    stage [B + B * W] int64: the roots (each request's newest committed position before the verdict), then the B
    block-table rows of width W; tree_tokens [B, >= n] (column 0 unread), depth [B, n], mask [B, n, n] bool.
    Writes rows 0..B n - 1 of input_ids / positions / slot_mapping / tree_rows (its first n columns), seq_lens[:B],
    query_start_loc[:B + 1], block_tables[:B] (zero past W). Returns the slots [B n] (a tensor of its own)."""
    b, n = depth.shape
    t, w = b * n, (stage.numel() - b) // b
    acc = num_accepted.long()
    table = stage[b:].view(b, w)
    ctx = stage[:b] + acc + 1  # [B]: the next root's position
    block_tables[:b].zero_()
    block_tables[:b, :w].copy_(table)
    tokens = torch.cat([out_tokens.gather(1, acc[:, None]).long(), tree_tokens[:, 1:n].long()], 1)  # [B, n]
    cache_pos = ctx[:, None] + torch.arange(n, device=ctx.device)  # [B, n]
    pages = torch.gather(table, 1, cache_pos // block_size)
    slots = (pages * block_size + cache_pos % block_size).reshape(-1)  # [B n]
    input_ids[:t].copy_(tokens.reshape(-1))
    positions[:t].copy_((ctx[:, None] + depth).reshape(-1))
    slot_mapping[:t].copy_(slots)
    seq_lens[:b].copy_(ctx + n)
    query_start_loc[: b + 1].copy_(torch.arange(b + 1, device=ctx.device) * n)
    tree_rows[:t, :n].copy_(mask.reshape(t, n))
    return slots


# every integer argument changes with the batch, the tree, the block tables' width or the buffers: none is
# specialised on (Triton compiles a variant for a value of 1 or a multiple of 16: a table growing past 16 blocks in
# the middle of serving would compile one, ~0.1-0.5 s with the GPU idle, as session 48's first runs on the H100
# showed), and the constexpr block sizes follow the buffers' shapes, never the live table width
_VERIFY_INTS = ("out_stride", "acc_stride", "tok_stride", "depth_stride", "mask_s0", "mask_s1", "tables_stride",
                "max_blocks", "rows_stride", "B", "n", "W", "bs")
_EXTEND_INTS = ("tok_stride", "nodes_stride", "out_stride", "acc_stride", "prev_stride", "feats_s0", "feats_s1",
                "rows_stride", "tables_stride", "B", "s", "W", "F")


@triton.jit(do_not_specialize=_VERIFY_INTS)
def _verify_inputs_kernel(Out, out_stride, Acc, acc_stride, Stage, Tok, tok_stride, Depth, depth_stride, Mask,
                          mask_s0, mask_s1, Ids, Pos, SlotMap, Slots, SeqLens, Qsl, Tables, tables_stride, max_blocks,
                          Rows, rows_stride, B, n, W, bs, NP: tl.constexpr, WB: tl.constexpr):
    i = tl.program_id(0)
    j = tl.arange(0, NP)
    live = j < n
    a = tl.load(Acc + i * acc_stride).to(tl.int64)
    bonus = tl.load(Out + i * out_stride + a).to(tl.int64)
    tok = tl.load(Tok + i * tok_stride + j, mask=live & (j > 0), other=0).to(tl.int64)
    tok = tl.where(j == 0, bonus, tok)
    ctx = tl.load(Stage + i) + a + 1
    row = Stage + B + i * W  # this request's block table in the stage
    pos = ctx + j
    page = tl.load(row + pos // bs, mask=live & (pos // bs < W), other=0)
    slot = page * bs + pos % bs
    d = tl.load(Depth + i * depth_stride + j, mask=live, other=0).to(tl.int64)
    out = i * n + j
    tl.store(Ids + out, tok, mask=live)
    tl.store(Pos + out, ctx + d, mask=live)
    tl.store(SlotMap + out, slot, mask=live)
    tl.store(Slots + out, slot, mask=live)
    tl.store(SeqLens + i, ctx + n)
    tl.store(Qsl + i + 1, (i + 1) * n)
    if i == 0:
        tl.store(Qsl, 0)
    c = tl.arange(0, WB)
    for c0 in range(0, max_blocks, WB):  # the block table row, zero past W
        cc = c0 + c
        v = tl.load(row + cc, mask=cc < W, other=0)
        tl.store(Tables + i * tables_stride + cc, v, mask=cc < max_blocks)
    jj = j[:, None]
    kk = j[None, :]
    both = live[:, None] & live[None, :]
    m = tl.load(Mask + i * mask_s0 + jj * mask_s1 + kk, mask=both, other=0)
    tl.store(Rows + (i * n + jj) * rows_stride + kk, m, mask=both)


def verify_inputs(out_tokens: torch.Tensor, num_accepted: torch.Tensor, stage: torch.Tensor,
                  tree_tokens: torch.Tensor, depth: torch.Tensor, mask: torch.Tensor, block_size: int,
                  input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_tables: torch.Tensor,
                  tree_rows: torch.Tensor) -> torch.Tensor:
    """`verify_inputs_torch` in one launch (one program per request)."""
    b, n = depth.shape
    w = (stage.numel() - b) // b
    assert stage.dtype == torch.int64 and stage.is_contiguous() and w >= 1
    for x in (input_ids, positions, slot_mapping, seq_lens, query_start_loc, block_tables):
        assert x.dtype == torch.int64 and x.stride(-1) == 1
    assert out_tokens.stride(1) == 1 and tree_tokens.stride(1) == 1 and depth.stride(1) == 1 and mask.stride(2) == 1
    assert tree_rows.stride(1) == 1
    assert mask.dtype == torch.bool and tree_rows.dtype == torch.bool
    slots = torch.empty(b * n, dtype=torch.int64, device=depth.device)
    _verify_inputs_kernel[(b,)](
        out_tokens, out_tokens.stride(0), num_accepted, num_accepted.stride(0), stage, tree_tokens,
        tree_tokens.stride(0), depth, depth.stride(0), mask.view(torch.uint8), mask.stride(0), mask.stride(1), input_ids, positions, slot_mapping,
        slots, seq_lens, query_start_loc, block_tables, block_tables.stride(0), block_tables.shape[1],
        tree_rows.view(torch.uint8), tree_rows.stride(0), b, n, w, block_size,
        NP=triton.next_power_of_2(max(n, 2)), WB=min(1024, triton.next_power_of_2(block_tables.shape[1])), num_warps=1)
    return slots


# -- the head's draft extend after a verdict (EagleDrafter.prelaunch -> _StaticDrafting.extend_from_verdict) ----------
def extend_inputs_torch(tree_tokens: torch.Tensor, accepted_nodes: torch.Tensor, out_tokens: torch.Tensor,
                        num_accepted: torch.Tensor, stage: torch.Tensor, prev: torch.Tensor, feats: torch.Tensor,
                        ids: torch.Tensor, rows: torch.Tensor, lo: torch.Tensor, nlast: torch.Tensor,
                        ctx: torch.Tensor, tables: torch.Tensor) -> None:
    """The EAGLE head's draft extend over an accepted path, from the device verdict: request i feeds qe = s + 2
    rows from position lo_i = roots_i - 1 (the kept root row again, the path's a_i drafts, the bonus token, then
    padding: the root's token, as the path's -1 nodes give).

    tree_tokens [B, n] (this round's trees, the root's token in column 0), accepted_nodes [B, >= s + 1] (root
    first, -1 past the path), out_tokens [B, >= s + 1] and num_accepted [B] (the verdict); stage [2 B + B W]
    int64: roots, lo, then the head cache's B block-table rows of width W; prev [B, F] (the feature of row lo_i),
    feats [B, s + 1, F] (the path rows' features). Writes ids[:B qe], rows[:B qe] (features), lo / nlast (= a_i +
    1, the last real row) / ctx (= roots_i + a_i + 1) [:B], tables[:B, :W]."""
    b, s1 = feats.shape[:2]
    qe = s1 + 1
    w = (stage.numel() - 2 * b) // b
    acc = num_accepted.long()
    nodes = accepted_nodes[:, :s1].clamp(min=0)  # [B, s + 1]; past the path: the root (unused)
    path = tree_tokens.gather(1, nodes).long()  # [B, s + 1], the root's token first
    x = torch.cat([path, path[:, :1]], 1)  # [B, s + 2]
    x.scatter_(1, acc[:, None] + 1, out_tokens.gather(1, acc[:, None]).long())
    ids[: b * qe].copy_(x.reshape(-1))
    rows[: b * qe].view(b, qe, -1).copy_(torch.cat([prev[:, None], feats], 1))
    lo[:b].copy_(stage[b: 2 * b])
    nlast[:b].copy_(acc + 1)
    ctx[:b].copy_(stage[:b] + acc + 1)
    tables[:b, :w].copy_(stage[2 * b:].view(b, w))


@triton.jit(do_not_specialize=_EXTEND_INTS)
def _extend_inputs_kernel(Tok, tok_stride, Nodes, nodes_stride, Out, out_stride, Acc, acc_stride, Stage, Prev,
                          prev_stride, Feats, feats_s0, feats_s1, Ids, Rows, rows_stride, Lo, Nlast, Ctx, Tables,
                          tables_stride, B, s, W, F, QP: tl.constexpr, WB: tl.constexpr, FB: tl.constexpr):
    i = tl.program_id(0)
    r = tl.program_id(1)  # the row to copy: 0 = the kept root row (prev), 1.. = the path rows
    qe = s + 2
    fo = tl.arange(0, FB)
    dst = Rows + (i * qe + r).to(tl.int64) * rows_stride
    if r == 0:
        src = Prev + i.to(tl.int64) * prev_stride
    else:
        src = Feats + i.to(tl.int64) * feats_s0 + (r - 1).to(tl.int64) * feats_s1
    for f0 in range(0, F, FB):
        m = f0 + fo < F
        tl.store(dst + f0 + fo, tl.load(src + f0 + fo, mask=m), mask=m)
    if r == 0:  # the request's ids and ints
        a = tl.load(Acc + i * acc_stride).to(tl.int64)
        j = tl.arange(0, QP)
        node = tl.load(Nodes + i * nodes_stride + j, mask=j <= s, other=-1)
        node = tl.maximum(node, 0)
        tok = tl.load(Tok + i * tok_stride + node, mask=j < qe, other=0).to(tl.int64)
        bonus = tl.load(Out + i * out_stride + a).to(tl.int64)
        tl.store(Ids + i * qe + j, tl.where(j == a + 1, bonus, tok), mask=j < qe)
        root = tl.load(Stage + i)
        tl.store(Lo + i, tl.load(Stage + B + i))
        tl.store(Nlast + i, a + 1)
        tl.store(Ctx + i, root + a + 1)
        c = tl.arange(0, WB)
        for c0 in range(0, W, WB):
            cc = c0 + c
            tl.store(Tables + i * tables_stride + cc, tl.load(Stage + 2 * B + i * W + cc, mask=cc < W), mask=cc < W)


def extend_inputs(tree_tokens: torch.Tensor, accepted_nodes: torch.Tensor, out_tokens: torch.Tensor,
                  num_accepted: torch.Tensor, stage: torch.Tensor, prev: torch.Tensor, feats: torch.Tensor,
                  ids: torch.Tensor, rows: torch.Tensor, lo: torch.Tensor, nlast: torch.Tensor,
                  ctx: torch.Tensor, tables: torch.Tensor) -> None:
    """`extend_inputs_torch` in one launch (a program per request and row)."""
    b, s1, f = feats.shape
    w = (stage.numel() - 2 * b) // b
    assert stage.dtype == torch.int64 and stage.is_contiguous() and w >= 1 and w <= tables.shape[1]
    for x in (ids, lo, nlast, ctx, tables):
        assert x.dtype == torch.int64 and x.stride(-1) == 1
    assert tree_tokens.stride(1) == 1 and accepted_nodes.stride(1) == 1 and out_tokens.stride(1) == 1
    assert accepted_nodes.shape[1] >= s1 and feats.stride(2) == 1 and prev.stride(1) == 1 and rows.stride(1) == 1
    assert rows.dtype == feats.dtype == prev.dtype and rows.shape[1] == f
    _extend_inputs_kernel[(b, s1 + 1)](
        tree_tokens, tree_tokens.stride(0), accepted_nodes, accepted_nodes.stride(0), out_tokens, out_tokens.stride(0),
        num_accepted, num_accepted.stride(0), stage, prev, prev.stride(0), feats, feats.stride(0), feats.stride(1),
        ids, rows, rows.stride(0), lo, nlast, ctx, tables, tables.stride(0), b, s1 - 1, w, f,
        QP=triton.next_power_of_2(s1 + 1), WB=min(1024, triton.next_power_of_2(tables.shape[1])),  # (the buffer's)
        FB=min(4096, triton.next_power_of_2(f)), num_warps=4)
