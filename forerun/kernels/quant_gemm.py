"""Weight-only quantized skinny matrix products y = x @ W^T for decode and verification (x has 1..16 rows),
in Triton: 4-bit (group-wise asymmetric, the GGUF Q4_K / Q4_1 layout) and 8-bit (group-wise symmetric, the
GGUF Q8_0 layout) weights, bf16/fp16 activations, float32 accumulation.

Why: decode at batch 1 streams every weight once, so 4-bit weights cut the bytes of a step ~3.2x against
bf16. PyTorch's own kernels do not stream them fast on the H200 (issue 12: `_weight_int4pack_mm` reads its
bytes at 37 % of copy bandwidth for 1 row and 10 % for 16). Same structure as skinny_gemm.py: one program
owns BLOCK_N rows of W and walks K in BLOCK_K steps, every weight byte read exactly once.

Layouts (built by `pack_int4` / `pack_int8` from integer codes and group scales):
  * int4: ``qw`` uint8 [N, K / 2]. Within each PACK-wide chunk of K (PACK = 2 * HALF), byte j holds code
    j in its low nibble and code j + HALF in its high nibble (GGUF Q4_K packs 64-weight chunks the same way),
    so a tile unpacks with one mask and one shift, no interleaving. ``scale``, ``zero`` [N, K / 32]
    (fp16/bf16): w = q * scale + zero, q in 0..15.
  * int8: ``qw`` int8 [N, K]; ``scale`` [N, K / 32]: w = q * scale.
  * int4 word layout (what `CudaQ4Linear` holds; see the section below): ``qw32`` int32 [N, K / 8].
  * int8 word layout (what `CudaQ8Linear` holds; last section): ``qw8`` int32 [N, K / 4], bytes q + 128.

The kernels, in the order they were written (each section says why the next one exists); the engine uses the
word layout's, picked per row count and shape from kernels/q4_configs.json by models/quant_cuda.py:
  * `q4_linear` / `q8_linear`: chunk layout, float32 unpacking by integer-to-float conversion;
  * `q4w_linear`, `q4w2_linear`: word layout, float32 "magic number" unpacking;
  * `q4v_linear` (1-2 rows, decode): inline PTX, two codes per instruction in packed f16, weights prefetched
    before the programmatic-dependent-launch wait (kernels/pdl.py);
  * `q4r_linear` (3-8 rows, short verification): the same PTX, one unpacking per 4 rows;
  * `q4t_linear` (<= 16 rows): bf16 dequantization in PTX, tensor-core products;
  * `q8v_linear` (1-8 rows): 8-bit word layout (``qw8`` int32 [N, K / 4], codes biased by +128), the same PTX
    scheme (what `CudaQ8Linear` uses); it and `q4r_linear` share one kernel, `_rows_kernel`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import enabled as pdl_enabled, gdc_launch_dependents, gdc_wait, launch_kwargs

GROUP = 32
PACK = 256  # int4 chunk: low nibbles hold the first 128 codes, high nibbles the next 128
MAX_ROWS = 16


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] integer codes 0..15 (K a multiple of PACK) -> [N, K / 2] uint8 in the chunked layout."""
    n, k = q.shape
    if k % PACK:
        raise ValueError(f"pack_int4 needs K divisible by {PACK}, got {k}")
    c = q.to(torch.uint8).reshape(n, k // PACK, 2, PACK // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(qw: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: [N, K / 2] uint8 -> [N, K] uint8 codes."""
    n, h = qw.shape
    c = qw.reshape(n, h * 2 // PACK, 1, PACK // 2)
    return torch.cat([c & 15, c >> 4], dim=2).reshape(n, h * 2)


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (packed [N, K/2] uint8, scale [N, K/32], zero [N, K/32]) in w's dtype (min/max per group)."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).reshape(n, k)
    return pack_int4(q), scale.to(w.dtype), lo.to(w.dtype)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (q [N, K] int8, scale [N, K/32]) symmetric per group (GGUF Q8_0)."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    scale = (g.abs().amax(-1) / 127).clamp_min(1e-8)
    q = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return q, scale.to(w.dtype)


def dequantize_int4(qw, scale, zero) -> torch.Tensor:  # [N, K] float32 reference
    q = unpack_int4(qw).float()
    n, k = q.shape
    return (q.reshape(n, k // GROUP, GROUP) * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


def dequantize_int8(q, scale) -> torch.Tensor:  # [N, K] float32 reference
    n, k = q.shape
    return (q.float().reshape(n, k // GROUP, GROUP) * scale.float()[..., None]).reshape(n, k)


@triton.jit
def _q4_kernel(X, QW, S, Z, Y, M, N, stride_xm, stride_ym,
               K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
               HALF: tl.constexpr, GROUP: tl.constexpr):
    # one program: BLOCK_N output features, all of K in PACK-wide chunks (HALF bytes per row per chunk)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_h = tl.arange(0, HALF)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    NG: tl.constexpr = HALF // GROUP  # groups per half chunk
    offs_g = tl.arange(0, NG)
    q_ptr = QW + offs_n[:, None].to(tl.int64) * (K // 2) + offs_h[None, :]  # [BN, HALF]
    s_ptr = S + offs_n[:, None].to(tl.int64) * (K // GROUP) + offs_g[None, :]  # [BN, NG]
    z_ptr = Z + offs_n[:, None].to(tl.int64) * (K // GROUP) + offs_g[None, :]
    x_ptr = X + offs_m[:, None] * stride_xm + offs_h[None, :]  # [BM, HALF]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, HALF], tl.float32)
    for k0 in range(0, K, 2 * HALF):
        b = tl.load(q_ptr, mask=n_ok[:, None], other=0)
        s_lo = tl.load(s_ptr, mask=n_ok[:, None], other=0.0).to(tl.float32)
        z_lo = tl.load(z_ptr, mask=n_ok[:, None], other=0.0).to(tl.float32)
        s_hi = tl.load(s_ptr + NG, mask=n_ok[:, None], other=0.0).to(tl.float32)
        z_hi = tl.load(z_ptr + NG, mask=n_ok[:, None], other=0.0).to(tl.float32)
        lo = tl.reshape((b & 15).to(tl.float32), [BLOCK_N, NG, GROUP])
        hi = tl.reshape((b >> 4).to(tl.float32), [BLOCK_N, NG, GROUP])
        w_lo = tl.reshape(lo * s_lo[:, :, None] + z_lo[:, :, None], [BLOCK_N, HALF])
        w_hi = tl.reshape(hi * s_hi[:, :, None] + z_hi[:, :, None], [BLOCK_N, HALF])
        x_lo = tl.load(x_ptr, mask=m_ok[:, None], other=0.0)
        x_hi = tl.load(x_ptr + HALF, mask=m_ok[:, None], other=0.0)
        if USE_DOT:
            acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)))
            acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)))
        else:
            acc += x_lo.to(tl.float32)[:, None, :] * w_lo[None, :, :]
            acc += x_hi.to(tl.float32)[:, None, :] * w_hi[None, :, :]
        q_ptr += HALF
        s_ptr += 2 * NG
        z_ptr += 2 * NG
        x_ptr += 2 * HALF
    y = acc if USE_DOT else tl.sum(acc, 2)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _q8_kernel(X, QW, S, Y, M, N, stride_xm, stride_ym,
               K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               USE_DOT: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    NG: tl.constexpr = BLOCK_K // GROUP
    offs_g = tl.arange(0, NG)
    q_ptr = QW + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    s_ptr = S + offs_n[:, None].to(tl.int64) * (K // GROUP) + offs_g[None, :]
    x_ptr = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        q = tl.load(q_ptr, mask=n_ok[:, None], other=0).to(tl.float32)
        s = tl.load(s_ptr, mask=n_ok[:, None], other=0.0).to(tl.float32)
        w = tl.reshape(tl.reshape(q, [BLOCK_N, NG, GROUP]) * s[:, :, None], [BLOCK_N, BLOCK_K])
        x = tl.load(x_ptr, mask=m_ok[:, None], other=0.0)
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        else:
            acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
        q_ptr += BLOCK_K
        s_ptr += NG
        x_ptr += BLOCK_K
    y = acc if USE_DOT else tl.sum(acc, 2)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def q4_linear(x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              block_n: int | None = None, use_dot: bool | None = None, num_warps: int = 4,
              num_stages: int = 3) -> torch.Tensor:
    """x: [M, K] (M <= 16) bf16/fp16; qw: [N, K/2] uint8 (pack_int4); scale, zero: [N, K/32] -> [M, N]."""
    m, k = x.shape
    n = qw.shape[0]
    if not 1 <= m <= MAX_ROWS or qw.shape[1] * 2 != k or k % PACK or x.stride(1) != 1:
        raise ValueError(f"q4_linear: bad shapes x {tuple(x.shape)} qw {tuple(qw.shape)}")
    use_dot = m > 2 if use_dot is None else use_dot
    block_n = block_n or (32 if use_dot else 8)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if use_dot else triton.next_power_of_2(m)
    _q4_kernel[(triton.cdiv(n, block_n),)](x, qw, scale, zero, y, m, n, x.stride(0), y.stride(0), K=k,
                                           BLOCK_M=block_m, BLOCK_N=block_n, USE_DOT=use_dot, HALF=PACK // 2,
                                           GROUP=GROUP, num_warps=num_warps, num_stages=num_stages)
    return y


def q8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_n: int | None = None,
              block_k: int = 256, use_dot: bool | None = None, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x: [M, K] bf16/fp16; q: [N, K] int8; scale: [N, K/32] -> [M, N]."""
    m, k = x.shape
    n = q.shape[0]
    if not 1 <= m <= MAX_ROWS or q.shape[1] != k or k % block_k or x.stride(1) != 1:
        raise ValueError(f"q8_linear: bad shapes x {tuple(x.shape)} q {tuple(q.shape)}")
    use_dot = m > 2 if use_dot is None else use_dot
    block_n = block_n or (32 if use_dot else 8)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if use_dot else triton.next_power_of_2(m)
    _q8_kernel[(triton.cdiv(n, block_n),)](x, q, scale, y, m, n, x.stride(0), y.stride(0), K=k, BLOCK_M=block_m,
                                           BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot, GROUP=GROUP,
                                           num_warps=num_warps, num_stages=num_stages)
    return y


# ======================================================================================= int4, word layout
# The kernels above unpack codes with integer-to-float conversions, which run at a quarter of the FP32 rate on
# Hopper: at batch 1 they, not memory, bound the product. The word layout below is unpacked with bit masks and
# one float subtraction (the "magic number" conversion): OR-ing a code q, sitting at bits 4j .. 4j+3 of a word,
# into the exponent of 2^23 gives the float 2^23 + q * 16^j exactly, and subtracting 2^23 leaves q * 16^j; the
# 16^-j goes into the group scale, so no shift is needed for the low half-word and one per word for the high.
#
# Layout ``qw32`` int32 [N, K / 8]: word i of a row holds codes 8i .. 8i + 7; code 8i + 2j sits at bits
# 4j .. 4j + 3, code 8i + 2j + 1 at bits 16 + 4j .. 19 + 4j (j = 0..3). Groups of 32 codes = 4 words; ``scale``
# and ``zero`` [N, K / 32] as above (w = q * scale + zero). The even codes of a tile multiply the even
# activations and the odd codes the odd ones: two dot products, no interleaving in registers.
MAGIC = 8388608.0  # 2^23


def pack_int4_w32(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] codes 0..15 (K a multiple of 32) -> [N, K / 8] int32 in the word layout."""
    n, k = q.shape
    if k % GROUP:
        raise ValueError(f"pack_int4_w32 needs K divisible by {GROUP}, got {k}")
    c = q.to(torch.int64).reshape(n, k // 8, 4, 2)
    shifts = 4 * torch.arange(4, device=q.device)
    word = ((c[..., 0] << shifts) | (c[..., 1] << (shifts + 16))).sum(-1)  # disjoint bits: sum == or
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)
    return word.to(torch.int32).contiguous()


def unpack_int4_w32(qw: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4_w32: [N, K / 8] int32 -> [N, K] uint8 codes."""
    n, w = qw.shape
    v = qw.to(torch.int64) & 0xFFFFFFFF
    shifts = 4 * torch.arange(4, device=qw.device)
    lo = (v[..., None] >> shifts) & 15
    hi = (v[..., None] >> (shifts + 16)) & 15
    return torch.stack([lo, hi], -1).reshape(n, w * 8).to(torch.uint8)


@triton.jit
def _q4w_dequant_kernel(QW, S, Z, Y, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP: tl.constexpr):
    # one program: BLOCK_N rows x BLOCK_K codes -> Y [N, K]; code c of a word is nibble c // 2 of its low (c even)
    # or high (c odd) half; w = code * scale + zero in float32, rounded once. Plain 2-D index math (each word is
    # read by its 8 codes' lanes, from L1): a [BN, BW, 8] reshape version ran at 8 % of bandwidth on the H200
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    rows = offs_n[:, None].to(tl.int64)
    w = tl.load(QW + rows * (K // 8) + (offs_k // 8)[None, :], mask=ok, other=0)
    c = offs_k % 8
    shift = ((c // 2) * 4 + (c % 2) * 16)[None, :]
    q = ((w >> shift) & 15).to(tl.float32)
    sp = rows * (K // GROUP) + (offs_k // GROUP)[None, :]
    s = tl.load(S + sp, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(Z + sp, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + rows * K + offs_k[None, :], (q * s + z).to(Y.dtype.element_ty), mask=ok)


def dequantize_int4_w32(qw32: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """The word layout's weights [N, K] (code * scale + zero, rounded once to dtype, default the scale's) in one
    memory-bound pass: products of more rows than the Triton kernels take (verification of long chains at a
    batch, prefill) multiply it with cuBLAS. Eight torch ops over [N, K / 8, 4] intermediates took ~170 ms per
    8B forward on the H200 where this reads 4.7 GB and writes 15 GB."""
    n, kw = qw32.shape
    k = kw * 8
    y = torch.empty(n, k, dtype=dtype or scale.dtype, device=qw32.device)
    bn, bk = 16, 256
    _q4w_dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](qw32, scale, zero, y, n, K=k, BLOCK_N=bn,
                                                                   BLOCK_K=bk, GROUP=GROUP)
    return y


def repack_int4_w32(qw: torch.Tensor) -> torch.Tensor:
    """The chunked layout (pack_int4) -> the word layout."""
    return pack_int4_w32(unpack_int4(qw))


@triton.jit
def _q4w_tile(QW, S, Z, offs_n, n_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """Dequantized weights of rows offs_n, codes k0 .. k0 + BLOCK_K: (even codes, odd codes), each
    [BLOCK_N, BLOCK_K / 2] float32 in the order of the activations k0 + 2 t (+ 1)."""
    BW: tl.constexpr = BLOCK_K // 8  # words
    NG: tl.constexpr = BLOCK_K // GROUP  # groups (4 words each)
    BN: tl.constexpr = offs_n.shape[0]
    offs_w = tl.arange(0, BW)
    w = tl.load(QW + offs_n[:, None].to(tl.int64) * (K // 8) + k0 // 8 + offs_w[None, :], mask=n_ok[:, None],
                other=0)  # [BN, BW] int32
    offs_g = tl.arange(0, NG)
    sp = offs_n[:, None].to(tl.int64) * (K // GROUP) + k0 // GROUP + offs_g[None, :]
    s = tl.load(S + sp, mask=n_ok[:, None], other=0.0).to(tl.float32)  # [BN, NG]
    z = tl.load(Z + sp, mask=n_ok[:, None], other=0.0).to(tl.float32)
    j = tl.arange(0, 4)
    mask = (15 << (4 * j)).to(tl.int32)  # nibble j of a half-word
    inv = tl.exp2(-4.0 * j.to(tl.float32))  # 16^-j
    sj = tl.reshape(s[:, :, None] * inv[None, None, :], [BN, NG, 1, 4])  # the scale of nibble j
    zb = tl.reshape(z, [BN, NG, 1, 1])
    lo = ((w[:, :, None] & mask[None, None, :]) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    hi = (((w >> 16)[:, :, None] & mask[None, None, :]) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    w_even = tl.reshape(tl.reshape(lo, [BN, NG, 4, 4]) * sj + zb, [BN, BLOCK_K // 2])
    w_odd = tl.reshape(tl.reshape(hi, [BN, NG, 4, 4]) * sj + zb, [BN, BLOCK_K // 2])
    return w_even, w_odd


@triton.jit
def _q4w_kernel(X, QW, S, Z, Y, M, N, stride_xm, stride_ym, GLU_OFF,
                K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                USE_DOT: tl.constexpr, GLU: tl.constexpr, GROUP: tl.constexpr):
    # one program: BLOCK_N output features (GLU: BLOCK_N gate rows n and the up rows GLU_OFF + n), all of K
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_t = tl.arange(0, BLOCK_K // 2)
    x_ptr = X + offs_m[:, None] * stride_xm + 2 * offs_t[None, :]  # even activations; +1: odd
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // 2], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // 2], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xe = tl.load(x_ptr + k0, mask=m_ok[:, None], other=0.0)
        xo = tl.load(x_ptr + k0 + 1, mask=m_ok[:, None], other=0.0)
        we, wo = _q4w_tile(QW, S, Z, offs_n, n_ok, k0, K, BLOCK_K, GROUP)
        if USE_DOT:
            acc += tl.dot(xe, tl.trans(we.to(xe.dtype)))
            acc += tl.dot(xo, tl.trans(wo.to(xo.dtype)))
        else:
            acc += xe.to(tl.float32)[:, None, :] * we[None, :, :] + xo.to(tl.float32)[:, None, :] * wo[None, :, :]
        if GLU:
            ue, uo = _q4w_tile(QW, S, Z, offs_n + GLU_OFF, n_ok, k0, K, BLOCK_K, GROUP)
            if USE_DOT:
                acc_u += tl.dot(xe, tl.trans(ue.to(xe.dtype)))
                acc_u += tl.dot(xo, tl.trans(uo.to(xo.dtype)))
            else:
                acc_u += xe.to(tl.float32)[:, None, :] * ue[None, :, :] + xo.to(tl.float32)[:, None, :] * uo[None, :, :]
    if USE_DOT:
        y = acc
        u = acc_u
    else:
        y = tl.sum(acc, 2)
        u = tl.sum(acc_u, 2)
    if GLU:
        y = y / (1.0 + tl.exp(-y)) * u  # silu(gate) * up
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def q4w_linear(x: torch.Tensor, qw32: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, glu: bool = False,
               block_n: int | None = None, block_k: int = 256, use_dot: bool | None = None, num_warps: int = 4,
               num_stages: int = 3) -> torch.Tensor:
    """x: [M, K] (M <= 16) bf16/fp16; qw32: [N, K/8] int32 (pack_int4_w32); scale, zero: [N, K/32] -> [M, N],
    or with glu=True (rows = gate rows then up rows) silu(x @ gate^T) * (x @ up^T): [M, N / 2]."""
    m, k = x.shape
    n = qw32.shape[0]
    if not 1 <= m <= MAX_ROWS or qw32.shape[1] * 8 != k or k % block_k or x.stride(1) != 1 or (glu and n % 2):
        raise ValueError(f"q4w_linear: bad shapes x {tuple(x.shape)} qw32 {tuple(qw32.shape)} block_k {block_k}")
    use_dot = m > 2 if use_dot is None else use_dot
    block_n = block_n or (32 if use_dot else 8)
    n_out = n // 2 if glu else n
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    block_m = 16 if use_dot else triton.next_power_of_2(m)
    _q4w_kernel[(triton.cdiv(n_out, block_n),)](x, qw32, scale, zero, y, m, n_out, x.stride(0), y.stride(0), n_out,
                                                K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                                USE_DOT=use_dot, GLU=glu, GROUP=GROUP, num_warps=num_warps,
                                                num_stages=num_stages)
    return y


@triton.jit
def _q4w2_kernel(X, QW, S, Z, Y, M, N, stride_xm, stride_ym, GLU_OFF,
                 K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_DOT: tl.constexpr, GLU: tl.constexpr, GROUP: tl.constexpr):
    """The word layout again, with every tensor [BLOCK_N, words] in the layout the weights are loaded in (no
    reshapes): code t of each word (t = 2 j + h) is unpacked by itself and multiplies the activations
    k0 + 8 w + t, pre-scaled by 16^-j. Per weight: one mask-and-or, one subtraction, one multiply-add; the group
    scale multiplies a word's partial sum, the offset the word's activation sum. CUDA cores for BLOCK_M <= 2,
    else 8 tensor-core products per tile (one per t) plus one for the offsets."""
    pid = tl.program_id(0)
    BW: tl.constexpr = BLOCK_K // 8
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_w = tl.arange(0, BW)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    rows = offs_n[:, None].to(tl.int64)
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BW], tl.float32)
        acc1 = tl.zeros([BLOCK_N, BW], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BW], tl.float32)
        acc_u1 = tl.zeros([BLOCK_N, BW], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for part in tl.static_range(2 if GLU else 1):
            r = rows + GLU_OFF if part == 1 else rows
            wv = tl.load(QW + r * (K // 8) + k0 // 8 + offs_w[None, :], mask=n_ok[:, None], other=0)  # [BN, BW]
            wh = wv >> 16
            gp = r * (K // GROUP) + k0 // GROUP + offs_w[None, :] // 4
            s_w = tl.load(S + gp, mask=n_ok[:, None], other=0.0).to(tl.float32)
            z_w = tl.load(Z + gp, mask=n_ok[:, None], other=0.0).to(tl.float32)
            if USE_DOT:
                d = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                xs = tl.zeros([BLOCK_M, BW], tl.float32)
                for t in tl.static_range(8):
                    src = wh if t % 2 == 1 else wv
                    f = ((src & (15 << (4 * (t // 2)))) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                    xt = tl.load(X + offs_m[:, None] * stride_xm + k0 + 8 * offs_w[None, :] + t,
                                 mask=m_ok[:, None], other=0.0)
                    xs += xt.to(tl.float32)
                    xt = (xt.to(tl.float32) * (1.0 / (1 << (4 * (t // 2))))).to(xt.dtype)
                    d += tl.dot(xt, tl.trans((f * s_w).to(xt.dtype)))
                xs_hi = xs.to(X.dtype.element_ty)
                xs_lo = (xs - xs_hi.to(tl.float32)).to(X.dtype.element_ty)
                zt = tl.trans(z_w.to(X.dtype.element_ty))
                d += tl.dot(xs_hi, zt) + tl.dot(xs_lo, zt)
                if part == 1:
                    acc_u += d
                else:
                    acc += d
            else:
                d0 = tl.zeros([BLOCK_N, BW], tl.float32)
                d1 = tl.zeros([BLOCK_N, BW], tl.float32)
                xs0 = tl.zeros([BW], tl.float32)
                xs1 = tl.zeros([BW], tl.float32)
                for t in tl.static_range(8):
                    src = wh if t % 2 == 1 else wv
                    f = ((src & (15 << (4 * (t // 2)))) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                    x0 = tl.load(X + k0 + 8 * offs_w + t).to(tl.float32)
                    xs0 += x0
                    d0 += (x0 * (1.0 / (1 << (4 * (t // 2)))))[None, :] * f
                    if BLOCK_M > 1:
                        x1 = tl.load(X + stride_xm + k0 + 8 * offs_w + t)  # BLOCK_M == M == 2
                        x1 = x1.to(tl.float32)
                        xs1 += x1
                        d1 += (x1 * (1.0 / (1 << (4 * (t // 2)))))[None, :] * f
                if part == 1:
                    acc_u += d0 * s_w + z_w * xs0[None, :]
                    if BLOCK_M > 1:
                        acc_u1 += d1 * s_w + z_w * xs1[None, :]
                else:
                    acc += d0 * s_w + z_w * xs0[None, :]
                    if BLOCK_M > 1:
                        acc1 += d1 * s_w + z_w * xs1[None, :]
    if USE_DOT:
        y = acc
        if GLU:
            y = y / (1.0 + tl.exp(-y)) * acc_u
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
    else:
        y0 = tl.sum(acc, 1)
        if GLU:
            u0 = tl.sum(acc_u, 1)
            y0 = y0 / (1.0 + tl.exp(-y0)) * u0
        tl.store(Y + offs_n, y0.to(Y.dtype.element_ty), mask=n_ok)
        if BLOCK_M > 1:
            y1 = tl.sum(acc1, 1)
            if GLU:
                u1 = tl.sum(acc_u1, 1)
                y1 = y1 / (1.0 + tl.exp(-y1)) * u1
            tl.store(Y + stride_ym + offs_n, y1.to(Y.dtype.element_ty), mask=n_ok)


def q4w2_linear(x: torch.Tensor, qw32: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, glu: bool = False,
                block_n: int | None = None, block_k: int = 256, use_dot: bool | None = None, num_warps: int = 4,
                num_stages: int = 3) -> torch.Tensor:
    """As q4w_linear (same layout and result), with the reshape-free kernel `_q4w2_kernel`."""
    m, k = x.shape
    n = qw32.shape[0]
    if not 1 <= m <= MAX_ROWS or qw32.shape[1] * 8 != k or k % block_k or x.stride(1) != 1 or (glu and n % 2):
        raise ValueError(f"q4w2_linear: bad shapes x {tuple(x.shape)} qw32 {tuple(qw32.shape)} block_k {block_k}")
    use_dot = m > 2 if use_dot is None else use_dot
    if not use_dot and m > 2:
        raise ValueError("q4w2_linear: the CUDA-core path takes at most 2 rows")
    block_n = block_n or (32 if use_dot else 8)
    n_out = n // 2 if glu else n
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    block_m = 16 if use_dot else m
    _q4w2_kernel[(triton.cdiv(n_out, block_n),)](x, qw32, scale, zero, y, m, n_out, x.stride(0), y.stride(0), n_out,
                                                 K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                                 USE_DOT=use_dot, GLU=glu, GROUP=GROUP, num_warps=num_warps,
                                                 num_stages=num_stages)
    return y


# ============================================================================ int4, word layout, packed f16
# The decode kernel (1 or 2 rows). Per word of 8 codes, one inline-PTX block does the unpacking and the products
# in packed half precision, two codes per instruction (the lop3 / f16x2 scheme of Marlin-style kernels):
#   lop3(w, 0x000F000F, 0x6400_6400) is the f16 pair (1024 + c_2j, 1024 + c_2j+1) for j = 0 (codes at bits 0-3
#   and 16-19); mask 0x00F000F0 gives (1024 + 16 c, ...) for j = 1 (still exact: f16 has ulp 1 in [1024, 2048));
#   j = 2, 3 the same after one shift by 8. Subtracting 1024 leaves c (or 16 c) exactly; one fma.f16x2 then
#   multiplies a pair of codes by the pair of activations (x[8i + 2j], x[8i + 2j + 1]) -- adjacent, so the
#   activation pairs are plain 32-bit loads of the bf16 row converted to f16 pairs.
# Activations are pre-scaled by 1/16 (j even) or 1/256 (j odd: the code came out as 16 c), so a pair's products
# stay below |x|, and the word's 4 f16 pair products sum to at most 4 |x|max: exact to f16 rounding for
# |x| < 16000 (the f16 range), and the result is multiplied back by 16 in float32. Per word (8 weights): 1 shift,
# 4 lop3, 4 sub, 4 fma (f16x2), 2 cvt + 1 add to float32, then in float32 one fma by the group scale and one by
# the group offset times the word's activation sum (w = c * scale + zero). ~2.3 instructions per weight, against
# ~4 for the float32 unpacking above.
_Q4_WORD_UNPACK = """
    mov.b32 m, 0x64006400;
    shr.u32 h, $W, 8;
    lop3.b32 t0, $W, 0x000F000F, m, 0xEA;
    lop3.b32 t1, $W, 0x00F000F0, m, 0xEA;
    lop3.b32 t2, h, 0x000F000F, m, 0xEA;
    lop3.b32 t3, h, 0x00F000F0, m, 0xEA;
    sub.f16x2 t0, t0, m;
    sub.f16x2 t1, t1, m;
    sub.f16x2 t2, t2, m;
    sub.f16x2 t3, t3, m;
"""
_Q4_WORD_DOT = """
    mul.f16x2 a, t0, $X0;
    fma.rn.f16x2 a, t1, $X1, a;
    fma.rn.f16x2 a, t2, $X2, a;
    fma.rn.f16x2 a, t3, $X3, a;
    mov.b32 {lo, hi}, a;
    cvt.f32.f16 f0, lo;
    cvt.f32.f16 f1, hi;
    add.f32 $OUT, f0, f1;
"""
_Q4_DECLS = ".reg .b32 t0, t1, t2, t3, h, m, a;\n.reg .b16 lo, hi;\n.reg .f32 f0, f1;\n"


def _q4_word_asm(rows: int) -> str:
    """PTX for `rows` activation rows: outputs $0 .. $rows-1 (float32), then the word, then 4 pairs per row."""
    w = f"${rows}"
    body = _Q4_WORD_UNPACK.replace("$W", w)
    for r in range(rows):
        dot = _Q4_WORD_DOT.replace("$OUT", f"${r}")
        for j in range(4):
            dot = dot.replace(f"$X{j}", f"${rows + 1 + 4 * r + j}")
        body += dot
    return "{\n" + _Q4_DECLS + body + "}\n"


_Q4_ASM_1 = tl.constexpr(_q4_word_asm(1))
_Q4_ASM_2 = tl.constexpr(_q4_word_asm(2))


@triton.jit
def _f16_pair(v, scale):
    """v: int32 holding the bf16 pair (x[2i], x[2i+1]) -> int32 holding the f16 pair (x[2i] * scale, ...)."""
    lo = (v << 16).to(tl.float32, bitcast=True) * scale
    hi = (v & -65536).to(tl.float32, bitcast=True) * scale
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [hi, lo], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _pair_sum(v):
    return (v << 16).to(tl.float32, bitcast=True) + (v & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _x_pairs(X32, k0, offs_w, BW: tl.constexpr):
    """The activations of BW words from k0 (int32 pairs of bf16): the 4 f16 pairs per word, pre-scaled for the
    PTX block, and the word groups' activation sums [BW / 4] in float32."""
    v = tl.load(X32 + k0 // 2 + tl.arange(0, 4 * BW))  # [4 BW] int32, 16 contiguous bytes per word
    v = tl.reshape(v, [BW, 2, 2])
    ve, vo = tl.split(v)  # pairs 0, 2 / 1, 3 of each word: [BW, 2]
    v0, v2 = tl.split(ve)
    v1, v3 = tl.split(vo)
    xs = _pair_sum(v0) + _pair_sum(v1) + _pair_sum(v2) + _pair_sum(v3)  # [BW]
    xs = tl.sum(tl.reshape(xs, [BW // 4, 4]), 1)  # [BW / 4]: per group of 32 activations
    return (_f16_pair(v0, 0.0625)[None, :], _f16_pair(v1, 0.00390625)[None, :], _f16_pair(v2, 0.0625)[None, :],
            _f16_pair(v3, 0.00390625)[None, :], xs[None, :])


@triton.jit
def _x_pairs_pre(X32, XS, k0, BW: tl.constexpr, GROUP: tl.constexpr):
    """As _x_pairs, from activations already converted (`x_pairs_f16`): the pre-scaled f16 pairs and group sums."""
    v = tl.reshape(tl.load(X32 + k0 // 2 + tl.arange(0, 4 * BW)), [BW, 2, 2])
    ve, vo = tl.split(v)
    v0, v2 = tl.split(ve)
    v1, v3 = tl.split(vo)
    xs = tl.load(XS + k0 // GROUP + tl.arange(0, BW // 4))
    return v0[None, :], v1[None, :], v2[None, :], v3[None, :], xs[None, :]


def x_pairs_f16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] bf16 -> (int32 [M, K / 2]: the f16 pairs q4v's PTX block takes, pair j of each word of 8 scaled by
    1/16 (j even) or 1/256 (j odd); float32 [M, K / 32]: the group sums of x) -- what _x_pairs computes in-kernel."""
    m, k = x.shape
    f = x.float().view(m, k // 8, 4, 2)
    sc = torch.tensor([0.0625, 0.00390625, 0.0625, 0.00390625], device=x.device)[:, None]
    pairs = (f * sc).half().view(m, k).view(torch.int32)
    return pairs, x.float().view(m, k // GROUP, GROUP).sum(-1)


@triton.jit
def _q4v_tile(QW, S, Z, r, n_ok, k0, offs_w, offs_g, K: tl.constexpr, GROUP: tl.constexpr):
    """Words [BN, BW] int32, scale * 16 and offset [BN, NG] float32 of rows r from code k0 (masked rows: 0)."""
    wv = tl.load(QW + r * (K // 8) + k0 // 8 + offs_w[None, :], mask=n_ok[:, None], other=0,
                 eviction_policy="evict_first")
    gp = r * (K // GROUP) + k0 // GROUP + offs_g[None, :]
    s = tl.load(S + gp, mask=n_ok[:, None], other=0.0).to(tl.float32) * 16.0
    z = tl.load(Z + gp, mask=n_ok[:, None], other=0.0).to(tl.float32)
    return wv, s, z


@triton.jit
def _q4v_dot(wv, s, z, a0, a1, a2, a3, xs, b0, b1, b2, b3, xs1, BN: tl.constexpr, NG: tl.constexpr,
             M: tl.constexpr):
    """The tile's contribution [BN, NG] per activation row (row 1: zeros when M == 1)."""
    if M == 1:
        d = tl.inline_asm_elementwise(_Q4_ASM_1, "=f,r,r,r,r,r", [wv, a0, a1, a2, a3], dtype=tl.float32,
                                      is_pure=True, pack=1)
        return tl.sum(tl.reshape(d, [BN, NG, 4]), 2) * s + z * xs, tl.zeros([BN, NG], tl.float32)
    else:
        d, d1 = tl.inline_asm_elementwise(_Q4_ASM_2, "=f,=f,r,r,r,r,r,r,r,r,r", [wv, a0, a1, a2, a3, b0, b1, b2, b3],
                                          dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        return (tl.sum(tl.reshape(d, [BN, NG, 4]), 2) * s + z * xs,
                tl.sum(tl.reshape(d1, [BN, NG, 4]), 2) * s + z * xs1)


@triton.jit
def _q4v_kernel(X, QW, S, Z, Y, N, stride_xm, stride_ym, GLU_OFF, XS,
                K: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GLU: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr, XPRE: tl.constexpr = False):
    # one program: BLOCK_N output features (GLU: gate rows n and up rows GLU_OFF + n) of M = 1 or 2 rows,
    # K walked in BLOCK_K steps, the next step's weights loaded while this one computes. Words are
    # [BLOCK_N, BW] as loaded; a word's products are summed over its group of 4 words ([BLOCK_N, NG]) before the
    # group scale and offset apply. With PDL the first weights are requested before waiting for the kernel
    # that writes X (they do not depend on it), and the next kernel may launch once every program has started.
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    BW: tl.constexpr = BLOCK_K // 8
    NG: tl.constexpr = BLOCK_K // GROUP
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_w = tl.arange(0, BW)
    offs_g = tl.arange(0, NG)
    rows = offs_n[:, None].to(tl.int64)
    up = rows + GLU_OFF
    X32 = X.to(tl.pointer_type(tl.int32))  # the bf16 activations as pairs
    wv, s, z = _q4v_tile(QW, S, Z, rows, n_ok, 0, offs_w, offs_g, K, GROUP)
    if GLU:
        uv, us, uz = _q4v_tile(QW, S, Z, up, n_ok, 0, offs_w, offs_g, K, GROUP)
    if PDL:
        gdc_wait()  # X is written by the previous kernel
    acc = tl.zeros([BLOCK_N, NG], tl.float32)  # gate (or only) rows, activation row 0
    acc1 = tl.zeros([BLOCK_N, NG], tl.float32)  # activation row 1 (M == 2)
    acc_u = tl.zeros([BLOCK_N, NG], tl.float32)  # up rows (GLU)
    acc_u1 = tl.zeros([BLOCK_N, NG], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if K > BLOCK_K:  # the next step's weights (none after the last)
            more = n_ok & (k0 + BLOCK_K < K)
            nwv, ns, nz = _q4v_tile(QW, S, Z, rows, more, k0 + BLOCK_K, offs_w, offs_g, K, GROUP)
            if GLU:
                nuv, nus, nuz = _q4v_tile(QW, S, Z, up, more, k0 + BLOCK_K, offs_w, offs_g, K, GROUP)
        if XPRE:  # X: x_pairs_f16's pairs, XS its group sums
            a0, a1, a2, a3, xs = _x_pairs_pre(X32, XS, k0, BW, GROUP)
        else:
            a0, a1, a2, a3, xs = _x_pairs(X32, k0, offs_w, BW)
        if M == 2:
            if XPRE:
                b0, b1, b2, b3, xs1 = _x_pairs_pre(X32 + stride_xm // 2, XS + K // GROUP, k0, BW, GROUP)
            else:
                b0, b1, b2, b3, xs1 = _x_pairs(X32 + stride_xm // 2, k0, offs_w, BW)
        else:
            b0, b1, b2, b3, xs1 = a0, a1, a2, a3, xs
        c0, c1 = _q4v_dot(wv, s, z, a0, a1, a2, a3, xs, b0, b1, b2, b3, xs1, BLOCK_N, NG, M)
        acc += c0
        acc1 += c1
        if GLU:
            c0, c1 = _q4v_dot(uv, us, uz, a0, a1, a2, a3, xs, b0, b1, b2, b3, xs1, BLOCK_N, NG, M)
            acc_u += c0
            acc_u1 += c1
            if K > BLOCK_K:
                uv, us, uz = nuv, nus, nuz
        if K > BLOCK_K:
            wv, s, z = nwv, ns, nz
    y = tl.sum(acc, 1)
    if GLU:
        u = tl.sum(acc_u, 1)
        y = y / (1.0 + tl.exp(-y)) * u  # silu(gate) * up
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=n_ok)
    if M == 2:
        y1 = tl.sum(acc1, 1)
        if GLU:
            u1 = tl.sum(acc_u1, 1)
            y1 = y1 / (1.0 + tl.exp(-y1)) * u1
        tl.store(Y + stride_ym + offs_n, y1.to(Y.dtype.element_ty), mask=n_ok)


def q4v_linear(x: torch.Tensor, qw32: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, glu: bool = False,
               block_n: int | None = None, block_k: int | None = None, use_dot: bool = False, num_warps: int = 4,
               num_stages: int = 2, x_pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """As q4w_linear (same layout and result up to f16 rounding of the products) for 1 or 2 bf16 rows, with
    the packed-f16 decode kernel `_q4v_kernel`; block_k defaults to the largest power of two dividing K, up
    to 4096. x_pairs: `x_pairs_f16(x)`, made beforehand: the kernel reads them instead of converting x in every
    program (the same result bit for bit; an experiment of benchmarks/q4v_xprep_gpu.py, which measured it 4 %
    faster summed over a decode step's products: the engine does not use it). CUDA only (inline PTX: Triton's
    interpreter cannot run it)."""
    m, k = x.shape
    n = qw32.shape[0]
    block_k = block_k or min(k & -k, 4096)  # the largest power of two dividing K
    if use_dot or m not in (1, 2) or x.dtype != torch.bfloat16 or qw32.shape[1] * 8 != k or k % block_k \
            or x.stride(1) != 1 or x.stride(0) % 2 or (glu and n % 2):
        raise ValueError(f"q4v_linear: takes 1-2 contiguous bf16 rows; got x {tuple(x.shape)} {x.dtype} "
                         f"qw32 {tuple(qw32.shape)} block_k {block_k}")
    block_n = block_n or 4
    n_out = n // 2 if glu else n
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    pdl_on = pdl_enabled(x)
    xin, xs, stride = x, x, x.stride(0)
    if x_pairs is not None:
        xin, xs = x_pairs
        if xin.shape != (m, k // 2) or xs.shape != (m, k // GROUP) or not (xin.is_contiguous() and xs.is_contiguous()):
            raise ValueError(f"q4v_linear: x_pairs must be x_pairs_f16(x) of x {tuple(x.shape)}")
        stride = k  # in bf16 elements, as the kernel counts
    _q4v_kernel[(triton.cdiv(n_out, block_n),)](xin, qw32, scale, zero, y, n_out, stride, y.stride(0), n_out, xs,
                                                K=k, M=m, BLOCK_N=block_n, BLOCK_K=block_k, GLU=glu, GROUP=GROUP,
                                                PDL=pdl_on, XPRE=x_pairs is not None, num_warps=num_warps,
                                                num_stages=num_stages, **launch_kwargs(pdl_on))
    return y


# ====================================================================== int4, word layout, tensor cores
# Verification rows (3..16): the weights are dequantized to bf16 in registers by one inline-PTX block per word
# (three shifts, four lop3 into the bf16 "magic" 128 + c, exact; sub.bf16x2 leaves c; fma.bf16x2 applies the
# group scale and offset: ~2 instructions per weight whatever the row count) and multiplied on the tensor cores,
# W [BLOCK_N, BLOCK_K] @ X^T [BLOCK_K, 16] (the weights as the left operand, the rows padded to 16).
_Q4_BF16_ASM = tl.constexpr("""{
    .reg .b32 m, h1, h2, h3, t0, t1, t2, t3;
    mov.b32 m, 0x43004300;
    shr.u32 h1, $8, 4;
    shr.u32 h2, $8, 8;
    shr.u32 h3, $8, 12;
    lop3.b32 t0, $8, 0x000F000F, m, 0xEA;
    lop3.b32 t1, h1, 0x000F000F, m, 0xEA;
    lop3.b32 t2, h2, 0x000F000F, m, 0xEA;
    lop3.b32 t3, h3, 0x000F000F, m, 0xEA;
    sub.bf16x2 t0, t0, m;
    sub.bf16x2 t1, t1, m;
    sub.bf16x2 t2, t2, m;
    sub.bf16x2 t3, t3, m;
    fma.rn.bf16x2 t0, t0, $9, $10;
    fma.rn.bf16x2 t1, t1, $9, $10;
    fma.rn.bf16x2 t2, t2, $9, $10;
    fma.rn.bf16x2 t3, t3, $9, $10;
    mov.b32 {$0, $4}, t0;
    mov.b32 {$2, $6}, t1;
    mov.b32 {$1, $5}, t2;
    mov.b32 {$3, $7}, t3;
}""")


@triton.jit
def _bf16_pair(v):
    """bf16 values -> int32 holding the pair (v, v)."""
    b = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _q4t_kernel(X, QW, S, Z, Y, M, N, stride_xm, stride_ym, GLU_OFF,
                K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr,
                GROUP: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    BW: tl.constexpr = BLOCK_K // 8
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_w = tl.arange(0, BW)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, 16)
    m_ok = offs_m < M
    rows = offs_n[:, None].to(tl.int64)
    if PDL:
        gdc_wait()
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    acc_u = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + offs_m[:, None] * stride_xm + k0 + offs_k[None, :], mask=m_ok[:, None], other=0.0)
        xt = tl.trans(x)  # [BLOCK_K, 16]
        for part in tl.static_range(2 if GLU else 1):
            r = rows + GLU_OFF if part == 1 else rows
            wv = tl.load(QW + r * (K // 8) + k0 // 8 + offs_w[None, :], mask=n_ok[:, None], other=0,
                         eviction_policy="evict_first")  # [BN, BW] int32
            gp = r * (K // GROUP) + k0 // GROUP + offs_w[None, :] // 4
            s2 = _bf16_pair(tl.load(S + gp, mask=n_ok[:, None], other=0.0))
            z2 = _bf16_pair(tl.load(Z + gp, mask=n_ok[:, None], other=0.0))
            c0, c4, c2, c6, c1, c5, c3, c7 = tl.inline_asm_elementwise(
                _Q4_BF16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [wv, s2, z2],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
            w = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
            w = tl.reshape(w, [BLOCK_N, BLOCK_K])  # codes in order
            if part == 1:
                acc_u = tl.dot(w, xt, acc_u)
            else:
                acc = tl.dot(w, xt, acc)
    y = acc
    if GLU:
        y = y / (1.0 + tl.exp(-y)) * acc_u
    tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], y.to(Y.dtype.element_ty),
             mask=m_ok[None, :] & n_ok[:, None])


def q4t_linear(x: torch.Tensor, qw32: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, glu: bool = False,
               block_n: int | None = None, block_k: int = 256, use_dot: bool = True, num_warps: int = 4,
               num_stages: int = 3) -> torch.Tensor:
    """As q4w_linear (same layout; weights rounded to bf16 after scaling) for 1..16 bf16 rows on the tensor
    cores, with the inline-PTX bf16 dequantization `_q4t_kernel`. CUDA only."""
    m, k = x.shape
    n = qw32.shape[0]
    if not 1 <= m <= MAX_ROWS or x.dtype != torch.bfloat16 or qw32.shape[1] * 8 != k or k % block_k \
            or x.stride(1) != 1 or (glu and n % 2) or not use_dot:
        raise ValueError(f"q4t_linear: takes 1-16 contiguous bf16 rows; got x {tuple(x.shape)} {x.dtype} "
                         f"qw32 {tuple(qw32.shape)} block_k {block_k}")
    block_n = block_n or 64
    n_out = n // 2 if glu else n
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    pdl_on = pdl_enabled(x)
    _q4t_kernel[(triton.cdiv(n_out, block_n),)](x, qw32, scale, zero, y, m, n_out, x.stride(0), y.stride(0), n_out,
                                                K=k, BLOCK_N=block_n, BLOCK_K=block_k, GLU=glu, GROUP=GROUP,
                                                PDL=pdl_on, num_warps=num_warps, num_stages=num_stages,
                                                **launch_kwargs(pdl_on))
    return y


# =========================================================== int4, word layout, packed f16, 3..8 rows
# Short verification chains (k + 1 = 3..8 rows) on the CUDA cores: the decode kernel's PTX block with the word
# unpacked once per 4 rows (9 instructions) and 4 pair products + a conversion per row (7), so a row costs ~0.9
# instructions per weight beyond the first -- against a tensor-core path whose bf16 dequantization and operand
# shuffles cost more than the products at these row counts.
_Q4_ASM_3 = tl.constexpr(_q4_word_asm(3))
_Q4_ASM_4 = tl.constexpr(_q4_word_asm(4))


@triton.jit
def _q4r_block(wv, s, z, X32, stride_x32, k0, offs_w, R: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
               BW: tl.constexpr):
    """R (1..4) activation rows from X32 against the words wv: 4 contributions [BN, NG] (zeros past R)."""
    a0, a1, a2, a3, xa = _x_pairs(X32, k0, offs_w, BW)
    zero = tl.zeros([BN, NG], tl.float32)
    if R == 1:
        d0 = tl.inline_asm_elementwise(_Q4_ASM_1, "=f,r,r,r,r,r", [wv, a0, a1, a2, a3], dtype=tl.float32,
                                       is_pure=True, pack=1)
        return tl.sum(tl.reshape(d0, [BN, NG, 4]), 2) * s + z * xa, zero, zero, zero
    b0, b1, b2, b3, xb = _x_pairs(X32 + stride_x32, k0, offs_w, BW)
    if R == 2:
        d0, d1 = tl.inline_asm_elementwise(_Q4_ASM_2, "=f,=f" + ",r" * 9, [wv, a0, a1, a2, a3, b0, b1, b2, b3],
                                           dtype=(tl.float32,) * 2, is_pure=True, pack=1)
        return (tl.sum(tl.reshape(d0, [BN, NG, 4]), 2) * s + z * xa,
                tl.sum(tl.reshape(d1, [BN, NG, 4]), 2) * s + z * xb, zero, zero)
    c0, c1, c2, c3, xc = _x_pairs(X32 + 2 * stride_x32, k0, offs_w, BW)
    if R == 3:
        d0, d1, d2 = tl.inline_asm_elementwise(_Q4_ASM_3, "=f,=f,=f" + ",r" * 13,
                                               [wv, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3],
                                               dtype=(tl.float32,) * 3, is_pure=True, pack=1)
        return (tl.sum(tl.reshape(d0, [BN, NG, 4]), 2) * s + z * xa,
                tl.sum(tl.reshape(d1, [BN, NG, 4]), 2) * s + z * xb,
                tl.sum(tl.reshape(d2, [BN, NG, 4]), 2) * s + z * xc, zero)
    e0, e1, e2, e3, xe = _x_pairs(X32 + 3 * stride_x32, k0, offs_w, BW)
    d0, d1, d2, d3 = tl.inline_asm_elementwise(_Q4_ASM_4, "=f,=f,=f,=f" + ",r" * 17,
                                               [wv, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3,
                                                e0, e1, e2, e3], dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    return (tl.sum(tl.reshape(d0, [BN, NG, 4]), 2) * s + z * xa,
            tl.sum(tl.reshape(d1, [BN, NG, 4]), 2) * s + z * xb,
            tl.sum(tl.reshape(d2, [BN, NG, 4]), 2) * s + z * xc,
            tl.sum(tl.reshape(d3, [BN, NG, 4]), 2) * s + z * xe)


@triton.jit
def _q4r_store(Y, stride_ym, offs_n, n_ok, r: tl.constexpr, acc, acc_u, GLU: tl.constexpr):
    y = tl.sum(acc, 1)
    if GLU:
        u = tl.sum(acc_u, 1)
        y = y / (1.0 + tl.exp(-y)) * u
    tl.store(Y + r * stride_ym + offs_n, y.to(Y.dtype.element_ty), mask=n_ok)


@triton.jit
def _store_rows(Y, stride_ym, offs_n, n_ok, M: tl.constexpr, g0, g1, g2, g3, g4, g5, g6, g7, u0, u1, u2, u3, u4, u5,
                u6, u7, GLU: tl.constexpr):
    """The first M of 8 rows' accumulators [BN, NG] (gate g, up u when GLU) summed and stored."""
    _q4r_store(Y, stride_ym, offs_n, n_ok, 0, g0, u0, GLU)
    if M > 1:
        _q4r_store(Y, stride_ym, offs_n, n_ok, 1, g1, u1, GLU)
    if M > 2:
        _q4r_store(Y, stride_ym, offs_n, n_ok, 2, g2, u2, GLU)
    if M > 3:
        _q4r_store(Y, stride_ym, offs_n, n_ok, 3, g3, u3, GLU)
    if M > 4:
        _q4r_store(Y, stride_ym, offs_n, n_ok, 4, g4, u4, GLU)
    if M > 5:
        _q4r_store(Y, stride_ym, offs_n, n_ok, 5, g5, u5, GLU)
    if M > 6:
        _q4r_store(Y, stride_ym, offs_n, n_ok, 6, g6, u6, GLU)
    if M > 7:
        _q4r_store(Y, stride_ym, offs_n, n_ok, 7, g7, u7, GLU)


@triton.jit
def _rows_tile(QW, S, Z, r, n_ok, k0, offs_w, offs_g, K: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr):
    """A weight tile of either layout as (words, scale, offset); 8-bit weights have no offset (its slot: scale)."""
    if BITS == 4:
        return _q4v_tile(QW, S, Z, r, n_ok, k0, offs_w, offs_g, K, GROUP)
    else:
        wv, sc = _q8v_tile(QW, S, r, n_ok, k0, offs_w, offs_g, K, GROUP)
        return wv, sc, sc


@triton.jit
def _rows_block(wv, s, z, X32, stride_x32, k0, offs_w, R: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
                BW: tl.constexpr, BITS: tl.constexpr):
    if BITS == 4:
        return _q4r_block(wv, s, z, X32, stride_x32, k0, offs_w, R, BN, NG, BW)
    else:
        return _q8_block(wv, s, X32, stride_x32, k0, offs_w, R, BN, NG, BW)


@triton.jit
def _rows_kernel(X, QW, S, Z, Y, N, stride_xm, stride_ym, GLU_OFF,
                 K: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GLU: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr, BITS: tl.constexpr,
                 PREFETCH: tl.constexpr):
    # The 1..8-row kernel of both word layouts (BITS 4: `q4r_linear`, 8: `q8v_linear`). One program: BLOCK_N
    # output features (GLU: gate rows n and up rows GLU_OFF + n) of M activation rows; rows 0-3 and 4-7 each
    # share one unpacking of a word. K walked in BLOCK_K steps; PREFETCH: the next step's weights (gate and up)
    # are loaded while this one computes, else each step loads its own (the up rows after the gate rows' products).
    # PDL as in _q4v_kernel: the first weights before the wait.
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    BW: tl.constexpr = BLOCK_K // (32 // BITS)  # words per step (8 or 4 codes a word)
    NG: tl.constexpr = BLOCK_K // GROUP
    R0: tl.constexpr = 4 if M > 4 else M
    R1: tl.constexpr = M - R0
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_w = tl.arange(0, BW)
    offs_g = tl.arange(0, NG)
    rows = offs_n[:, None].to(tl.int64)
    up = rows + GLU_OFF
    X32 = X.to(tl.pointer_type(tl.int32))  # the bf16 activations as pairs
    sx = stride_xm // 2
    wv, s, z = _rows_tile(QW, S, Z, rows, n_ok, 0, offs_w, offs_g, K, GROUP, BITS)
    if GLU and PREFETCH:
        uv, us, uz = _rows_tile(QW, S, Z, up, n_ok, 0, offs_w, offs_g, K, GROUP, BITS)
    if PDL:
        gdc_wait()  # X is written by the previous kernel
    g0 = tl.zeros([BLOCK_N, NG], tl.float32)  # gate (or only) rows: activation rows 0..7
    g1 = tl.zeros([BLOCK_N, NG], tl.float32)
    g2 = tl.zeros([BLOCK_N, NG], tl.float32)
    g3 = tl.zeros([BLOCK_N, NG], tl.float32)
    g4 = tl.zeros([BLOCK_N, NG], tl.float32)
    g5 = tl.zeros([BLOCK_N, NG], tl.float32)
    g6 = tl.zeros([BLOCK_N, NG], tl.float32)
    g7 = tl.zeros([BLOCK_N, NG], tl.float32)
    u0 = tl.zeros([BLOCK_N, NG], tl.float32)  # up rows (GLU)
    u1 = tl.zeros([BLOCK_N, NG], tl.float32)
    u2 = tl.zeros([BLOCK_N, NG], tl.float32)
    u3 = tl.zeros([BLOCK_N, NG], tl.float32)
    u4 = tl.zeros([BLOCK_N, NG], tl.float32)
    u5 = tl.zeros([BLOCK_N, NG], tl.float32)
    u6 = tl.zeros([BLOCK_N, NG], tl.float32)
    u7 = tl.zeros([BLOCK_N, NG], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:
            if K > BLOCK_K:  # the next step's weights (none after the last)
                more = n_ok & (k0 + BLOCK_K < K)
                nwv, ns, nz = _rows_tile(QW, S, Z, rows, more, k0 + BLOCK_K, offs_w, offs_g, K, GROUP, BITS)
                if GLU:
                    nuv, nus, nuz = _rows_tile(QW, S, Z, up, more, k0 + BLOCK_K, offs_w, offs_g, K, GROUP, BITS)
        elif k0 > 0:
            wv, s, z = _rows_tile(QW, S, Z, rows, n_ok, k0, offs_w, offs_g, K, GROUP, BITS)
        c0, c1, c2, c3 = _rows_block(wv, s, z, X32, sx, k0, offs_w, R0, BLOCK_N, NG, BW, BITS)
        g0 += c0
        g1 += c1
        g2 += c2
        g3 += c3
        if R1 > 0:
            c0, c1, c2, c3 = _rows_block(wv, s, z, X32 + 4 * sx, sx, k0, offs_w, R1, BLOCK_N, NG, BW, BITS)
            g4 += c0
            g5 += c1
            g6 += c2
            g7 += c3
        if GLU:
            if not PREFETCH:
                uv, us, uz = _rows_tile(QW, S, Z, up, n_ok, k0, offs_w, offs_g, K, GROUP, BITS)
            c0, c1, c2, c3 = _rows_block(uv, us, uz, X32, sx, k0, offs_w, R0, BLOCK_N, NG, BW, BITS)
            u0 += c0
            u1 += c1
            u2 += c2
            u3 += c3
            if R1 > 0:
                c0, c1, c2, c3 = _rows_block(uv, us, uz, X32 + 4 * sx, sx, k0, offs_w, R1, BLOCK_N, NG, BW, BITS)
                u4 += c0
                u5 += c1
                u6 += c2
                u7 += c3
            if PREFETCH and K > BLOCK_K:
                uv, us, uz = nuv, nus, nuz
        if PREFETCH and K > BLOCK_K:
            wv, s, z = nwv, ns, nz
    _store_rows(Y, stride_ym, offs_n, n_ok, M, g0, g1, g2, g3, g4, g5, g6, g7, u0, u1, u2, u3, u4, u5, u6, u7, GLU)


def q4r_linear(x: torch.Tensor, qw32: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, glu: bool = False,
               block_n: int | None = None, block_k: int | None = None, use_dot: bool = False, num_warps: int = 4,
               num_stages: int = 2) -> torch.Tensor:
    """As q4v_linear for 1..8 bf16 rows (`_rows_kernel` with BITS=4: one unpacking of each word per 4 rows). CUDA
    only."""
    m, k = x.shape
    n = qw32.shape[0]
    block_k = block_k or min(k & -k, 1024)
    if use_dot or not 1 <= m <= 8 or x.dtype != torch.bfloat16 or qw32.shape[1] * 8 != k or k % block_k \
            or x.stride(1) != 1 or x.stride(0) % 2 or (glu and n % 2):
        raise ValueError(f"q4r_linear: takes 1-8 contiguous bf16 rows; got x {tuple(x.shape)} {x.dtype} "
                         f"qw32 {tuple(qw32.shape)} block_k {block_k}")
    block_n = block_n or 4
    n_out = n // 2 if glu else n
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    pdl_on = pdl_enabled(x)
    _rows_kernel[(triton.cdiv(n_out, block_n),)](x, qw32, scale, zero, y, n_out, x.stride(0), y.stride(0), n_out,
                                                 K=k, M=m, BLOCK_N=block_n, BLOCK_K=block_k, GLU=glu, GROUP=GROUP,
                                                 PDL=pdl_on, BITS=4, PREFETCH=False, num_warps=num_warps,
                                                 num_stages=num_stages, **launch_kwargs(pdl_on))
    return y


# ============================================================================= int8, word layout, packed f16
# The 8-bit counterpart of q4v / q4r (GGUF Q8_0: w = q * scale, q in -128..127, one scale per 32 weights), for
# 1..8 rows. Layout ``qw8`` int32 [N, K / 4]: byte j of word i is code 4i + j stored biased, u = q + 128 (the
# int8 codes viewed as bytes, +128). Per word one inline-PTX block:
#   prmt(w, 0x64646464, 0x4140) is the f16 pair (1024 + u_0, 1024 + u_1) (the byte under the exponent 0x64),
#   0x4342 gives (1024 + u_2, 1024 + u_3); subtracting the pair (1152, 1152) leaves (q_0, q_1), (q_2, q_3)
#   exactly (f16 has ulp 1 in [1024, 2048)); then per activation row one mul and one fma.f16x2 against the
#   activation pairs (x[4i], x[4i+1]), (x[4i+2], x[4i+3]), and a conversion of the two halves to float32.
# Activations are pre-scaled by 1/128 (so |q x / 128| <= |x|; a half's two products sum to at most 2 |x|: exact
# to f16 rounding for |x| < 32000) and the group scale by 128. Per word (4 weights): 2 prmt + 2 sub, then 2 f16x2
# products, 2 cvt and 1 add per row: ~2.25 instructions per weight for one row, ~1.25 per extra row; per byte
# streamed that is half the int4 kernel's work, so the 8-bit products stay bound by memory.
_Q8_WORD_UNPACK = """
    mov.b32 m, 0x64806480;
    prmt.b32 t0, $W, 0x64646464, 0x4140;
    prmt.b32 t1, $W, 0x64646464, 0x4342;
    sub.f16x2 t0, t0, m;
    sub.f16x2 t1, t1, m;
"""
_Q8_WORD_DOT = """
    mul.f16x2 a, t0, $X0;
    fma.rn.f16x2 a, t1, $X1, a;
    mov.b32 {lo, hi}, a;
    cvt.f32.f16 f0, lo;
    cvt.f32.f16 f1, hi;
    add.f32 $OUT, f0, f1;
"""
_Q8_DECLS = ".reg .b32 t0, t1, m, a;\n.reg .b16 lo, hi;\n.reg .f32 f0, f1;\n"


def _q8_word_asm(rows: int) -> str:
    """PTX for `rows` activation rows: outputs $0 .. $rows-1 (float32), then the word, then 2 pairs per row."""
    body = _Q8_WORD_UNPACK.replace("$W", f"${rows}")
    for r in range(rows):
        body += (_Q8_WORD_DOT.replace("$OUT", f"${r}").replace("$X0", f"${rows + 1 + 2 * r}")
                 .replace("$X1", f"${rows + 2 + 2 * r}"))
    return "{\n" + _Q8_DECLS + body + "}\n"


_Q8_ASM_1 = tl.constexpr(_q8_word_asm(1))
_Q8_ASM_2 = tl.constexpr(_q8_word_asm(2))
_Q8_ASM_3 = tl.constexpr(_q8_word_asm(3))
_Q8_ASM_4 = tl.constexpr(_q8_word_asm(4))


def pack_int8_w32(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] integer codes -128..127 (K a multiple of 32) -> [N, K / 4] int32, bytes biased by +128."""
    n, k = q.shape
    if k % GROUP:
        raise ValueError(f"pack_int8_w32 needs K divisible by {GROUP}, got {k}")
    return (q.to(torch.int16) + 128).to(torch.uint8).contiguous().view(torch.int32)


def unpack_int8_w32(qw8: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int8_w32: [N, K / 4] int32 -> [N, K] int8 codes."""
    return (qw8.contiguous().view(torch.uint8).to(torch.int16) - 128).to(torch.int8)


@triton.jit
def _q8_dequant_kernel(U, S, Y, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP: tl.constexpr):
    # one program: BLOCK_N rows x BLOCK_K codes (biased bytes) -> Y: (u - 128) * scale in float32, rounded once
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    rows = offs_n[:, None].to(tl.int64)
    u = tl.load(U + rows * K + offs_k[None, :], mask=ok, other=128).to(tl.float32)
    s = tl.load(S + rows * (K // GROUP) + (offs_k // GROUP)[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + rows * K + offs_k[None, :], ((u - 128.0) * s).to(Y.dtype.element_ty), mask=ok)


def dequantize_int8_w32(qw8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                        kernel: bool | None = None) -> torch.Tensor:
    """[N, K] in dtype: (u - 128) * scale, rounded once to dtype (products of more rows than the kernel takes:
    prefill). kernel (default: on CUDA): one memory-bound Triton pass (tests run it in Triton's interpreter);
    else torch ops (CPU stand-ins)."""
    u = qw8.contiguous().view(torch.uint8)
    n, k = u.shape
    if u.is_cuda if kernel is None else kernel:
        y = torch.empty(n, k, dtype=dtype, device=u.device)
        bn, bk = 16, 256
        _q8_dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](u, scale, y, n, K=k, BLOCK_N=bn, BLOCK_K=bk,
                                                                      GROUP=GROUP)
        return y
    w = (u.reshape(n, k // GROUP, GROUP).to(torch.float32) - 128.0) * scale.to(torch.float32)[..., None]
    return w.reshape(n, k).to(dtype)


@triton.jit
def _x8_pairs(X32, k0, offs_w, BW: tl.constexpr):
    """The activations of BW words from k0 as the 2 f16 pairs per word, pre-scaled by 1/128: [1, BW] each."""
    v = tl.load(X32 + k0 // 2 + tl.arange(0, 2 * BW))  # [2 BW] int32: bf16 pairs, 8 contiguous bytes per word
    v0, v1 = tl.split(tl.reshape(v, [BW, 2]))
    return _f16_pair(v0, 0.0078125)[None, :], _f16_pair(v1, 0.0078125)[None, :]


@triton.jit
def _q8v_tile(QW, S, r, n_ok, k0, offs_w, offs_g, K: tl.constexpr, GROUP: tl.constexpr):
    """Words [BN, BW] int32 and scale * 128 [BN, NG] float32 of rows r from code k0 (masked rows: 0)."""
    wv = tl.load(QW + r * (K // 4) + k0 // 4 + offs_w[None, :], mask=n_ok[:, None], other=0,
                 eviction_policy="evict_first")
    s = tl.load(S + r * (K // GROUP) + k0 // GROUP + offs_g[None, :], mask=n_ok[:, None],
                other=0.0).to(tl.float32) * 128.0
    return wv, s


@triton.jit
def _q8_block(wv, s, X32, stride_x32, k0, offs_w, R: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
              BW: tl.constexpr):
    """R (1..4) activation rows from X32 against the words wv: 4 contributions [BN, NG] (zeros past R)."""
    a0, a1 = _x8_pairs(X32, k0, offs_w, BW)
    zero = tl.zeros([BN, NG], tl.float32)
    if R == 1:
        d0 = tl.inline_asm_elementwise(_Q8_ASM_1, "=f,r,r,r", [wv, a0, a1], dtype=tl.float32, is_pure=True, pack=1)
        return tl.sum(tl.reshape(d0, [BN, NG, 8]), 2) * s, zero, zero, zero
    b0, b1 = _x8_pairs(X32 + stride_x32, k0, offs_w, BW)
    if R == 2:
        d0, d1 = tl.inline_asm_elementwise(_Q8_ASM_2, "=f,=f" + ",r" * 5, [wv, a0, a1, b0, b1],
                                           dtype=(tl.float32,) * 2, is_pure=True, pack=1)
        return tl.sum(tl.reshape(d0, [BN, NG, 8]), 2) * s, tl.sum(tl.reshape(d1, [BN, NG, 8]), 2) * s, zero, zero
    c0, c1 = _x8_pairs(X32 + 2 * stride_x32, k0, offs_w, BW)
    if R == 3:
        d0, d1, d2 = tl.inline_asm_elementwise(_Q8_ASM_3, "=f,=f,=f" + ",r" * 7, [wv, a0, a1, b0, b1, c0, c1],
                                               dtype=(tl.float32,) * 3, is_pure=True, pack=1)
        return (tl.sum(tl.reshape(d0, [BN, NG, 8]), 2) * s, tl.sum(tl.reshape(d1, [BN, NG, 8]), 2) * s,
                tl.sum(tl.reshape(d2, [BN, NG, 8]), 2) * s, zero)
    e0, e1 = _x8_pairs(X32 + 3 * stride_x32, k0, offs_w, BW)
    d0, d1, d2, d3 = tl.inline_asm_elementwise(_Q8_ASM_4, "=f,=f,=f,=f" + ",r" * 9,
                                               [wv, a0, a1, b0, b1, c0, c1, e0, e1],
                                               dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    return (tl.sum(tl.reshape(d0, [BN, NG, 8]), 2) * s, tl.sum(tl.reshape(d1, [BN, NG, 8]), 2) * s,
            tl.sum(tl.reshape(d2, [BN, NG, 8]), 2) * s, tl.sum(tl.reshape(d3, [BN, NG, 8]), 2) * s)


Q8_MAX_ROWS = 8


def q8v_linear(x: torch.Tensor, qw8: torch.Tensor, scale: torch.Tensor, glu: bool = False,
               block_n: int | None = None, block_k: int | None = None, num_warps: int = 4,
               num_stages: int = 2) -> torch.Tensor:
    """y = x @ W^T for 1..8 contiguous bf16 rows x [M, K] and 8-bit weights in the word layout (`pack_int8_w32`,
    scale [N, K / 32]); glu: W is gate rows then up rows, y = silu(x @ gate^T) * (x @ up^T). block_k defaults to
    the largest power of two dividing K, up to 1024. CUDA only (inline PTX)."""
    m, k = x.shape
    n = qw8.shape[0]
    block_k = block_k or min(k & -k, 1024)
    if not 1 <= m <= Q8_MAX_ROWS or x.dtype != torch.bfloat16 or qw8.shape[1] * 4 != k or k % block_k \
            or block_k % GROUP or x.stride(1) != 1 or x.stride(0) % 2 or (glu and n % 2):
        raise ValueError(f"q8v_linear: takes 1-{Q8_MAX_ROWS} contiguous bf16 rows; got x {tuple(x.shape)} "
                         f"{x.dtype} qw8 {tuple(qw8.shape)} block_k {block_k}")
    block_n = block_n or 4
    n_out = n // 2 if glu else n
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    pdl_on = pdl_enabled(x)
    _rows_kernel[(triton.cdiv(n_out, block_n),)](x, qw8, scale, scale, y, n_out, x.stride(0), y.stride(0), n_out,
                                                 K=k, M=m, BLOCK_N=block_n, BLOCK_K=block_k, GLU=glu, GROUP=GROUP,
                                                 PDL=pdl_on, BITS=8, PREFETCH=True, num_warps=num_warps,
                                                 num_stages=num_stages, **launch_kwargs(pdl_on))
    return y
