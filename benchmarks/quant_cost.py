"""Verify-cost curve of the quantized CPU path: one forward of q = 1..16 new tokens (after a 64-token prefix)
for the target loaded as fp32 ("none"), int8 (W8A8, oneDNN VNNI) and int4 (group-32, Q4Linear: forerun/kernels/cpu_q4.c), plus
weight bytes and peak RSS at load. Each layout runs in its own subprocess so its peak RSS is its own. A layout may
name a variant after a colon: `int4:torch` (FORERUN_NO_CPU_KERNELS: torch's int4 kernel and ops, what a CPU without
the C kernels gets), `int4:avx2` (FORERUN_CPU_ISA=avx2: the AVX2 build on an AVX-512 CPU), `int4:int4head`
(FORERUN_INT4_OTHERS=int4: the head int4 too).

Why: speculative decoding only pays if verifying k + 1 tokens costs little more than decoding one
(issue 12). Writes benchmarks/results/quant_cost_cpu.json and .png.

    python benchmarks/quant_cost.py [--model qwen2.5-coder-1.5b-instruct] [--layouts int8,int4,none]
                                    [--threads 1] [--qmax 16] [--repeats 7]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "quant_cost_cpu.json"


def measure(model_name: str, layout: str, threads: int, qmax: int, repeats: int) -> dict:
    import torch

    from forerun.config import CacheConfig
    from forerun.models.quant import weight_bytes
    from forerun.models.registry import load_model
    from forerun.runtime.runner import Chunk, ModelRunner

    from forerun.kernels import cbuild, cpu_q4

    torch.set_num_threads(threads)
    name, layout = layout, layout.partition(":")[0]
    t0 = time.perf_counter()
    model, tok, _ = load_model(model_name, quantize=layout, progress=False)
    load_s = time.perf_counter() - t0
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=64), "cpu", torch.float32)
    prefix = tok.encode("def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n" * 6)[:64]
    runner.kv.add_sequence(0)
    with torch.inference_mode():
        runner.forward([Chunk(0, prefix, logits="last")])
        ms = {}
        for q in range(1, qmax + 1):
            times = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                runner.forward([Chunk(0, list(range(100, 100 + q)), logits="all")])
                times.append(time.perf_counter() - t)
                runner.kv.truncate(0, len(prefix))
            ms[q] = round(statistics.median(times[1:]) * 1e3, 2)
            print(f"[{layout}] q={q}: {ms[q]} ms", file=sys.stderr, flush=True)
    wb = weight_bytes(model)
    isa = cbuild.isa() if cpu_q4.available() else "none (torch)"
    return {"layout": name, "c_kernels_isa": isa, "load_s": round(load_s, 1), "peak_rss_bytes": peak_rss, **wb, "ms_by_q": ms,
            "ratio_q_over_q1": {q: round(v / ms[1], 3) for q, v in ms.items()}}


def plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in data["results"]:
        qs = [int(q) for q in r["ms_by_q"]]
        a1.plot(qs, list(r["ms_by_q"].values()), marker="o", label=f"{r['layout']} ({r['total_bytes'] / 2**30:.2f} GiB)")
        a2.plot(qs, list(r["ratio_q_over_q1"].values()), marker="o", label=r["layout"])
    a1.set_xlabel("tokens in the forward (q)")
    a1.set_ylabel("ms per forward")
    a1.set_ylim(bottom=0)
    a1.legend()
    a1.set_title(f"{data['meta']['model']}, {data['meta']['threads']} thread(s)")
    a2.set_xlabel("q")
    a2.set_ylabel("cost(q) / cost(1)")
    a2.set_ylim(bottom=0)
    a2.legend()
    a2.set_title("verify cost relative to one token")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--layouts", default="int8,int4,none")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--qmax", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child process: measure one layout, print JSON
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.model, a.one, a.threads, a.qmax, a.repeats)))
        return 0
    rows = []
    for layout in a.layouts.split(","):
        cmd = [sys.executable, __file__, "--one", layout, "--model", a.model, "--threads", str(a.threads),
               "--qmax", str(a.qmax), "--repeats", str(a.repeats)]
        variant = {"torch": {"FORERUN_NO_CPU_KERNELS": "1"}, "avx2": {"FORERUN_CPU_ISA": "avx2"},
                   "int4head": {"FORERUN_INT4_OTHERS": "int4"}, "": {}}
        env = {**os.environ, "PYTHONPATH": os.getcwd(), **variant[layout.partition(":")[2]]}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"layout {layout} failed")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{layout:10s} weights {r['total_bytes'] / 2**30:.2f} GiB, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, "
              f"q=1 {r['ms_by_q']['1']} ms, q=5 {r['ms_by_q'].get('5')} ms, q={a.qmax} {r['ms_by_q'].get(str(a.qmax))} ms",
              flush=True)
    import platform

    from forerun.kernels import cbuild

    cpu = cbuild.cpu_name()
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "model": a.model, "threads": a.threads,
            "cpu": cpu, "machine": platform.machine(),
            "prefix_tokens": 64, "repeats": a.repeats, "loadavg_1m_at_end": os.getloadavg()[0]}
    data = {"meta": meta, "results": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(data, indent=1))
    plot(data, Path(a.out).with_suffix(".png"))
    print(f"wrote {a.out} and {Path(a.out).with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
