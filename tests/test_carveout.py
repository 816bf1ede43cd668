"""benchmarks/gpu.py's shared-memory carveout helpers (session 55's test of one L1 / shared split for every
kernel): which kernels they find (CPU), and that the attribute set is the one the driver reads back (CUDA)."""
import os
import sys
import types

import pytest
import torch

triton = pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import gpu as G  # noqa: E402


def _module_with_kernels(tmp_path, name: str):
    """A module whose file lies under tmp_path holding a plain and a wrapped (autotuner-like) Triton kernel, each
    with one compiled kernel in its device cache (a stand-in object with a CUfunction handle)."""
    from triton.runtime.jit import JITFunction  # (not triton.jit: the CPU tests set TRITON_INTERPRET=1)

    def plain_kernel(x):
        pass

    def tuned_kernel(x):
        pass

    plain_kernel, tuned_kernel = JITFunction(plain_kernel), JITFunction(tuned_kernel)
    plain_kernel.device_caches = {0: ({"key": types.SimpleNamespace(function=1111)}, None)}
    tuned_kernel.device_caches = {0: ({"a": types.SimpleNamespace(function=2222),
                                       "b": types.SimpleNamespace(function=None)}, None)}  # b: not loaded yet
    mod = types.ModuleType(name)
    mod.__file__ = str(tmp_path / f"{name}.py")
    mod.plain_kernel = plain_kernel
    mod.tuned = types.SimpleNamespace(fn=types.SimpleNamespace(fn=tuned_kernel))  # Heuristics(Autotuner(jit))
    mod.alias = plain_kernel  # the same kernel twice: listed once
    mod.other = types  # modules and classes are not searched through
    return mod


def test_kernel_functions_lists_the_compiled_triton_kernels_of_modules_under_the_roots(tmp_path, monkeypatch):
    mod = _module_with_kernels(tmp_path, "carveout_fake_kernels")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    found = [f for f in G.kernel_functions((str(tmp_path) + "/",)) if f[1] in (1111, 2222)]
    assert sorted(found) == [("plain_kernel", 1111), ("tuned_kernel", 2222)]
    # a module outside the roots is not searched
    assert not [f for f in G.kernel_functions((str(tmp_path / "elsewhere") + "/",)) if f[1] in (1111, 2222)]
    # forerun's and the benchmarks' modules are the default roots: the fake module is not among them
    assert not [f for f in G.kernel_functions() if f[1] in (1111, 2222)]


def test_set_carveout_refuses_a_percentage_out_of_range():
    for bad in (101, -2):
        with pytest.raises(ValueError, match="percentage"):
            G.set_carveout(bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (run on the GPU machine)")
def test_set_carveout_sets_the_attribute_the_driver_reads_back():
    import ctypes

    from forerun.kernels import nvrtc
    kern = nvrtc.kernel('extern "C" __global__ void carveout_probe(int* p) { if (p) *p = 2; }', "carveout_probe")
    lib = torch.cuda._utils._get_gpu_runtime_library()

    def read() -> int:
        v = ctypes.c_int(0)
        assert lib.cuFuncGetAttribute(ctypes.byref(v), ctypes.c_int(9), kern.func) == 0
        return v.value

    try:
        assert G.set_carveout(100) >= 1 and read() == 100
        assert G.set_carveout(37) >= 1 and read() == 37
    finally:
        G.set_carveout(-1)
    assert read() == -1
