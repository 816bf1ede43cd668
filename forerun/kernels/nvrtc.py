"""CUDA C++ kernels compiled at run time with NVRTC, launched with `cuLaunchKernelEx` (for PDL).

Triton places its own layout work around inline PTX; where that bound a kernel (the int4 decode product,
kernels/q4_cuda.py) or where a kernel's structure does not map onto Triton's blocks (the decode attention with its
split merge in the same launch, attention/cuda_decode.py), forerun writes CUDA C++ and compiles it here, on first
use, with `torch.cuda._compile_kernel` (NVRTC ships with PyTorch's CUDA wheels: no toolkit needed). A module is
loaded per device. Launches go to the current stream, so CUDA graphs capture them like any other; with `pdl` the
launch may start while the kernel before it drains (the kernel then waits with `griddepcontrol.wait`; see
kernels/pdl.py).
"""
from __future__ import annotations

import ctypes

import torch

_kernels: dict[tuple, object] = {}
_state: dict[str, object] = {}


def available(t: torch.Tensor | None = None, min_major: int = 9) -> bool:
    """Whether NVRTC kernels can run on t's device (or the current one): CUDA, compute capability >= min_major
    (9 by default: the product and attention kernels use Hopper's griddepcontrol; the dequantization passes of
    kernels/q4_cuda.py need 8, for bf16 conversions), torch's `_compile_kernel`, and a first compilation that
    worked."""
    if not torch.cuda.is_available() or (t is not None and not t.is_cuda) or not hasattr(torch.cuda, "_compile_kernel"):
        return False
    if "ok" not in _state:
        try:
            _state["ok"] = kernel('extern "C" __global__ void forerun_probe(int* p) { if (p) *p = 1; }',
                                  "forerun_probe") is not None
        except Exception as e:  # no NVRTC library, an old driver: the Triton kernels serve
            _state["ok"], _state["why"] = False, f"{type(e).__name__}: {e}"
    index = t.device.index if t is not None and t.device.index is not None else torch.cuda.current_device()
    majors = _state.setdefault("majors", {})
    if index not in majors:
        majors[index] = torch.cuda.get_device_capability(index)[0]
    return bool(_state["ok"]) and majors[index] >= min_major


def why_not() -> str:
    return str(_state.get("why", "no CUDA device of compute capability >= 9 with NVRTC"))


def kernel(source: str, name: str):
    """The kernel `name` of `source`, compiled for the current device on first use."""
    key = (torch.cuda.current_device(), name, source)
    if key not in _kernels:
        _kernels[key] = torch.cuda._compile_kernel(source, name)
    return _kernels[key]


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: an id, padding, a 64-byte value union
    # (the union as ints: a c_char array field would read back as a bytes copy, and writing through it would
    # write into that Python object instead of the struct)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("numAttrs", ctypes.c_uint)]


_CLUSTER_DIMENSION = 4  # CUlaunchAttributeID
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


def pdl_attribute() -> _LaunchAttr:
    """The launch attribute that lets a kernel start while the one before it drains (PDL)."""
    attr = _LaunchAttr()
    attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    return attr


def launch(kern, grid: int | tuple[int, ...], block: int, smem: int, args: list, pdl: bool, cluster: int = 1) -> None:
    """cuLaunchKernelEx on the current stream (captured by CUDA graphs like any launch); with pdl the launch may
    overlap its predecessor's tail (the kernel waits with griddepcontrol.wait). cluster > 1: blocks in thread-block
    clusters of that many along x (Hopper; the grid's x a multiple of it; up to 8 is portable, 9-16 are allowed here
    as non-portable sizes, which Hopper schedules)."""
    lib = torch.cuda._utils._get_gpu_runtime_library()
    vals = []
    for a in args:  # tensors as pointers, Python ints as int32, ctypes values as they are (c_float, c_longlong)
        if isinstance(a, torch.Tensor):
            vals.append(ctypes.c_void_p(a.data_ptr()))
        elif isinstance(a, ctypes._SimpleCData):
            vals.append(a)
        elif isinstance(a, int) and not isinstance(a, bool) and -2 ** 31 <= a < 2 ** 31:
            vals.append(ctypes.c_int(a))
        else:
            raise TypeError(f"launch: argument {a!r}: pass a tensor, an int32 or a ctypes value")
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
    attrs = [pdl_attribute()] if pdl else []
    gx, gy, gz = (tuple(grid) + (1, 1))[:3] if isinstance(grid, tuple) else (grid, 1, 1)
    if cluster > 1:
        if gx % cluster:
            raise ValueError(f"launch: grid x {gx} is not a multiple of the cluster size {cluster}")
        c = _LaunchAttr()
        c.id = _CLUSTER_DIMENSION
        c.value[0], c.value[1], c.value[2] = cluster, 1, 1
        attrs.append(c)
        if cluster > 8 and not getattr(kern, "_non_portable", False):
            rc = lib.cuFuncSetAttribute(kern.func, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            if rc != 0:
                raise RuntimeError(f"cuFuncSetAttribute (non-portable cluster size) failed with CUresult {rc}")
            kern._non_portable = True
    arr = (_LaunchAttr * len(attrs))(*attrs) if attrs else None
    cfg = _LaunchConfig(gx, gy, gz, block, 1, 1, smem, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                        ctypes.cast(arr, ctypes.POINTER(_LaunchAttr)) if attrs else None, len(attrs))
    if smem >= 48 * 1024 and getattr(kern, "_max_shared_mem_bytes", 0) < smem:
        kern.set_shared_memory_config(smem)
    rc = lib.cuLaunchKernelEx(ctypes.byref(cfg), kern.func, params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")


