"""Programmatic dependent launch (PDL, Hopper and later): a kernel may start while the one before it drains.

Decode at batch 1 is a chain of ~300 short kernels, and each one pays a launch and a ramp-up (~2-3 us on the
H200) during which the memory system idles. With PDL a kernel launched with `launch_pdl=True` is scheduled as
soon as every program of the kernel before it has called `gdc_launch_dependents()` (or exited); it issues the
loads that do not depend on its predecessor (the weights of a matrix product) and then calls `gdc_wait()`,
which returns once the predecessor has finished and its writes are visible. Both calls are no-ops in a kernel
launched without PDL, so a kernel can always trigger; only kernels that wait are launched with PDL.

`enabled(t)` says whether to use it for a launch on tensor t's device (CUDA, compute capability >= 9, a Triton
with grid-dependency control, not the CPU interpreter, and not switched off with FORERUN_PDL=0 or `set_enabled`).
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton: plain launches
    _HAVE_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


def _launch_option() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        return "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}
    except Exception:  # pragma: no cover
        return False


_switch = [os.environ.get("FORERUN_PDL", "1") != "0"]
_capable: dict[int, bool] = {}


def set_enabled(on: bool) -> None:
    """Turn PDL launches on or off from now on (benchmarks compare both; captured graphs keep what they had)."""
    _switch[0] = on


def enabled(t: torch.Tensor) -> bool:
    if not (_switch[0] and t.is_cuda and _HAVE_GDC) or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if dev not in _capable:
        _capable[dev] = torch.cuda.get_device_capability(dev)[0] >= 9 and _launch_option()
    return _capable[dev]


def launch_kwargs(on: bool) -> dict:
    """Keyword arguments for a kernel launch that waits on its predecessor (launch_pdl only where Triton has it)."""
    return {"launch_pdl": True} if on else {}


# The attention chain launched with PDL too: Q/K norm + RoPE + KV write, the split attention kernel and its merge
# each wait on the kernel before instead of starting after it, and fetch first what does not depend on it (RoPE's
# positions, cos / sin rows and norm weights; attention's block table and the first tile of keys and values that
# were cached before the step). On for steps of at most ATTENTION_ROWS tokens (a decode step at batch 1): measured
# on the H200 (benchmarks/pdl_attention_gpu.py, docs/performance.md "Session 30"), the random 8B-shape int4 decode
# step went 1.948 -> 1.783 ms, the bf16 one 4.407 -> 4.347 ms and the 0.6B one 1.012 -> 0.989 ms, while steps of
# 4-20 tokens ran up to 5 % slower (14 % once). FORERUN_PDL_ATTENTION=0 turns it off.
# What may be read before a wait: only what no kernel launched with PDL writes. The step's metadata (query starts,
# lengths, block tables, slots, positions) comes from ordinary launches (copies, torch ops, EAGLE's extend_rows /
# select_step), and every forward starts with the embedding, an ordinary launch that waits for all work before it
# (earlier forwards, a tree round's KV moves). Inside a forward only layer L's RoPE writes layer L's cache, at the
# step's own positions (>= the cached prefix), which the attention kernel reads after its wait. (Steps of several
# sequences can pad with sequences living in block 0, whose RoPE writes may race with another padding sequence's
# early reads there: harmless for real rows, and such steps do not wait with the default ATTENTION_ROWS = 1.)
ATTENTION_ROWS = 1
_attention = [os.environ.get("FORERUN_PDL_ATTENTION", "1") != "0", ATTENTION_ROWS]


def set_attention_waits(on: bool, max_rows: int = ATTENTION_ROWS) -> None:
    """Launch the attention chain with PDL from now on, for steps of at most max_rows tokens (benchmarks compare
    settings; captured graphs keep what they had)."""
    _attention[:] = [on, max_rows]


def attention_waits(t: torch.Tensor, rows: int) -> bool:
    """Whether the attention chain's kernels for a step of `rows` tokens on t's device wait on their predecessor."""
    return _attention[0] and rows <= _attention[1] and enabled(t)
