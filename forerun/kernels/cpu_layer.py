"""CPU layer kernels besides the matrix products (cpu_layer.c, float32): paged attention one query row at a time,
add + RMSNorm, Q/K norm + RoPE + the cache write, and silu(gate) * up, each one C call instead of ~2-15 small torch
ops; and `decoder_stack`, a run of whole decoder layers (those kernels and cpu_q4's int4 products) in one call.

Why: at batch 1 an int4 decode step of Qwen2.5-Coder-1.5B on 2 cores spent ~30 % of its time outside the matrix
products (attention 100-180 us, RoPE + cache write 70-100 us, the two add + RMSNorm 60-80 us per layer; measured
in docs/quantization.md). `forerun.models.cpu_ops.CpuLayerOps` (the CPU's `LayerOps`, set by the runner on float32
CPU models, through `add_rmsnorm_rows` and `qkv_rope_store`) and `attention_rows` (called by the reference
attention's CPU path) use them where `available()`; otherwise, and for other dtypes, the torch code runs as
before. Every output row is computed alone in an order fixed by that
row, so a row's result does not depend on the rows beside it (batch invariance, tests/test_batch_invariance.py).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .cbuild import lazy_library


def _declare(lib) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.attn_rows.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, i64]
    lib.add_rmsnorm.argtypes = [p, p, p, f32, p, p, i64, i64]
    lib.qkv_rope_store.argtypes = [p, p, p, p, p, p, f32, p, p, p, p, i64, i64, i64, i64]
    lib.silu_mul.argtypes = [p, p, i64, i64]
    lib.decoder_stack.argtypes = [p, p, i64, p, p, ctypes.c_int, i64, i64, i64, i64, i64, i64, p, p, p, p, p, p, p,
                                  i64, f32, p, p, p, ctypes.c_int, p, p, p, p, p, p, p, p, p]
    for f in (lib.attn_rows, lib.add_rmsnorm, lib.qkv_rope_store, lib.silu_mul, lib.decoder_stack):
        f.restype = None
    lib.attn_rows_blocked.argtypes = [ctypes.c_int]  # (the items of rows on or off, both builds; benchmarks)
    lib.attn_rows_blocked.restype = ctypes.c_int


# -ffp-contract=off: a * b + c rounded twice, as torch's separate ops round it
_load = lazy_library(Path(__file__).with_name("cpu_layer.c"), ["-ffp-contract=off"], _declare)


def available() -> bool:
    return _load() is not None


def _ptr(t: torch.Tensor | None) -> int | None:  # (a plain int: ctypes converts it for the c_void_p argtypes)
    return None if t is None else t.data_ptr()


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


def add_rmsnorm_rows(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rmsnorm(x + residual) * weight, x + residual) for float32 rows x [T, H] (residual None: s = x) in one C call;
    None where the C code cannot take them (not float32 / contiguous / CPU, or the library did not build)."""
    if not (_load() is not None and x.dim() == 2 and _ok(x, weight) and (residual is None or _ok(residual))):
        return None
    t, h = x.shape
    s = torch.empty_like(x) if residual is not None else x
    y = torch.empty_like(x)
    _load().add_rmsnorm(_ptr(x), _ptr(residual), _ptr(weight), eps, _ptr(s), _ptr(y), t, h)
    return y, s


def qkv_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, slots: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor | None:
    """Q/K norm (weights None: none) + RoPE of the fused qkv rows [T, (Hq + 2 Hkv) D], the keys and values written
    at `slots` of the layer's caches; returns q [T, Hq, D]. None where the C code cannot take them."""
    if not (_load() is not None and head_dim % 2 == 0 and head_dim <= 1024 and qkv.dim() == 2
            and _ok(qkv, cos, sin, k_cache, v_cache) and positions.dtype == torch.int64
            and slots.dtype == torch.int64 and positions.is_contiguous() and slots.is_contiguous()
            and positions.device.type == "cpu" and (q_weight is None or _ok(q_weight, k_weight))):
        return None
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype)
    _load().qkv_rope_store(_ptr(qkv), _ptr(positions), _ptr(cos), _ptr(sin), _ptr(q_weight), _ptr(k_weight), eps,
                           _ptr(slots), _ptr(k_cache), _ptr(v_cache), _ptr(q), t, num_heads, num_kv_heads, head_dim)
    return q


def silu_mul_rows(gu: torch.Tensor) -> torch.Tensor | None:
    """gu [T, 2 I] float32 (gate, then up) -> silu(gate) * up [T, I] in one C call (its own exp, ~1 ulp from torch's
    silu); None where the C code cannot take it."""
    if _load() is None or gu.dim() != 2 or gu.shape[1] % 2 or not _ok(gu):
        return None
    t, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(t, inter, dtype=gu.dtype)
    _load().silu_mul(_ptr(gu), _ptr(out), t, inter)
    return out


# the columns of decoder_stack's layer table (cpu_layer.c's L_* order): addresses, 0 for none
STACK_FIELDS = ("ln1", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "ln2", "gate_up", "gate_up_bias", "down",
                "down_bias", "k_cache", "v_cache", "int8")  # int8: bits 1, 2, 4, 8 = qkv, o, gate_up, down are Q8Linear


def decoder_stack(table: torch.Tensor, eps: torch.Tensor, h: torch.Tensor, res: torch.Tensor | None,
                  dims: tuple[int, int, int, int, int], positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  slots: torch.Tensor, plan: tuple, scale: float, act_scratch: tuple[int, int],
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """len(table) decoder layers in one C call: table [L, len(STACK_FIELDS)] int64 addresses (the products in
    cpu_q4's int4 or int8 layout), eps [L, 3] float32 (input norm, post-attention norm, Q/K norm); h [T, H] (not
    modified) and the residual (None before the first layer); dims (H, Hq, Hkv, D, I); plan the row attention's
    (keys, off, lens, maxlen); act_scratch (bytes, floats) per row of cpu_q4's activation codes for the widest
    input. Returns (h, residual) after the last layer. The caller checks what the C calls need
    (cpu_ops.CpuLayerOps._stack_ok and _in_c)."""
    from . import cpu_q4

    q4 = cpu_q4._load()
    hid, hq, hkv, d, inter = dims
    t = h.shape[0]
    out = h.clone()
    r = torch.empty_like(h) if res is None else res.clone()
    keys, off, lens, maxlen = plan
    f = lambda *shape: torch.empty(*shape, dtype=torch.float32)  # noqa: E731
    x, qkv, gu, act = f(t, hid), f(t, (hq + 2 * hkv) * d), f(t, 2 * inter), f(t, inter)
    q, att = f(t, hq * d), f(t, hq * d)
    xq, xs, isum = torch.empty(t, act_scratch[0], dtype=torch.int8), f(t, act_scratch[1]), f(t, act_scratch[1])
    fn = lambda name: ctypes.cast(getattr(q4, name), ctypes.c_void_p).value  # noqa: E731
    _load().decoder_stack(_ptr(table), _ptr(eps), table.shape[0], _ptr(out), _ptr(r), int(res is not None), t, hid, hq,
                          hkv, d, inter, _ptr(positions), _ptr(cos), _ptr(sin), _ptr(slots), _ptr(keys), _ptr(off),
                          _ptr(lens), max(maxlen, 1), scale, fn("q4_quant_act"), fn("q4_gemm"), fn("q8_gemm"),
                          torch.get_num_threads(),
                          _ptr(x), _ptr(qkv), _ptr(q), _ptr(att), _ptr(gu), _ptr(act), _ptr(xq), _ptr(xs), _ptr(isum))
    return out, r
