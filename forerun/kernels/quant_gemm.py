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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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
