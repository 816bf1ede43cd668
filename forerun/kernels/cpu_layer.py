"""CPU layer kernels besides the matrix products (cpu_layer.c, float32): paged attention one query row at a time,
add + RMSNorm, and Q/K norm + RoPE + the cache write, each one C call instead of ~5-15 small torch ops.

Why: at batch 1 an int4 decode step of Qwen2.5-Coder-1.5B on 2 cores spent ~30 % of its time outside the matrix
products (attention 100-180 us, RoPE + cache write 70-100 us, the two add + RMSNorm 60-80 us per layer; measured
in docs/quantization.md). `CpuLayerOps` (the CPU's `LayerOps`, set by the runner on float32 CPU models) and
`attention_rows` (called by the reference attention's CPU path) use them where `available()`; otherwise, and
for other dtypes, the torch code runs as before. Every output row is computed alone in an order fixed by that
row, so a row's result does not depend on the rows beside it (batch invariance, tests/test_batch_invariance.py).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..models.ops import LayerOps
from .cbuild import AVX512_FLAGS, lazy_library


def _declare(lib) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.attn_rows.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, i64]
    lib.add_rmsnorm.argtypes = [p, p, p, f32, p, p, i64, i64]
    lib.qkv_rope_store.argtypes = [p, p, p, p, p, p, f32, p, p, p, p, i64, i64, i64, i64]
    for f in (lib.attn_rows, lib.add_rmsnorm, lib.qkv_rope_store):
        f.restype = None


# -ffp-contract=off: a * b + c rounded twice, as torch's separate ops round it
_load = lazy_library(Path(__file__).with_name("cpu_layer.c"), [*AVX512_FLAGS, "-ffp-contract=off"], _declare)


def available() -> bool:
    return _load() is not None


def _ptr(t: torch.Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _ok(*ts) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in ts)


def attention_rows(qs: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, keys: torch.Tensor, off: torch.Tensor,
                   lens: torch.Tensor, maxlen: int) -> torch.Tensor | None:
    """qs [T, Hq, D] (scaled queries), kf / vf [S, Hkv, D] (the layer's cache by slot), keys int64 (each row's
    visible key slots in position order, row r at off[r] .. off[r] + lens[r]) -> [T, Hq, D], or None where the C
    kernel cannot run (the caller keeps its torch path)."""
    if _load() is None or not _ok(qs, kf, vf):
        return None
    t, hq, d = qs.shape
    out = torch.empty_like(qs)
    _load().attn_rows(_ptr(qs), _ptr(kf), _ptr(vf), _ptr(keys), _ptr(off), _ptr(lens), _ptr(out), t, hq, kf.shape[1],
                   d, max(maxlen, 1))
    return out


class CpuLayerOps(LayerOps):
    """LayerOps on float32 CPU tensors through cpu_layer.c (add + RMSNorm; Q/K norm + RoPE + cache write); the
    matrix products stay the layers' own (oneDNN / the int4 kernel). Anything else falls back to LayerOps."""

    def add_rmsnorm(self, x, residual, norm):
        if not (_load() is not None and x.dim() == 2 and _ok(x, norm.weight)
                and (residual is None or _ok(residual))):
            return super().add_rmsnorm(x, residual, norm)
        t, h = x.shape
        s = torch.empty_like(x) if residual is not None else x
        y = torch.empty_like(x)
        _load().add_rmsnorm(_ptr(x), _ptr(residual), _ptr(norm.weight), norm.eps, _ptr(s), _ptr(y), t, h)
        return y, s

    def qkv_to_cache(self, qkv, positions, rope, q_norm, k_norm, layer, meta, kv, num_heads, num_kv_heads, head_dim):
        kc, vc = kv.k[layer], kv.v[layer]
        if not (_load() is not None and head_dim % 2 == 0 and head_dim <= 1024 and qkv.dim() == 2
                and _ok(qkv, rope.cos, rope.sin, kc, vc) and positions.dtype == torch.int64
                and meta.slot_mapping.dtype == torch.int64 and positions.is_contiguous()
                and meta.slot_mapping.is_contiguous() and positions.device.type == "cpu"
                and (q_norm is None or (_ok(q_norm.weight, k_norm.weight) and q_norm.eps == k_norm.eps))):
            return super().qkv_to_cache(qkv, positions, rope, q_norm, k_norm, layer, meta, kv, num_heads,
                                        num_kv_heads, head_dim)
        t = qkv.shape[0]
        q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype)
        _load().qkv_rope_store(_ptr(qkv), _ptr(positions), _ptr(rope.cos), _ptr(rope.sin),
                            _ptr(None if q_norm is None else q_norm.weight),
                            _ptr(None if k_norm is None else k_norm.weight),
                            q_norm.eps if q_norm is not None else 0.0, _ptr(meta.slot_mapping), _ptr(kc), _ptr(vc),
                            _ptr(q), t, num_heads, num_kv_heads, head_dim)
        return q
