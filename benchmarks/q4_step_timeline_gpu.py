"""Where the int4 decode step's time goes, kernel by kernel, on the step's own critical path (issue 12, session 56).

q4_step_budget.py knocks operations out and times what is left; q4_block_timing_gpu.py timestamps the blocks of a
chain of products alone. Neither shows the real step's chain: under PDL a kernel starts (its blocks resident, its
weights or cached keys requested) before the one before it ends, and the step's time is the sum, over its kernels,
of how much later each one ends than the kernel before it. This script replays the step of the random Qwen3-8B-shape
int4 model (batch 1, 512 cached tokens, the engine's kernels and table) from its CUDA graph under torch.profiler
(CUPTI's kernel records: a kernel's start is its first block's, its end its last block's) and, per kernel kind of a
layer (qkv product, Q/K norm + RoPE + cache write, attention split kernel, merge, o product, add + RMSNorm,
gate/up + SwiGLU, down), reports the mean over the layers of

  * ends after: this kernel's end - the previous kernel's end (its share of the step; they add up to the step);
  * starts before: the previous kernel's end - this kernel's start (how early PDL let it start; < 0: late);
  * duration: end - start.

The profiled replays are timed too (the profiler should not change the step: compared with the plain replay).
Prints a table, writes JSON + PNG.

    python benchmarks/q4_step_timeline_gpu.py --out benchmarks/results/q4_step_timeline_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu as G  # noqa: E402
from forerun.runtime.cuda_graph import GraphRunner  # noqa: E402

PRODUCTS = ("qkv", "o", "gate/up", "down")


def replay_kernels(fn, reps: int) -> list[list[dict]]:
    """Kernel records (name, start / end in ns) of `reps` calls of fn, one list per call, in start order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    ks = sorted((dict(name=e["name"], start=float(e["ts"]) * 1e3, end=(float(e["ts"]) + float(e["dur"])) * 1e3)
                 for e in events if e.get("cat") == "kernel"), key=lambda k: k["start"])
    calls, cur = [], []
    for k in ks:  # a call starts after an idle gap (the synchronize between calls)
        if cur and k["start"] - max(c["end"] for c in cur) > 20e3:
            calls.append(cur)
            cur = []
        cur.append(k)
    calls.append(cur)
    return calls


def label(kernels: list[dict]) -> list[str]:
    """Name each kernel of a step by its role: products by their order within a layer, the rest by kernel name."""
    out, p = [], 0
    n_products = sum(k["name"].startswith("q4c") for k in kernels)
    for k in kernels:
        name = k["name"]
        if name.startswith("q4c"):
            out.append("head" if p == n_products - 1 else PRODUCTS[p % 4])
            p += 1
        elif "_paged_attention" in name:
            out.append("attention")
        elif "fused_decode_attention" in name:
            out.append("fused attention")
        elif "_merge_splits" in name:
            out.append("merge")
        elif "qk_norm_rope" in name:
            out.append("q/k norm + rope + cache")
        elif "add_rmsnorm" in name:
            out.append("add + rmsnorm")
        else:
            out.append(name[:40])
    return out


def analyse(calls: list[list[dict]]) -> dict:
    """Per kernel role: mean ends-after / starts-before / duration over the layers and calls (us)."""
    rows: dict[str, dict] = {}
    steps = []
    for ks in calls:
        names = label(ks)
        steps.append((max(k["end"] for k in ks) - ks[0]["start"]) / 1e3)
        prev_end = ks[0]["start"]
        for k, n in zip(ks, names):
            r = rows.setdefault(n, dict(count=0, ends_after=0.0, starts_before=0.0, duration=0.0))
            r["count"] += 1
            r["ends_after"] += (k["end"] - prev_end) / 1e3
            r["starts_before"] += (prev_end - k["start"]) / 1e3
            r["duration"] += (k["end"] - k["start"]) / 1e3
            prev_end = max(prev_end, k["end"])
    for r in rows.values():
        for key in ("ends_after", "starts_before", "duration"):
            r[key] /= r["count"]
        r["count"] /= len(calls)
        r["step_share_us"] = r["ends_after"] * r["count"]
    return dict(step_us=sum(steps) / len(steps), kinds=rows)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for i, (vname, v) in enumerate(res["variants"].items()):
        kinds = list(v["kinds"])
        ax.barh([f"{k} ({vname})" for k in kinds], [v["kinds"][k]["step_share_us"] for k in kinds],
                color=f"C{i}", label=vname)
    ax.set_xlabel("share of the decode step (us, summed over the layers)")
    ax.set_title("int4 8B-shape decode step: each kernel's share of the critical path")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_step_timeline.json")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke run)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default="engine",
                    help="q4_step_budget.py variant names separated by ';' (the names hold commas)")
    args = ap.parse_args()
    from q4_step_budget import VARIANTS, build_step, install

    ctx0, bw, model, floor, side, originals, fn = build_step(args.layers)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, ctx=ctx0, copy_bw_bytes_per_s=bw,
               floor_ms=floor, variants={})
    for vname in args.variants.split(";"):
        knocked, splits, *cuda_attention = VARIANTS[vname]
        install(model, knocked, splits, originals, *cuda_attention)
        side.graphs = GraphRunner(side.runner, batch_sizes=[1], max_q_len=1)
        ms = G.bench_ms(fn, inner=20, outer=5)
        a = analyse(replay_kernels(fn, args.reps))
        a["replay_ms"] = ms
        res["variants"][vname] = a
        del side.graphs
        print(f"\n{vname}: replay {ms:.3f} ms ({100 * floor / ms:.1f} % of the {floor:.3f} ms floor); profiled step "
              f"{a['step_us'] / 1e3:.3f} ms (first kernel start -> last kernel end)")
        print("| kernel | per step | ends after the one before (us) | starts before its end (us) | duration (us) |"
              " share of the step (us) |\n| --- | --- | --- | --- | --- | --- |")
        for k, r in a["kinds"].items():
            print(f"| {k} | {r['count']:.0f} | {r['ends_after']:.2f} | {r['starts_before']:.2f} | "
                  f"{r['duration']:.2f} | {r['step_share_us']:.1f} |")
    install(model, (), None, originals)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
