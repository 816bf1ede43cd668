"""Build a C source file of forerun/kernels into a shared library with the system compiler, once, cached by the
hash of its source and flags under ~/.cache/forerun/kernels (FORERUN_CACHE), and load it with ctypes.

Used by the CPU kernels (cpu_q4.c: int4 products; cpu_layer.c: attention, norms, RoPE). Returns None where they
cannot run: no gcc, a CPU without the instruction sets the flags ask for, FORERUN_NO_CPU_KERNELS set, or a failed
compile; callers then keep their torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# -fopenmp: the .so needs libgomp.so.1, which resolves to the copy torch already loaded (same soname), so the
# kernels' threads are torch's OpenMP threads and torch.set_num_threads applies to both.
AVX512_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma", "-fopenmp",
                "-shared", "-fPIC"]
CPU_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")


def cpu_ok(features=CPU_FEATURES) -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return all(f in flags for f in features)


def lazy_library(src: Path, flags: list[str], declare) -> "callable":
    """A loader for one C library: the first call builds / loads it and runs declare(lib) (its ctypes signatures);
    every call returns the library, or None where it cannot run."""
    state: list = []

    def load() -> ctypes.CDLL | None:
        if not state:
            lib = load_c_library(src, flags)
            if lib is not None:
                declare(lib)
            state.append(lib)
        return state[0]

    return load


def load_c_library(src: Path, flags: list[str]) -> ctypes.CDLL | None:
    if os.environ.get("FORERUN_NO_CPU_KERNELS") or not cpu_ok() or shutil.which("gcc") is None:
        return None
    code = src.read_bytes()
    tag = hashlib.sha256(code + " ".join(flags).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("FORERUN_CACHE", Path.home() / ".cache" / "forerun")) / "kernels"
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
