"""Where the GPU waits, and for what: a torch.profiler trace of repeated calls cut into the GPU's idle gaps, each
gap named by the Python frames (forerun / benchmarks code) that launched the work ending it.

    from gpu_gaps import traced_gaps
    report = traced_gaps(lambda: one_round(), device, calls=20, skip=4)

A gap is time between the union of GPU intervals (kernels, copies, memsets) and the next one. The work ending a
gap was launched by a CUDA runtime / driver call (kernel launch, graph launch, copy) matched by its correlation id;
when that call began after the GPU had gone idle, the gap is `late` (the GPU waited for the host: the frames say
what the host was doing), else `queued` (the work was already queued: device-side latency such as a graph's
start, a dependency wait, a copy's setup). The first `skip` calls are left out (a call after a sync starts with
an empty queue). Under the profiler (with Python stacks) the host runs slower than without it, so late gaps read
longer than in a timed run: what counts is where they sit and how they rank.

Used by benchmarks/eagle_gpu.py --gaps. `gap_report` takes the trace as a dict (tests build one by hand).
"""
from __future__ import annotations

import bisect
import json
import os
import tempfile
import time

MARK = "profiled_call"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


BENCH = set(os.listdir(os.path.dirname(os.path.abspath(__file__))))


def _frame(name: str) -> str | None:
    """A python_function event's name ('/abs/path/forerun/engine/round.py(345): _run_device') as
    'engine/round.py:345 _run_device' for the repository's code; None for other frames. (The profiler writes a
    path relative to the sys.path entry it is under: a benchmark's own file may come as 'eagle_gpu.py(340): f'.)"""
    path, _, fn = name.partition(": ")
    file = path.split("(")[0]
    i = file.rfind("forerun/")
    if i >= 0:
        path = path[i + len("forerun/"):]
    elif "benchmarks/" in file:
        path = path[file.rfind("benchmarks/"):]
    elif file in BENCH:
        path = "benchmarks/" + path
    else:
        return None
    return f"{path.replace('(', ':').rstrip(')')} {fn}".strip()


def gap_report(trace: dict, skip: int = 0, min_us: float = 2.0, depth: int = 3, top: int = 15) -> dict:
    """trace: a chrome trace (torch.profiler's export) of calls each wrapped in record_function(MARK). Returns
    per call (of the calls after `skip`): GPU busy / idle us, the idle split into late / queued; the gaps grouped
    by the innermost `depth` repository frames of the launch that ended them (us and count per call, largest
    first); and the last call's gaps in order."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = sorted((e for e in ev if e.get("name") == MARK and e.get("cat") in ("user_annotation", "cpu_op")),
                   key=lambda e: e["ts"])
    if len(marks) <= skip:
        return dict(calls=0, note="no calls after skip")
    t0, t1 = marks[skip]["ts"], marks[-1]["ts"] + marks[-1]["dur"]
    calls = len(marks) - skip
    gpu = sorted((e for e in ev if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launch = {e["args"]["correlation"]: e for e in ev
              if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    tid = marks[0].get("tid")  # (the calling thread's frames)
    py = sorted(((e["ts"], e["ts"] + e["dur"], f) for e in ev if e.get("cat") == "python_function"
                 and e.get("tid") == tid for f in [_frame(e.get("name", ""))] if f is not None), key=lambda x: x[0])
    starts = [p[0] for p in py]

    def frames_at(t: float) -> str:
        i = bisect.bisect_right(starts, t)
        inside = [p for p in py[:i] if p[1] >= t]  # (the enclosing frames, outer first: later start = deeper)
        return " < ".join(f for _, _, f in reversed(inside[-depth:])) if inside else "(no repository frame)"

    busy = late_us = queued_us = 0.0
    end = None
    groups: dict[tuple[str, str], list[float]] = {}
    # GPU work launched outside CUDA graphs (kernels, copies, memsets one by one): where, how many, how long, and
    # the idle time before each (what the round adds to the graphs' own work)
    loose: dict[str, list[float]] = {}
    last_call: list[dict] = []
    last_t0 = marks[-1]["ts"]
    prev_name = None
    for e in gpu:
        s, f = e["ts"], e["ts"] + e["dur"]
        if end is not None and s > end and t0 <= end and s <= t1:  # (a gap that began in the window)
            gap = s - end
            if gap >= min_us:
                lc = launch.get(e.get("args", {}).get("correlation"))
                kind = "late" if lc is not None and lc["ts"] > end else "queued"
                where = frames_at(lc["ts"]) if lc is not None else "(launch not found)"
                if kind == "late":
                    late_us += gap
                else:
                    queued_us += gap
                groups.setdefault((kind, where), []).append(gap)
                if s >= last_t0:
                    last_call.append(dict(at_us=round(end - last_t0, 1), us=round(gap, 1), kind=kind,
                                          after=(prev_name or "")[:60], before=e["name"][:60],
                                          launch=lc["name"] if lc is not None else None, where=where))
        if t0 <= s <= t1:
            lc = launch.get(e.get("args", {}).get("correlation"))
            if lc is None or "Graph" not in lc["name"]:
                key = (frames_at(lc["ts"]) if lc is not None else "(launch not found)") + \
                    f" [{lc['name'] if lc is not None else '?'}]"
                acc = loose.setdefault(key, [0, 0.0, 0.0])
                acc[0] += 1
                acc[1] += e["dur"]
                acc[2] += max(0.0, s - end) if end is not None else 0.0
        if t0 <= s <= t1:  # (the union of the intervals)
            busy += e["dur"] if end is None or s >= end else max(0.0, f - end)
        end = f if end is None else max(end, f)
        prev_name = e["name"]
    wall = t1 - t0
    rows = sorted(((k, w, sum(v) / calls, len(v) / calls) for (k, w), v in groups.items()), key=lambda r: -r[2])
    return dict(calls=calls, wall_us=wall / calls, gpu_busy_us=busy / calls, gpu_idle_us=(wall - busy) / calls,
                late_us=late_us / calls, queued_us=queued_us / calls,
                groups=[dict(kind=k, where=w, us=round(us, 1), count=round(c, 2)) for k, w, us, c in rows[:top]],
                outside_graphs=dict(
                    count=sum(v[0] for v in loose.values()) / calls,
                    busy_us=sum(v[1] for v in loose.values()) / calls,
                    idle_before_us=sum(v[2] for v in loose.values()) / calls,
                    sites=[dict(where=k, count=round(v[0] / calls, 2), busy_us=round(v[1] / calls, 1),
                                idle_before_us=round(v[2] / calls, 1))
                           for k, v in sorted(loose.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))]),
                last_call=last_call)


def traced_gaps(fn, device, calls: int = 20, skip: int = 4, **kw) -> dict:
    """`calls` calls of fn under torch.profiler (CPU + CUDA activity, Python stacks), analysed by `gap_report`."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts, with_stack=True) as prof:
        t = time.perf_counter()
        for _ in range(calls):
            with record_function(MARK):
                fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    rep = gap_report(trace, skip=skip, **kw)
    rep["profiled_wall_ms_per_call"] = 1e3 * wall / calls
    return rep


def print_gaps(label: str, rep: dict, lines: int = 8) -> None:
    if not rep.get("calls"):
        print(f"\ngaps {label}: {rep.get('note', 'none')}")
        return
    print(f"\ngaps {label} (under the profiler, per call): wall {rep['wall_us']:.0f} us, GPU busy "
          f"{rep['gpu_busy_us']:.0f}, idle {rep['gpu_idle_us']:.0f} (host late {rep['late_us']:.0f}, queued "
          f"{rep['queued_us']:.0f})")
    for g in rep["groups"][:lines]:
        print(f"  {g['us']:8.1f} us x{g['count']:<5.2f} {g['kind']:6s} {g['where']}")
    o = rep["outside_graphs"]
    print(f"  outside CUDA graphs: {o['count']:.1f} launches a call, busy {o['busy_us']:.0f} us, idle before them "
          f"{o['idle_before_us']:.0f} us; by site (busy + idle before):")
    for x in o["sites"][:2 * lines]:
        print(f"  {x['busy_us'] + x['idle_before_us']:8.1f} us x{x['count']:<5.2f} {x['where']}")
