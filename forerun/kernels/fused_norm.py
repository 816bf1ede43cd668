"""Fused elementwise kernels of a decoder layer, one launch each (torch would launch 5-15 small kernels).

* `add_rmsnorm`: s = x + residual (rounded to the activation dtype, as transformers adds in that dtype), then
  y = weight * s / sqrt(mean(s^2) + eps) in float32. Returns (y, s); s is the next residual stream.
* `qk_norm_rope_store`: splits the fused qkv projection [T, (Hq + 2 Hkv) * D] per head; applies the Q/K
  RMSNorm (Qwen3) and rotate-half RoPE to q and k; writes k and v into the paged cache at their slots; returns
  q [T, Hq, D]. One program per (token, head), heads ordered q, k, v.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import attention_waits, enabled as pdl_enabled, gdc_launch_dependents, gdc_wait, launch_kwargs


# Launch add + RMSNorm with PDL (it waits on the kernel before) where the caller does not say: off. Measured on the
# H200 (benchmarks/pdl_gpu.py, pdl_h200*.json): before int4 products, which fetch their first weights before they
# wait, a step of the 8B shape took 2.17 -> 2.03 ms; in bf16 models it was 0-3 % slower (products waiting too:
# 7 % slower at batch 1). FusedLayerOps turns it on for models with int4 products (runtime/cuda_graph.py).
USE_PDL = [False]


@triton.jit
def _add_rmsnorm_kernel(
    X, Res, W, Y, S,  # [T, H] each (W: [H])
    H, eps, stride_x, stride_r, stride_y, stride_s,
    BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
):
    if PDL:  # a following matrix product may launch now and fetch its weights (forerun/kernels/pdl.py)
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)  # (a weight: read before the wait)
    if WAIT:  # launched early too (with launch_pdl): X and Res are written by the kernels before
        gdc_wait()
    s = tl.load(X + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RES:
        s = (s.to(tl.float32) + tl.load(Res + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32))
        s = s.to(X.dtype.element_ty)
        tl.store(S + row * stride_s + offs, s, mask=ok)
    s32 = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s32 * s32, 0) / H + eps)
    y = (s32 * inv).to(X.dtype.element_ty).to(tl.float32) * w  # normalised value rounded first, as transformers
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=ok)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H]. Returns (rmsnorm(x + residual), x + residual); without a residual, (rmsnorm(x), x).
    pdl: launch with programmatic dependent launch, waiting on the kernel before (None: USE_PDL); where PDL is
    supported the kernel always lets the next one launch early."""
    t, h = x.shape
    y = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else x
    if t:
        block = triton.next_power_of_2(h)
        trigger = pdl_enabled(x)  # (always: a kernel launched without PDL may trigger its successor)
        wait = (USE_PDL[0] if pdl is None else pdl) and trigger
        _add_rmsnorm_kernel[(t,)](
            x, residual if residual is not None else x, weight, y, s, h, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), s.stride(0),
            BLOCK=block, HAS_RES=residual is not None, PDL=trigger, WAIT=wait,
            num_warps=max(1, min(16, block // 256)), **launch_kwargs(wait),
        )
    return y, s


@triton.jit
def _qk_norm_rope_store_kernel(
    QKV, Pos, Cos, Sin, QW, KW, Slots, Q, KC, VC,
    num_q_heads, num_kv_heads, eps, page,
    stride_t, stride_qt, stride_qh, stride_cos,
    stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    HALF: tl.constexpr, QK_NORM: tl.constexpr, WAIT: tl.constexpr,
):
    # WAIT: launched early (the attention chain waits, kernels/pdl.py), and lets the attention after it launch: the
    # slot, position, cos / sin rows and norm weights do not depend on the product before, so they are fetched
    # before the wait (V heads fetch them too, unused); QKV after it
    if WAIT:
        gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, HALF)
    is_v = head >= num_q_heads + num_kv_heads
    is_q = head < num_q_heads
    slot = tl.load(Slots + tok)
    blk, in_blk = slot // page, slot % page
    p = tl.load(Pos + tok)
    cos = tl.load(Cos + p * stride_cos + offs)  # cos/sin rows repeat their first half: read it once
    sin = tl.load(Sin + p * stride_cos + offs)
    if QK_NORM:
        nw = QW if is_q else KW
        w_lo = tl.load(nw + offs).to(tl.float32)
        w_hi = tl.load(nw + HALF + offs).to(tl.float32)
    if WAIT:
        gdc_wait()
    base = QKV + tok * stride_t + head * (2 * HALF)
    lo = tl.load(base + offs).to(tl.float32)  # first half of the head
    hi = tl.load(base + HALF + offs).to(tl.float32)
    if is_v:
        vh = head - num_q_heads - num_kv_heads
        dst = VC + blk * stride_vb + in_blk * stride_vp + vh * stride_vh
        tl.store(dst + offs, lo.to(VC.dtype.element_ty))
        tl.store(dst + HALF + offs, hi.to(VC.dtype.element_ty))
    else:
        if QK_NORM:
            inv = 1.0 / tl.sqrt((tl.sum(lo * lo, 0) + tl.sum(hi * hi, 0)) / (2 * HALF) + eps)
            lo = (lo * inv).to(QKV.dtype.element_ty).to(tl.float32) * w_lo
            hi = (hi * inv).to(QKV.dtype.element_ty).to(tl.float32) * w_hi
            lo = lo.to(QKV.dtype.element_ty).to(tl.float32)
            hi = hi.to(QKV.dtype.element_ty).to(tl.float32)
        out_lo = lo * cos - hi * sin
        out_hi = hi * cos + lo * sin
        if is_q:
            dst = Q + tok * stride_qt + head * stride_qh
            tl.store(dst + offs, out_lo.to(Q.dtype.element_ty))
            tl.store(dst + HALF + offs, out_hi.to(Q.dtype.element_ty))
        else:
            kh = head - num_q_heads
            dst = KC + blk * stride_kb + in_blk * stride_kp + kh * stride_kh
            tl.store(dst + offs, out_lo.to(KC.dtype.element_ty))
            tl.store(dst + HALF + offs, out_hi.to(KC.dtype.element_ty))


def qk_norm_rope_store(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor, sin: torch.Tensor,  # [P, D] float32 (rotate-half tables)
    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,  # [D] RMSNorm weights (Qwen3) or None
    eps: float,
    slot_mapping: torch.Tensor,  # [T] int64
    k_cache: torch.Tensor, v_cache: torch.Tensor,  # [num_blocks, page, Hkv, D]
    num_q_heads: int, num_kv_heads: int, head_dim: int,
) -> torch.Tensor:  # q [T, Hq, D]
    t = qkv.shape[0]
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"qk_norm_rope_store needs a power-of-two head_dim, got {head_dim}")
    q = torch.empty(t, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t:
        norm = q_norm is not None
        wait = attention_waits(qkv, t)  # launched early, waiting on the qkv product (kernels/pdl.py)
        _qk_norm_rope_store_kernel[(t, num_q_heads + 2 * num_kv_heads)](
            qkv, positions, cos, sin, q_norm if norm else cos, k_norm if norm else cos, slot_mapping, q,
            k_cache, v_cache, num_q_heads, num_kv_heads, eps, k_cache.shape[1],
            qkv.stride(0), q.stride(0), q.stride(1), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            HALF=head_dim // 2, QK_NORM=norm, WAIT=wait, num_warps=1, **launch_kwargs(wait),
        )
    return q
