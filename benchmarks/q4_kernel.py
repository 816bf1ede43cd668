"""Streaming speed of the CPU quantized linears at the Qwen2.5-Coder-1.5B layer shapes, weights far larger than
the L3 (several layers of random weights, run in sequence as a forward does), 1..16 activation rows.

Why: the int4 C kernel (forerun/kernels/cpu_q4.c) must read its weights at memory speed to beat the int8 layout
(issue 12); a one-matrix micro-benchmark sits in the 32 MB L3 and overstates every kernel.

    python benchmarks/q4_kernel.py [--layers 8] [--threads 1,2] [--rows 1,2,4,8,16] [--layouts q4,int8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}


def build(layout: str, layers: int):
    """layout: q4 (forerun's C kernel, this CPU's build), int8 (oneDNN W8A8), int4torch (torch's
    _weight_int4pack_mm_for_cpu: what `--quantize int4` runs without the C kernel)."""
    from forerun.models.quant import Int4Linear, Int8Linear, Q4Linear, quantize_groups_int4

    torch.manual_seed(0)
    make = {"int8": Int8Linear.from_float, "q4": lambda w: Q4Linear(*quantize_groups_int4(w)),
            "int4torch": lambda w: Int4Linear(*quantize_groups_int4(w))}[layout]
    mods = []
    for _ in range(layers):
        for name, (n, k) in SHAPES.items():
            mods.append((name, make(torch.randn(n, k) * 0.02)))
    return mods


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--layouts", default="q4,int8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out")
    a = ap.parse_args()
    res = []
    for layout in a.layouts.split(","):
        mods = build(layout, a.layers)
        nbytes = sum(m.weight_bytes for _, m in mods)
        for th in map(int, a.threads.split(",")):
            torch.set_num_threads(th)
            for m_rows in map(int, a.rows.split(",")):
                xs = {k: torch.randn(m_rows, k) for k in (1536, 8960)}
                ts = []
                with torch.inference_mode():
                    for _ in range(a.repeats + 1):
                        t = time.perf_counter()
                        for _, mod in mods:
                            mod(xs[mod.in_features])
                        ts.append(time.perf_counter() - t)
                ms = statistics.median(ts[1:]) * 1e3
                row = {"layout": layout, "threads": th, "rows": m_rows, "ms_per_layer": round(ms / a.layers, 3),
                       "GB_per_s": round(nbytes / ms / 1e6, 1)}
                res.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        import os
        from forerun.kernels import cbuild

        cpu = cbuild.cpu_name()
        with open(a.out, "w") as f:
            json.dump({"layers": a.layers, "loadavg": os.getloadavg(), "cpu": cpu, "c_kernels_isa": cbuild.isa(),
                       "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
