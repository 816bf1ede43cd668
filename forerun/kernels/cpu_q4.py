"""CPU int4 x int8 GEMM (AVX512-VNNI), built from cpu_q4.c with the system C compiler on first use.

Why: CPU decode is bound by the bytes of weights streamed per token. torch has no fast x86 kernel for 4-bit
weights (``_weight_int4pack_mm_for_cpu`` is compute-bound, see docs/quantization.md), so the int8 layout
streams 1 byte per weight. This kernel streams GGUF Q4 weights as they are (codes + fp16 group scale and
offset: 5 bits per weight) with llama.cpp's recipe: activations quantized per 32 values to int8, integer dot
products (VNNI), one float multiply-add per group. Each output is computed alone in a fixed order, so a row's
result is bit-identical whatever the number of rows (batch invariance, tests/test_batch_invariance.py).

`available()` is False (and the int8 layout is used instead) without gcc, AVX512-VNNI/BW, or F16C.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

_SRC = Path(__file__).with_name("cpu_q4.c")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma", "-shared", "-fPIC"]
_lib = None
_tried = False


def _cpu_ok() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"))


def _load():
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("FORERUN_NO_CPU_KERNELS") or not _cpu_ok() or shutil.which("gcc") is None:
        return None
    src = _SRC.read_bytes()
    tag = hashlib.sha256(src + " ".join(_FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("FORERUN_CACHE", Path.home() / ".cache" / "forerun")) / "kernels"
    so = cache / f"cpu_q4-{tag}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / so.name
            r = subprocess.run(["gcc", *_FLAGS, str(_SRC), "-o", str(out)], capture_output=True, text=True)
            if r.returncode:
                return None
            os.replace(out, so)  # atomic: concurrent processes see a whole file or none
    lib = ctypes.CDLL(str(so))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.q4_gemm.argtypes = [p, p, p, i64, i64, p, p, p, i64, p, i64, i64]
    lib.q4_gemm.restype = None
    _lib = lib
    return lib


def available() -> bool:
    return _load() is not None


def pack_weights(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] codes 0..15 (K % 128 == 0), scale / offset [N, K/32] -> (packed [N, K/2] uint8, scale fp16,
    offset fp16); per 128-weight block (4 groups), byte 16 g + j holds weights j (low nibble) and 16 + j (high
    nibble) of group g."""
    n, k = q.shape
    c = q.to(torch.uint8).view(n, k // 128, 4, 2, 16)
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return packed, scale.to(torch.float16).contiguous(), offset.to(torch.float16).contiguous()


def _kernel_order(xq: torch.Tensor) -> torch.Tensor:
    """[M, K] -> [M, K] in the kernel's order: per 128 block, the first 16 values of its 4 groups, then the last 16."""
    m, k = xq.shape
    return xq.view(m, k // 128, 4, 2, 16).transpose(2, 3).reshape(m, k)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (xq [M, K] int8 in the kernel's order, xs_lanes [M, K/128, 16] float32, xsum [M, K/32]
    float32): symmetric int8 with one scale per 32 values (as llama.cpp's Q8 activations); a value's code
    depends on its own group only (batch-invariant)."""
    m, k = x.shape
    g = x.float().view(m, k // 32, 32)
    xs = g.abs().amax(-1).clamp_min_(1e-30).div_(127.0)  # [M, G]
    xq = torch.round(g / xs[..., None]).to(torch.int8)  # [M, G, 32]
    xsum = xq.sum(-1, dtype=torch.int32).float().mul_(xs)  # [M, G]: exact integer sum, one rounding
    lanes = xs.view(m, k // 128, 4, 1).expand(m, k // 128, 4, 4).reshape(m, k // 128, 16).contiguous()
    return _kernel_order(xq.view(m, k)), lanes, xsum


_pool = None


def _run(lib, args: tuple, n: int, threads: int) -> None:
    """Split the output rows over `threads` host threads (ctypes drops the GIL); each output is computed the
    same way whatever the split."""
    global _pool
    if threads <= 1 or n < 256:
        lib.q4_gemm(*args, 0, n)
        return
    if _pool is None or _pool._max_workers < threads - 1:
        from concurrent.futures import ThreadPoolExecutor

        _pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="forerun-q4")
    step = -(-n // threads // 16) * 16
    futs = [_pool.submit(lib.q4_gemm, *args, lo, min(n, lo + step)) for lo in range(step, n, step)]
    lib.q4_gemm(*args, 0, min(n, step))
    for f in futs:
        f.result()


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [M, K] float -> [M, N] float32 = x W^T with W = codes * scale + offset per 32, x as int8 per 32."""
    lib = _load()
    m, k = x.shape
    n = packed.shape[0]
    xq, lanes, xsum = quantize_activations(x)
    y = torch.empty(m, n, dtype=torch.float32)
    _run(lib, (packed.data_ptr(), scale.data_ptr(), offset.data_ptr(), n, k, xq.data_ptr(), lanes.data_ptr(),
               xsum.data_ptr(), m, y.data_ptr()), n, torch.get_num_threads())
    return y
