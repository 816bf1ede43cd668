"""Build a C source file of forerun/kernels into a shared library with the system compiler, once, cached by the
hash of its source and flags under <cache_dir()>/kernels (forerun/paths.py), and load it with ctypes.

Used by the CPU kernels (cpu_q4.c: int4 products; cpu_layer.c: attention, norms, RoPE). Each source has up to
three builds, picked by what the CPU has (`isa()`): "avx512amx" (the next one plus AMX tiles and int8 products:
Intel since Sapphire Rapids; cpu_q4.c's many-row int4 path, behind `#ifdef __AMX_INT8__`), "avx512" (AVX-512
F/BW/VL + VNNI: Intel since Cascade Lake, AMD since Zen 4) and "avx2" (AVX2 + FMA + F16C: nearly every x86-64 CPU
since 2013, AMD Zen 1-3 among them); the sources hold the paths behind `#ifdef __AVX512VNNI__`.
FORERUN_CPU_ISA=avx2 (or avx512) takes that build on a CPU that has more (tests, comparisons). Returns None where
no build can run: no gcc, a CPU with neither set, FORERUN_NO_CPU_KERNELS set, or
a failed compile; callers then keep their torch path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..paths import cache_dir

# -fopenmp: the .so needs libgomp.so.1, which resolves to the copy torch already loaded (same soname), so the
# kernels' threads are torch's OpenMP threads and torch.set_num_threads applies to both.
_COMMON = ["-O3", "-fopenmp", "-shared", "-fPIC"]
# ISA -> (compiler flags, /proc/cpuinfo features it needs), best first
ISAS = {
    "avx512amx": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma", "-mamx-tile",
                   "-mamx-int8"],
                  ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma", "amx_tile", "amx_int8")),
    "avx512": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"],
               ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")),
    "avx2": (["-mavx2", "-mf16c", "-mfma"], ("avx2", "f16c", "fma")),
}


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, read once (every 8-bit linear built at load asks, quant.int8_activation_range)."""
    try:
        return frozenset(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return frozenset()


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it ("?" where it does not): the benchmarks' JSON records it."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "?"


def cpu_ok(features) -> bool:
    flags = _cpu_flags()
    return bool(flags) and all(f in flags for f in features)


def isa() -> str | None:
    """The instruction set the C kernels are built for on this CPU ("avx512", "avx2"), or None where neither runs.
    FORERUN_CPU_ISA names one (it must be supported; an unknown or unsupported name is an error)."""
    want = os.environ.get("FORERUN_CPU_ISA")
    if want:
        if want not in ISAS:
            raise ValueError(f"FORERUN_CPU_ISA must be one of {', '.join(ISAS)}, got {want!r}")
        if not cpu_ok(ISAS[want][1]):
            raise ValueError(f"FORERUN_CPU_ISA={want}: this CPU lacks {', '.join(ISAS[want][1])}")
        return want
    return next((name for name, (_, feats) in ISAS.items() if cpu_ok(feats)), None)


def lazy_library(src: Path, extra_flags: list[str], declare) -> "callable":
    """A loader for one C library, built for `isa()` with `extra_flags`: the first call builds / loads it and runs
    declare(lib) (its ctypes signatures); every call returns the library, or None where it cannot run."""
    state: list = []

    def load() -> ctypes.CDLL | None:
        if not state:
            target = None if os.environ.get("FORERUN_NO_CPU_KERNELS") else isa()
            state.append(None if target is None else library_for(src, target, extra_flags, declare))
        return state[0]

    return load


def library_for(src: Path, name: str, extra_flags: list[str], declare) -> ctypes.CDLL | None:
    """The library of `src` built for the ISA `name` (tests compare the builds a CPU can run), or None."""
    if not cpu_ok(ISAS[name][1]):
        return None
    lib = load_c_library(src, [*_COMMON, *ISAS[name][0], *extra_flags])
    if lib is not None:
        declare(lib)
    return lib


def load_c_library(src: Path, flags: list[str]) -> ctypes.CDLL | None:
    if shutil.which("gcc") is None:
        return None
    code = src.read_bytes()
    tag = hashlib.sha256(code + " ".join(flags).encode()).hexdigest()[:16]
    cache = cache_dir() / "kernels"
    so = cache / f"{src.stem}-{tag}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / so.name
            r = subprocess.run(["gcc", *flags, str(src), "-o", str(out)], capture_output=True, text=True)
            if r.returncode:
                return None
            os.replace(out, so)  # atomic: concurrent processes see a whole file or none
    return ctypes.CDLL(str(so))
