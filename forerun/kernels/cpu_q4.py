"""CPU int4 x int8 GEMM (AVX512-VNNI, or AVX2), built from cpu_q4.c with the system C compiler on first use.

Why: CPU decode is bound by the bytes of weights streamed per token. torch has no fast x86 kernel for 4-bit
weights (``_weight_int4pack_mm_for_cpu`` is compute-bound, see docs/quantization.md). This kernel streams GGUF Q4
weights as they are (codes + fp16 group scale and offset: 5 bits per weight) with llama.cpp's recipe:
activations quantized per 32 values to int8, integer dot products (VNNI), float scales per group. It reads 4
output rows per pass from one stream, sums a group's whole dot product in one int32 lane, quantizes the
activations in C and splits the rows over torch's OpenMP threads: ~memory speed at 1-4 rows (measured in
docs/quantization.md). Every output's operations are the same whatever the number of rows and the thread split,
so a row's result is bit-identical alone or in a verify batch (tests/test_batch_invariance.py).

Two builds (forerun/kernels/cbuild.py): AVX512-VNNI/BW, and AVX2 + FMA + F16C for CPUs without it (AMD Zen 1-3;
the same integer dot products with maddubs + madd, docs/quantization.md). `available()` is False (and the int8
layout is used instead) without gcc or either instruction set.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import torch

from .cbuild import lazy_library


def _declare(lib) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.q4_gemm.argtypes = [p, i64, i64, p, p, p, i64, p, ctypes.c_int]
    lib.q4_gemm.restype = None
    lib.q4_quant_act.argtypes = [p, i64, i64, p, p, p]
    lib.q4_quant_act.restype = None
    lib.q4_group_bytes.argtypes = [i64]
    lib.q4_group_bytes.restype = i64
    lib.q4_row_block.argtypes = [i64]  # activation rows per pass over the weights (products of many rows)
    lib.q4_row_block.restype = i64
    lib.q4_row_block_bytes.argtypes = [i64]
    lib.q4_row_block_bytes.restype = i64
    lib.q8_gemm.argtypes = [p, i64, i64, p, p, i64, p, ctypes.c_int]
    lib.q8_gemm.restype = None
    lib.q8_group_bytes.argtypes = [i64]
    lib.q8_group_bytes.restype = i64
    lib.q6k_gemm.argtypes = [p, i64, i64, p, p, p, i64, p, ctypes.c_int]
    lib.q6k_gemm.restype = None
    if hasattr(lib, "q4_amx_ready"):  # the avx512amx build (cbuild.ISAS)
        lib.q4_amx_ready.argtypes = []
        lib.q4_amx_ready.restype = ctypes.c_int
        lib.q4_amx_min_rows.argtypes = [ctypes.c_int]
        lib.q4_amx_min_rows.restype = ctypes.c_int
        lib.q4_amx_calls.argtypes = []
        lib.q4_amx_calls.restype = ctypes.c_int64
        rows = os.environ.get("FORERUN_AMX_MIN_ROWS")
        if rows is not None:  # 0: never use the tiles (A/B runs); the same bits either way
            if not rows.isdigit():
                raise ValueError(f"FORERUN_AMX_MIN_ROWS must be a row count (0: never), got {rows!r}")
            lib.q4_amx_min_rows(int(rows))


_load = lazy_library(Path(__file__).with_name("cpu_q4.c"), [], _declare)


def available() -> bool:
    return _load() is not None


def amx_ready(lib=None) -> bool:
    """True where q4_gemm can hand many-row products to its AMX path: the avx512amx build, and a kernel that grants
    this process the tile registers (Linux >= 5.16)."""
    lib = lib or _load()
    return lib is not None and hasattr(lib, "q4_amx_ready") and bool(lib.q4_amx_ready())


def amx_min_rows(rows: int | None = None, lib=None) -> int:
    """The activation rows from which q4_gemm uses AMX (0: never; the same bits either way, so this only moves
    time). Sets it when `rows` is given; returns the value in force (0 where the build has no AMX path)."""
    lib = lib or _load()
    if lib is None or not hasattr(lib, "q4_amx_min_rows"):
        return 0
    return int(lib.q4_amx_min_rows(-1 if rows is None else int(rows)))


ROWS = 4  # output rows per row group


def _chunks(k: int) -> int:
    return (k // 32 + 15) // 16


def group_bytes(k: int) -> int:
    """Bytes of one row group (4 output rows) of a [N, K] matrix: per chunk of <= 16 groups of 32 weights a
    256-byte header (fp16 scales and offsets of 4 rows x 16 groups), and 16 bytes per group and row."""
    return _chunks(k) * 256 + (k // 32) * 64


def pack_weights(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """q [N, K] codes 0..15 (K % 32 == 0), scale / offset [N, K/32] -> packed [ceil(N/4), group_bytes(K)] uint8 in
    the kernel's layout (cpu_q4.c): row groups of 4 rows (N padded with zero rows); per chunk of <= 16 groups a
    header of fp16 scales and offsets [2][4 rows][16 groups], then per row [4 loads j][ng groups l][4 bytes t]
    with weight 8 j + t of group l in the low nibble and 8 j + 4 + t in the high one."""
    n, k = q.shape
    groups, chunks = k // 32, _chunks(k)
    ng4 = -(-n // ROWS)
    np_ = ng4 * ROWS
    c = torch.zeros(np_, chunks * 16, 4, 2, 4, dtype=torch.uint8)  # [row, group, j, nibble, t]
    c[:n, :groups] = q.to(torch.uint8).view(n, groups, 4, 2, 4)
    codes = (c[..., 0, :] | (c[..., 1, :] << 4))  # [row, group, j, t]
    codes = codes.view(ng4, ROWS, chunks, 16, 4, 4).permute(0, 2, 1, 4, 3, 5)  # [G, chunk, row, j, l, t]
    hdr = torch.zeros(np_, 2, chunks * 16, dtype=torch.float16)
    hdr[:n, 0, :groups] = scale.to(torch.float16)
    hdr[:n, 1, :groups] = offset.to(torch.float16)
    hdr = hdr.view(ng4, ROWS, 2, chunks, 16).permute(0, 3, 2, 1, 4).contiguous()  # [G, chunk, 2, 4, 16]
    hdr = hdr.view(torch.uint8).view(ng4, chunks, 256)
    out = torch.empty(ng4, group_bytes(k), dtype=torch.uint8)
    pos = 0
    for ci in range(chunks):
        ng = min(16, groups - 16 * ci)
        out[:, pos:pos + 256] = hdr[:, ci]
        out[:, pos + 256:pos + 256 + 64 * ng] = codes[:, ci, :, :, :ng].reshape(ng4, 64 * ng)
        pos += 256 + 64 * ng
    return out


def unpack_weights(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of pack_weights: (q [N, K] uint8, scale [N, K/32] fp16, offset [N, K/32] fp16) (tests)."""
    groups, chunks = k // 32, _chunks(k)
    ng4 = packed.shape[0]
    qs, scales, offsets, pos = [], [], [], 0
    for ci in range(chunks):
        ng = min(16, groups - 16 * ci)
        h = packed[:, pos:pos + 256].contiguous().view(torch.float16).view(ng4, 2, ROWS, 16)[..., :ng]
        scales.append(h[:, 0].reshape(ng4 * ROWS, ng))
        offsets.append(h[:, 1].reshape(ng4 * ROWS, ng))
        b = packed[:, pos + 256:pos + 256 + 64 * ng].reshape(ng4, ROWS, 4, ng, 1, 4)  # [G, row, j, l, nib, t]
        b = torch.cat([b & 0x0F, b >> 4], dim=4).permute(0, 1, 3, 2, 4, 5)  # [G, row, l, j, nib, t]
        qs.append(b.reshape(ng4 * ROWS, ng * 32))
        pos += 256 + 64 * ng
    return torch.cat(qs, 1)[:n], torch.cat(scales, 1)[:n], torch.cat(offsets, 1)[:n]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference (torch) of the C activation quantization: x [M, K] float -> (xq [M, chunks * 512] int8 in the
    kernel's order, xs [M, chunks * 16] float32, isum [M, chunks * 16] float32, zero padded): symmetric int8 with
    one scale per 32 values (as llama.cpp's Q8 activations); a value's code depends on its own group only
    (batch-invariant); isum = scale * the sum of the group's codes."""
    m, k = x.shape
    groups, chunks = k // 32, _chunks(k)
    g = x.float().view(m, groups, 32)
    s = g.abs().amax(-1).clamp_min_(1e-30).div_(127.0)  # [M, G]
    q = torch.round(g / s[..., None]).to(torch.int8)  # [M, G, 32]
    xs, isum = torch.zeros(m, chunks * 16), torch.zeros(m, chunks * 16)
    xs[:, :groups] = s
    isum[:, :groups] = q.sum(-1, dtype=torch.int32).float().mul_(s)  # exact integer sum, one rounding
    xq = torch.zeros(m, chunks * 16, 32, dtype=torch.int8)
    xq[:, :groups] = q
    xq = xq.view(m, chunks, 16, 8, 4).transpose(2, 3).reshape(m, chunks * 512)  # [chunk, piece p, group l, 4]
    return xq, xs, isum


def act_scratch(k: int) -> tuple[int, int]:
    """Per activation row of K values: (int8 codes, floats in each of xs / isum) that q4_quant_act writes."""
    return _chunks(k) * 512, _chunks(k) * 16


def quantize_activations_c(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_activations in C (one call instead of ~10 torch ops per linear; bit-identical, tested)."""
    lib = _load()
    x = x.float().contiguous()
    m, k = x.shape
    nb, nf = act_scratch(k)
    xq = torch.empty(m, nb, dtype=torch.int8)
    xs = torch.empty(m, nf)
    isum = torch.empty(m, nf)
    lib.q4_quant_act(x.data_ptr(), m, k, xq.data_ptr(), xs.data_ptr(), isum.data_ptr())
    return xq, xs, isum


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, n: int, threads: int | None = None) -> torch.Tensor:
    """x [M, K] float -> [M, N] float32 = x W^T with W = codes * scale + offset per 32 (packed by pack_weights),
    x as int8 per 32. The output rows are split over `threads` (default torch's; OpenMP, in the C kernel)."""
    lib = _load()
    m, k = x.shape
    xq, xs, isum = quantize_activations_c(x)
    y = torch.empty(m, n, dtype=torch.float32)
    lib.q4_gemm(packed.data_ptr(), n, k, xq.data_ptr(), xs.data_ptr(), isum.data_ptr(), m, y.data_ptr(),
                threads or torch.get_num_threads())
    return y


# ---------------------------------------------------------------- int8 weights per 32 (Q8Linear's layout)


def q8_group_bytes(k: int) -> int:
    """Bytes of one row group (4 output rows) of the int8 layout: per chunk of <= 16 groups a 128-byte header of
    fp16 scales [4 rows][16 groups], then 4 x 32 code bytes per group: 8.5 bits a weight."""
    return _chunks(k) * 128 + (k // 32) * 128


def pack_q8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8 (K % 32 == 0), scale [N, K/32] (fp16-representable) -> packed [ceil(N/4), q8_group_bytes(K)]
    uint8 (cpu_q4.c): row groups of 4 rows (N padded with zero rows); per chunk of ng <= 16 groups the fp16 scales
    [4 rows][16 groups] (zero past ng), then per row, per half h (groups 8 h ..), per piece p, per group l of the
    half: weights 4 p .. 4 p + 3 of group 8 h + l."""
    n, k = q.shape
    groups, chunks = k // 32, _chunks(k)
    n4 = (n + ROWS - 1) // ROWS * ROWS
    codes = torch.zeros(n4, groups, 32, dtype=torch.int8)
    codes[:n] = q.view(n, groups, 32)
    sc = torch.zeros(n4, chunks * 16, dtype=torch.float16)
    sc[:n, :groups] = scale.half()
    sc = sc.view(n4 // ROWS, ROWS, chunks, 16)
    parts = []
    for c in range(chunks):
        parts.append(sc[:, :, c].contiguous().view(torch.uint8).view(n4 // ROWS, 128))
        ng = min(16, groups - 16 * c)
        rows = []
        for h in range(0, ng, 8):
            ngh = min(8, ng - h)
            blk = codes[:, 16 * c + h:16 * c + h + ngh].view(n4 // ROWS, ROWS, ngh, 8, 4).transpose(2, 3)  # [G,r,p,l,t]
            rows.append(blk.reshape(n4 // ROWS, ROWS, 32 * ngh))
        parts.append(torch.cat(rows, 2).view(torch.uint8).reshape(n4 // ROWS, ROWS * 32 * ng))
    return torch.cat(parts, 1).contiguous()


def unpack_q8(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_q8's inverse: (q [N, K] int8, scale [N, K/32] fp16)."""
    groups, chunks = k // 32, _chunks(k)
    g4 = packed.shape[0]
    q, sc, pos = torch.empty(g4, ROWS, groups, 32, dtype=torch.int8), [], 0
    for c in range(chunks):
        sc.append(packed[:, pos:pos + 128].contiguous().view(torch.float16).view(g4, ROWS, 16))
        ng = min(16, groups - 16 * c)
        body = packed[:, pos + 128:pos + 128 + 128 * ng].contiguous().view(torch.int8).view(g4, ROWS, 32 * ng)
        off = 0
        for h in range(0, ng, 8):
            ngh = min(8, ng - h)
            blk = body[:, :, off:off + 32 * ngh].view(g4, ROWS, 8, ngh, 4).transpose(2, 3)  # [G, r, l, p, t]
            q[:, :, 16 * c + h:16 * c + h + ngh] = blk.reshape(g4, ROWS, ngh, 32)
            off += 32 * ngh
        pos += 128 + 128 * ng
    scale = torch.cat(sc, 2).view(g4 * ROWS, chunks * 16)[:n, :groups]
    return q.view(g4 * ROWS, k)[:n], scale


def q8_matmul(x: torch.Tensor, packed: torch.Tensor, n: int, threads: int | None = None) -> torch.Tensor:
    """x [M, K] float -> [M, N] float32 = x W^T with W = q * scale per 32 (packed by pack_q8), x as int8 per 32
    (the int4 product's activations)."""
    lib = _load()
    m, k = x.shape
    xq, xs, _ = quantize_activations_c(x)
    y = torch.empty(m, n, dtype=torch.float32)
    lib.q8_gemm(packed.data_ptr(), n, k, xq.data_ptr(), xs.data_ptr(), m, y.data_ptr(),
                threads or torch.get_num_threads())
    return y


# ---------------------------------------------------------------- GGUF Q6_K, re-laid out (Q6KLinear)

Q6K_BLOCK = 210  # bytes per 256 weights: ql[128], qh[64], int8 scales[16], fp16 d (the kernel's layout: the same size)


def q6k_codes(blocks: np.ndarray) -> np.ndarray:
    """GGUF Q6_K blocks [N, nb * 210] -> 6-bit codes [N, nb * 256] uint8 0..63 in weight order (gguf's dequantization
    order: per half of a block, sets j of 32 from ql / qh as in cpu_q4.c)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, Q6K_BLOCK)
    ql, qh = b[..., :128].reshape(n, -1, 2, 2, 32), b[..., 128:192].reshape(n, -1, 2, 1, 32)  # [n, nb, half, 2, 32]
    lo = np.concatenate([ql & 15, ql >> 4], axis=3)  # [n, nb, half, set 0..3, 32]: sets 0, 1 low, 2, 3 high nibbles
    hi = np.concatenate([(qh >> (2 * j)) & 3 for j in range(4)], axis=3)
    return (lo | (hi << 4)).reshape(n, -1)


def pack_q6k(blocks: np.ndarray, rows: int = 8192) -> np.ndarray:
    """GGUF Q6_K blocks [N, nb * 210] -> the kernel's layout (cpu_q4.c; the same 210 bytes a block, exact): per block,
    lo [4 k][8 groups][4 t] = code of weight 4 k + t of the group | code of weight 4 (k + 4) + t << 4 (low nibbles),
    hi [2 m][8 groups][4 t] = sum over s of (code of weight 4 (4 m + s) + t >> 4) << 2 s, then the 16 scales and d as
    stored. Done `rows` rows at a time (no full-size temporaries for a 150k-row head; quant.ROW_CHUNK)."""
    n, width = blocks.shape
    out = np.empty((n, width), dtype=np.uint8)
    for i in range(0, n, rows):
        q = q6k_codes(blocks[i:i + rows])
        r = q.shape[0]
        q = q.reshape(r, -1, 8, 8, 4)  # [r, nb, group, piece, t]
        lo = (q[:, :, :, :4] & 15) | ((q[:, :, :, 4:] & 15) << 4)  # [r, nb, group, k, t]
        h = (q >> 4).reshape(r, -1, 8, 2, 4, 4)  # [r, nb, group, m, s, t]
        hi = h[:, :, :, :, 0] | (h[:, :, :, :, 1] << 2) | (h[:, :, :, :, 2] << 4) | (h[:, :, :, :, 3] << 6)
        src = blocks[i:i + rows].reshape(r, -1, Q6K_BLOCK)
        dst = out[i:i + rows].reshape(r, -1, Q6K_BLOCK)
        dst[..., :128] = lo.transpose(0, 1, 3, 2, 4).reshape(r, -1, 128)
        dst[..., 128:192] = hi.transpose(0, 1, 3, 2, 4).reshape(r, -1, 64)
        dst[..., 192:] = src[..., 192:]
    return out


def unpack_q6k(packed: np.ndarray) -> np.ndarray:
    """pack_q6k's inverse: GGUF Q6_K blocks."""
    n = packed.shape[0]
    p = packed.reshape(n, -1, Q6K_BLOCK)
    lo = p[..., :128].reshape(n, -1, 4, 8, 4).transpose(0, 1, 3, 2, 4)  # [n, nb, group, k, t]
    hi = p[..., 128:192].reshape(n, -1, 2, 8, 4).transpose(0, 1, 3, 2, 4)  # [n, nb, group, m, t]
    hs = np.stack([(hi >> (2 * s)) & 3 for s in range(4)], axis=4)  # [n, nb, group, m, s, t]
    q = np.concatenate([lo & 15, lo >> 4], axis=3) | (hs.reshape(n, -1, 8, 8, 4) << 4)  # [n, nb, group, piece, t]
    q = q.reshape(n, -1, 2, 4, 32)  # [n, nb, half, set, 32]: weight 128 half + 32 set + l
    qh = (q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4) | ((q[:, :, :, 3] >> 4) << 6)
    out = p.copy()
    out[..., :128] = np.concatenate([(q[:, :, :, 0] & 15) | ((q[:, :, :, 2] & 15) << 4),
                                     (q[:, :, :, 1] & 15) | ((q[:, :, :, 3] & 15) << 4)], axis=3).reshape(n, -1, 128)
    out[..., 128:192] = qh.reshape(n, -1, 64)
    return out.reshape(packed.shape)


def q6k_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float -> what q6k_gemm reads: the int4 product's activation codes and scales (per 32 values) and
    the sums of each 16 codes, bsum [M, chunks, 16, 2] int16."""
    m, k = x.shape
    xq, xs, _ = quantize_activations_c(x)
    pieces = xq.view(m, _chunks(k), 8, 16, 4).to(torch.int16)
    bsum = torch.stack([pieces[:, :, :4].sum((2, 4)), pieces[:, :, 4:].sum((2, 4))], -1).to(torch.int16).contiguous()
    return xq, xs, bsum


def q6k_matmul(x: torch.Tensor, packed: np.ndarray, n: int, threads: int | None = None) -> torch.Tensor:
    """x [M, K] float -> [M, N] float32 = x W^T with W [N, K] packed by pack_q6k (C-contiguous numpy uint8), x
    quantized as the int4 product's (per 32 values) plus the sums of each 16 codes: cpu_q4.c's q6k_gemm."""
    lib = _load()
    m, k = x.shape
    xq, xs, bsum = q6k_activations(x)
    y = torch.empty(m, n, dtype=torch.float32)
    lib.q6k_gemm(packed.ctypes.data, n, k, xq.data_ptr(), xs.data_ptr(), bsum.data_ptr(), m, y.data_ptr(),
                 threads or torch.get_num_threads())
    return y
