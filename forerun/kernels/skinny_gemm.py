"""Skinny matrix products y = x @ W^T for decode and verification steps (x has 1..16 rows), in Triton.

At batch 1 a decode step reads every weight once and does two FLOPs per weight, so a linear layer is a
stream over W. cuBLAS picks kernels for large M; on the H200 its M=1 kernels reached only 63-80 % of copy
bandwidth on the narrow matrices of an 8B model (o_proj, qkv, down). Here one program owns BLOCK_N rows of W
and walks K in BLOCK_K steps (every weight read exactly once, 16-byte loads along K), so the grid is
N / BLOCK_N programs and nothing is reduced across programs.

Two inner products (the tuning picks one per shape and row count):
  * USE_DOT=False: x rows are broadcast against the W tile and summed on the CUDA cores (up to 4 rows);
  * USE_DOT=True: tl.dot on a [16, BLOCK_K] x tile (rows past M are masked), for 1..16 rows; the W tiles are
    software-pipelined through shared memory, which is what streams the large matrices fastest.
Epilogues fused into the same pass: bias and SwiGLU (`glu=True`: W holds the gate rows, then the up rows; the
program reads both and writes silu(gate) * up, so the [M, 2I] activation never exists). Accumulation is in
float32; the output is rounded once.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import enabled as pdl_enabled, gdc_launch_dependents, gdc_wait, launch_kwargs


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of the skinny GEMM."""

    block_n: int
    block_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 3


CONFIG_FILE = os.path.join(os.path.dirname(__file__), "skinny_configs.json")


def config_key(m: int, n: int, k: int, glu: bool) -> str:
    """Table key: rows rounded up to a power of two, output features, input features, SwiGLU or not."""
    return f"m{triton.next_power_of_2(m)}_n{n}_k{k}" + ("_glu" if glu else "")


def load_configs(device_name: str) -> dict[str, GemmConfig | None]:
    """The tuned table for one card (written by benchmarks/skinny_gemm.py): key -> config, or None where cuBLAS
    was faster. Empty for cards that were never tuned."""
    if not os.path.exists(CONFIG_FILE):
        return {}
    with open(CONFIG_FILE) as f:
        entries = json.load(f).get(device_name, {})
    fields = ("block_n", "block_k", "use_dot", "num_warps", "num_stages")
    return {key: GemmConfig(*(e[f] for f in fields)) if e["us"] < e["cublas_us"] else None
            for key, e in entries.items()}


def default_config(m: int, n: int, k: int, itemsize: int = 2) -> GemmConfig:
    """For shapes, cards and dtypes not in the table (it is tuned for 2-byte activations): the pattern of the
    H200 table (CUDA-core tiles of 4-8 rows of W for matrices under 32M weights at 1-2 rows, pipelined 32-row
    tensor-core tiles otherwise), with fewer pipeline stages for float32 so the tiles fit in shared memory."""
    bk = triton.next_power_of_2(k)
    if m <= 2 and n * k <= (1 << 25):
        return GemmConfig(block_n=8 if n >= 4096 else 4, block_k=min(1024, bk), use_dot=False, num_warps=4,
                          num_stages=3)
    return GemmConfig(block_n=32, block_k=min(256, bk), use_dot=True, num_warps=4, num_stages=4 if itemsize <= 2 else 2)


@triton.jit
def _skinny_gemm_kernel(
    X, W, Bias, Y,  # X [M, K], W [N or 2N (GLU), K], Bias [N], Y [M, N]
    M, N,
    stride_xm, stride_wn, stride_ym,
    K: tl.constexpr,  # a compile-time constant: the loop count is known and the K mask folds away
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for float32 inputs (no TF32), else "tf32" (unused)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py): start while the kernel before drains
):
    if PDL:  # the next kernel (a norm, attention, another product) may launch once every program has started
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    w_ptr = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BN, BK]
    u_ptr = w_ptr + N.to(tl.int64) * stride_wn  # GLU: the up rows sit N rows below the gate rows
    x_ptr = X + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    if PDL:  # X is written by the kernel before: its launch, this grid's ramp and the setup above overlap its tail
        gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        k_ok = (offs_k + k0) < K  # all true when BLOCK_K divides K (constant-folded)
        w = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        if GLU:
            u = tl.load(u_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if USE_DOT:
                acc_u += tl.dot(x, tl.trans(u), input_precision=PRECISION)
            else:
                acc_u += x.to(tl.float32)[:, None, :] * u.to(tl.float32)[None, :, :]
            u_ptr += BLOCK_K
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    if USE_DOT:
        y = acc
        y_u = acc_u
    else:
        y = tl.sum(acc, 2)
        y_u = tl.sum(acc_u, 2)
    if HAS_BIAS:
        y += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GLU:
        y = y / (1.0 + tl.exp(-y)) * y_u
    out_ok = m_ok[:, None] & n_ok[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty), mask=out_ok)


MAX_ROWS = 16
# Launch with PDL (kernels/pdl.py) where supported: off. On the H200 (benchmarks/pdl_gpu.py) it moved a step by
# -2.6 .. +0.8 % (0.6B and 8B shapes, batch 1 and 4, q = 1 and 5), and by +7 % at batch 1 with the norms waiting too.
USE_PDL = [False]


def skinny_linear(
    x: torch.Tensor,  # [M, K], M <= 16
    weight: torch.Tensor,  # [N, K] (glu: [2N, K], gate rows then up rows)
    bias: torch.Tensor | None = None,  # [N]
    glu: bool = False,
    out_dtype: torch.dtype | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [M, N]
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1..{MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must share a contiguous K")
    if glu and bias is not None:
        raise ValueError("skinny_linear: glu with a bias is not supported")
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    cfg = config or default_config(m, n, k, x.element_size())
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    block_m = 16 if cfg.use_dot else triton.next_power_of_2(m)
    grid = (triton.cdiv(n, cfg.block_n),)
    pdl = USE_PDL[0] and pdl_enabled(x)
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, y,
        m, n, x.stride(0), weight.stride(0), y.stride(0),
        K=k, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
        HAS_BIAS=bias is not None, GLU=glu, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(pdl),
    )
    return y
