"""Paged attention in Triton for decode and verification steps (1..16 new tokens per sequence), CUDA-graph safe.

One program handles one sequence, one KV head, one tile of up to 16 query tokens and one split of the KV
range. Its rows are (query token, query head of the GQA group) pairs, so the keys and values of a KV head are
read once for the whole group and all the tile's tokens. Keys are visited in tiles of BLOCK_N tokens gathered
through the block table; scores get the causal mask over the cached prefix plus the new tokens, or the tree
mask among the new tokens. When few programs would run (small batches), the KV range is split and a second
kernel merges the partial softmaxes (flash-decoding).

Launch shapes depend only on the number of sequences, the number of tokens and meta.max_query_len, never on
sequence lengths (those are read on the device), so a step of fixed bucket shape can be captured in a graph.
Longer queries (prefill) work too: they are cut into tiles of 16 tokens.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..kernels.pdl import attention_waits, enabled as pdl_enabled, gdc_launch_dependents, gdc_wait, launch_kwargs
from . import cuda_decode
from .base import AttentionBackend, kv_splits
from .metadata import AttnMetadata
from .reference import paged_attention_reference

_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30  # "window" of full attention: every position is within it
TESTS_FORCE_PRELOAD = [False]  # tests only: the first-tile preload without PDL (the CPU interpreter has no waits)


@triton.jit
def _kv_tile_ptrs(K, V, BlockTables, seq, stride_bt, offs_n, n_ok, kvh, offs_d,
                  stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, PAGE: tl.constexpr):
    """Pointers [N, D] to the keys and values of positions offs_n of sequence seq, KV head kvh (pages from its
    block table; rows not n_ok point into block 0)."""
    page = tl.load(BlockTables + seq * stride_bt + offs_n // PAGE, mask=n_ok, other=0)
    in_page = offs_n % PAGE
    kp = K + page[:, None] * stride_kb + in_page[:, None] * stride_kp + kvh * stride_kh + offs_d[None, :]
    vp = V + page[:, None] * stride_vb + in_page[:, None] * stride_vp + kvh * stride_vh + offs_d[None, :]
    return kp, vp


@triton.jit
def _softmax_tile(q, k, offs_n, n_ok, prefix, qi, tok, row_ok, window, Tree, stride_tree, qk_scale, m_i, l_i,
                  HAS_TREE: tl.constexpr):
    """One tile of keys k [N, D] (positions offs_n, n_ok the real ones) against the rows' queries q [M, D]:
    the masked scores' online-softmax step. Returns (p [M, N], alpha [M], new m_i, new l_i)."""
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [M, N], log2 units
    if HAS_TREE:
        j = offs_n - prefix  # index among the new tokens
        new = (j >= 0) & n_ok
        tree = tl.load(Tree + tok[:, None] * stride_tree + j[None, :], mask=row_ok[:, None] & new[None, :], other=0)
        visible = ((offs_n < prefix) & n_ok)[None, :] | (tree != 0)
    else:
        visible = (offs_n[None, :] <= (prefix + qi)[:, None]) & (offs_n[None, :] > (prefix + qi - window)[:, None]) \
            & n_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


# Launch-shape ints that follow the batch (tiles per sequence, KV splits) are not specialized on: Triton compiles a
# variant per value class (== 1, divisible by 16) of every int argument, and a class first met mid-serving (a ragged
# step's tile count, a batch size's split count) compiled there: 0.2-0.5 s stalls in the H200's Poisson runs (run 49)
@triton.jit(do_not_specialize=["window", "num_heads", "num_q_tiles", "num_splits"])
def _paged_attention_kernel(
    Q, K, V, O,  # Q [T, Hq, D], K/V [num_blocks, PAGE, Hkv, D], O [T, Hq, D]
    PartAcc, PartM, PartL,  # [T, Hq, S, D] f32, [T, Hq, S] f32, [T, Hq, S] f32 (used when SPLIT)
    QStart, SeqLens, BlockTables, Tree,  # [B+1] i64, [B] i64, [B, W] i64, [T, Tw] u8
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window: keys at positions > query position - window (full attention: 2**30)
    num_heads, num_q_tiles, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    stride_bt, stride_tree,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    HAS_TREE: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr, PRELOAD: tl.constexpr,
):
    # PDL: the next kernel (the merge, or the o-projection) may launch now (forerun/kernels/pdl.py). WAIT: launched
    # early itself; the metadata (written before the forward) and the keys / values cached before this step can be
    # read before the wait, the queries and this step's new keys (written by the kernel before) only after it.
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = pid // num_q_tiles
    q_lo = (pid % num_q_tiles) * BLOCK_Q
    q_start = tl.load(QStart + seq)
    q_len = tl.load(QStart + seq + 1) - q_start
    if q_lo >= q_len:  # (before any wait: every grid has a program with q_lo = 0 that waits, so this kernel's end
        return         # still implies its predecessor's)
    seq_len = tl.load(SeqLens + seq)
    prefix = seq_len - q_len

    # rows: (query token qi, head hh of the group), token-major
    offs_m = tl.arange(0, BLOCK_M)
    qi = q_lo + offs_m // GROUP_PAD
    hh = offs_m % GROUP_PAD
    row_ok = (offs_m < BLOCK_Q * GROUP_PAD) & (qi < q_len) & (hh < GROUP)
    head = kvh * GROUP + hh
    tok = q_start + qi  # global query row
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM

    # keys this tile can see: everything up to its last query (causal); the whole sequence with a tree
    if HAS_TREE:
        kv_end = seq_len
    else:
        kv_end = tl.minimum(seq_len, prefix + tl.minimum(q_len, q_lo + BLOCK_Q))
    # sliding window: the tile's first query (position prefix + q_lo) sees nothing before prefix + q_lo - window + 1
    kv_start = tl.maximum(prefix + q_lo - window + 1, 0)
    t_first = kv_start // BLOCK_N
    n_tiles = tl.cdiv(kv_end, BLOCK_N)
    per_split = tl.cdiv(n_tiles - t_first, num_splits)
    t_lo = t_first + split * per_split
    t_hi = tl.minimum(t_lo + per_split, n_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    t_loop = t_lo
    if PRELOAD:  # the split's first tile: its keys cached before this step are fetched before the wait
        pre = (t_lo < t_hi).to(tl.int32)
        offs_n0 = t_lo * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok0 = offs_n0 < kv_end * pre  # (none when the split has no tile)
        old0 = n_ok0 & (offs_n0 < prefix)
        kp0, vp0 = _kv_tile_ptrs(K, V, BlockTables, seq, stride_bt, offs_n0, n_ok0, kvh, offs_d,
                                 stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, PAGE)
        k0 = tl.load(kp0, mask=old0[:, None] & d_ok[None, :], other=0.0)  # [N, D]
        v0 = tl.load(vp0, mask=old0[:, None] & d_ok[None, :], other=0.0)
    if WAIT:
        gdc_wait()
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    if PRELOAD:  # its keys of this step (written by the kernel before), then the tile as the loop would take it
        new0 = (n_ok0 & (offs_n0 >= prefix))[:, None] & d_ok[None, :]
        k0 = tl.where(new0, tl.load(kp0, mask=new0, other=0.0), k0)
        v0 = tl.where(new0, tl.load(vp0, mask=new0, other=0.0), v0)
        p, alpha, m_i, l_i = _softmax_tile(q, k0, offs_n0, n_ok0, prefix, qi, tok, row_ok, window, Tree,
                                           stride_tree, qk_scale, m_i, l_i, HAS_TREE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v0.dtype), v0)
        t_loop = t_lo + pre
    for t in range(t_loop, t_hi):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        kp, vp = _kv_tile_ptrs(K, V, BlockTables, seq, stride_bt, offs_n, n_ok, kvh, offs_d,
                               stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, PAGE)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(kp, mask=kv_mask, other=0.0)  # [N, D]
        p, alpha, m_i, l_i = _softmax_tile(q, k, offs_n, n_ok, prefix, qi, tok, row_ok, window, Tree, stride_tree,
                                           qk_scale, m_i, l_i, HAS_TREE)
        v = tl.load(vp, mask=kv_mask, other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)

    if SPLIT:
        part = (tok * num_heads + head) * num_splits + split  # [M]
        tl.store(PartM + part, m_i, mask=row_ok)
        tl.store(PartL + part, l_i, mask=row_ok)
        tl.store(PartAcc + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(O + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def _merge_splits_kernel(
    O, PartAcc, PartM, PartL,  # O [T, Hq, D]; partials as above
    num_heads, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
    if WAIT:  # launched early: the partials are the split kernel's
        gdc_wait()
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    part = (row * num_heads + head) * num_splits + offs_s  # [S]
    m = tl.load(PartM + part, mask=s_ok, other=float("-inf"))
    l = tl.load(PartL + part, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # [S]
    acc = tl.load(PartAcc + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(O + row * stride_ot + head * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_ok)


class TritonPagedAttention(AttentionBackend):
    """Paged attention for CUDA tensors; other devices use the reference (unless TRITON_INTERPRET=1)."""

    supports_cuda_graphs = True  # launch shapes never depend on host-side sequence lengths

    def __init__(self, block_n: int = 64, max_splits: int = 16, num_warps: int = 4, num_stages: int = 2,
                 num_splits: int | None = None, cuda_decode: bool = False) -> None:
        """cuda_decode: pure decode steps (one new token per sequence, no tree, no window) run the one-launch CUDA
        kernel of attention/cuda_decode.py where it compiles. Off by default: on the H200 it is correct but measured
        slower than these kernels (12 us a layer against 7.4 at 512 tokens, inside int4 products; docs/performance.md)."""
        self.block_n, self.max_splits = block_n, max_splits
        self.num_warps, self.num_stages = num_warps, num_stages
        self.num_splits = num_splits  # fixed split count (tests); None = chosen from the grid size
        self.cuda_decode = cuda_decode
        # layer ops may run a decode step's attention together with the RoPE before it as one kernel instead of
        # calling forward (FusedLayerOps.decode_attention, attention/fused_decode.py); not with fixed splits or the
        # CUDA decode experiment, which ask for these kernels' own shape
        self.fuses_decode = num_splits is None and not cuda_decode

    def _splits(self, programs: int, device: torch.device) -> int:
        return self.num_splits if self.num_splits is not None else kv_splits(programs, device, self.max_splits)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttnMetadata,
        scale: float,
        window: int | None = None,  # sliding window; tree masks with a window are refused (positions unknown here)
    ) -> torch.Tensor:  # [T, Hq, D]
        if window is not None and meta.tree_mask is not None:
            raise ValueError("tree drafting is not supported with a sliding-window model on the Triton backend")
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            return paged_attention_reference(q, k_cache, v_cache, meta, scale, window)
        if self.cuda_decode and q.is_cuda and cuda_decode.supports(q, k_cache, meta, window):
            return cuda_decode.decode_attention(q, k_cache, v_cache, meta, scale,
                                                self._splits(q.shape[0] * k_cache.shape[2], q.device))
        num_tokens, num_heads, head_dim = q.shape
        page, num_kv = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv
        if q.stride(2) != 1:
            q = q.contiguous()
        assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "KV cache rows must be contiguous"

        group_pad = triton.next_power_of_2(group)
        block_q = max(1, min(triton.next_power_of_2(max(meta.max_query_len, 1)), 16, 128 // group_pad))
        block_m = max(16, block_q * group_pad)
        q_tiles = triton.cdiv(max(meta.max_query_len, 1), block_q)
        num_seqs = meta.num_seqs
        splits = self._splits(num_seqs * num_kv * q_tiles, q.device)
        d_pad = triton.next_power_of_2(head_dim)

        out = torch.empty_like(q)
        if splits > 1:
            part_acc = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
            part_m = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
            part_l = torch.empty_like(part_m)
        else:
            part_acc = part_m = part_l = out  # unused
        tree = meta.tree_mask
        tree_arg = tree.view(torch.uint8) if tree is not None else meta.slot_mapping  # dummy when no tree
        tables = meta.block_tables
        grid = (num_seqs * q_tiles, num_kv, splits)
        wait = attention_waits(q, num_tokens)  # launched early, waiting on Q/K norm + RoPE (kernels/pdl.py)
        trigger = pdl_enabled(q) and (splits == 1 or wait)  # lets the merge (or the o-projection) launch early
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, part_acc, part_m, part_l,
            meta.query_start_loc, meta.seq_lens, tables, tree_arg,
            scale * _LOG2E, window or _NO_WINDOW, num_heads, q_tiles, splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            tables.stride(0), tree.stride(0) if tree is not None else 0,
            GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=self.block_n,
            PAGE=page, HEAD_DIM=head_dim, D_PAD=d_pad, HAS_TREE=tree is not None, SPLIT=splits > 1,
            PDL=trigger, WAIT=wait, PRELOAD=wait or TESTS_FORCE_PRELOAD[0], num_warps=self.num_warps,
            num_stages=self.num_stages, **launch_kwargs(wait),
        )
        if splits > 1:
            _merge_splits_kernel[(num_tokens, num_heads)](
                out, part_acc, part_m, part_l, num_heads, splits, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, D_PAD=d_pad, S_PAD=triton.next_power_of_2(splits), PDL=pdl_enabled(q), WAIT=wait,
                num_warps=4, **launch_kwargs(wait),
            )
        return out
