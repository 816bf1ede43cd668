"""benchmarks/gpu_gaps.py: a hand-built profiler trace whose gaps are known, so the report's attribution is
checked on the CPU (the GPU runs only produce such traces)."""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from gpu_gaps import gap_report  # noqa: E402


def _x(cat, name, ts, dur, tid=1, **args):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, pid=1, tid=tid, args=args)


def test_gaps_are_split_into_late_and_queued_and_named_by_the_launching_frames():
    ev = [
        _x("user_annotation", "profiled_call", 0, 100), _x("user_annotation", "profiled_call", 100, 100),
        # call 0 (left out): a kernel, then the GPU idles until call 1's first kernel
        _x("cuda_runtime", "cudaLaunchKernel", 5, 2, correlation=9), _x("kernel", "k0", 10, 10, tid=7, correlation=9),
        _x("python_function", "/repo/forerun/engine/round.py(10): run", 100, 100),
        _x("python_function", "/repo/forerun/engine/sampler.py(20): tree_finish", 120, 20),
        _x("python_function", "/repo/forerun/engine/sampler.py(20): tree_finish", 120, 20, tid=2),  # another thread
        _x("python_function", "torch/cuda/__init__.py(5): synchronize", 121, 2),  # not the repository's
        _x("cuda_runtime", "cudaGraphLaunch", 101, 2, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 125, 2, correlation=2),  # after k1 ended: late
        _x("cuda_runtime", "cudaLaunchKernel", 105, 2, correlation=3),  # long before k2 ended: queued
        _x("kernel", "k1", 100, 10, tid=7, correlation=1),
        _x("kernel", "k2", 130, 20, tid=7, correlation=2),
        _x("gpu_memcpy", "Memcpy DtoH", 135, 5, tid=7, correlation=2),  # inside k2's interval
        _x("kernel", "k3", 160, 10, tid=7, correlation=3),
    ]
    rep = gap_report(dict(traceEvents=ev), skip=1)
    assert rep["calls"] == 1
    assert rep["gpu_busy_us"] == 40 and rep["gpu_idle_us"] == 60
    assert rep["late_us"] == 20 and rep["queued_us"] == 10  # (the 80 us gap began in the left-out call)
    g = {x["kind"]: x for x in rep["groups"]}
    assert g["late"]["where"] == "engine/sampler.py:20 tree_finish < engine/round.py:10 run"
    assert g["late"]["us"] == 20 and g["late"]["count"] == 1
    assert g["queued"]["where"] == "engine/round.py:10 run" and g["queued"]["us"] == 10
    assert [(x["before"], x["us"], x["launch"]) for x in rep["last_call"]] == [
        ("k2", 20, "cudaLaunchKernel"), ("k3", 10, "cudaLaunchKernel")]
    assert rep["groups"][0]["kind"] == "late"  # largest first


def test_too_few_calls_report_nothing():
    assert gap_report(dict(traceEvents=[_x("user_annotation", "profiled_call", 0, 10)]), skip=1)["calls"] == 0


def test_work_outside_graphs_is_counted_by_site():
    ev = [
        _x("user_annotation", "profiled_call", 0, 100),
        _x("python_function", "/repo/forerun/engine/round.py(10): run", 0, 100),
        _x("cuda_runtime", "cudaGraphLaunch", 1, 2, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 3, 2, correlation=2),
        _x("cuda_runtime", "cudaMemcpyAsync", 4, 2, correlation=3),
        _x("kernel", "g1", 10, 30, tid=7, correlation=1), _x("kernel", "g2", 41, 9, tid=7, correlation=1),
        _x("kernel", "k", 53, 5, tid=7, correlation=2),
        _x("gpu_memcpy", "Memcpy DtoH", 60, 4, tid=7, correlation=3),
    ]
    o = gap_report(dict(traceEvents=ev))["outside_graphs"]
    assert o["count"] == 2 and o["busy_us"] == 9 and o["idle_before_us"] == 5
    assert {x["where"]: (x["busy_us"], x["idle_before_us"]) for x in o["sites"]} == {
        "engine/round.py:10 run [cudaLaunchKernel]": (5, 3), "engine/round.py:10 run [cudaMemcpyAsync]": (4, 2)}
