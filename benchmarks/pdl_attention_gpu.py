#!/usr/bin/env python
"""The attention chain launched with PDL (#12, #13): Q/K norm + RoPE + KV write, the split attention kernel and
its merge each start early and wait on the kernel before (kernels/pdl.py `set_attention_waits`); the split kernel
fetches the keys and values of its first tile that were cached before the step ahead of the wait. Against the plain
launches, on the random Qwen3-8B-shape model in bf16, then quantized to int4 (CudaQ4Linear), and the 0.6B shape in
bf16: forward steps replayed from CUDA graphs (GraphRunner.run_uniform, 512 cached tokens), decode at batches
1 / 4 / 16 and steps of 5 and 16 tokens (what a chain or a tree verification feeds), with the chain waiting at every
step size (the engine does it for 1-token steps). Off and on interleaved, best of the runs. The int4 decode row is
#12's number (% of the weight-streaming floor). Prints a table, writes JSON (+ PNG).

    python benchmarks/pdl_attention_gpu.py --out benchmarks/results/pdl_attention_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu as G  # noqa: E402
from forerun.kernels import pdl  # noqa: E402
from forerun.runtime.cuda_graph import GraphRunner  # noqa: E402

CASES = ((1, 1), (4, 1), (16, 1), (1, 5), (4, 5), (1, 16))  # (sequences, tokens per sequence)


def measure(model, ctx0: int, repeats: int, label: str, alt_block_n: int | None = None) -> dict:
    side = G.make_side(model, max(b for b, _ in CASES), ctx0 + 32)
    out = {}
    for b, q in CASES:
        ids = torch.zeros(b, q, dtype=torch.int64, device=G.DEV)
        ctx = torch.full((b,), ctx0, dtype=torch.int64, device=G.DEV)
        settings = {"off": (False, None), "on": (True, None)}
        if alt_block_n:
            settings[f"on, block_n {alt_block_n}"] = (True, alt_block_n)
        runs = {name: [] for name in settings}
        block_n, saved = model.backend.block_n, list(pdl._attention)
        for _ in range(repeats):
            for name, (waits, bn) in settings.items():
                pdl.set_attention_waits(waits, max_rows=1 << 30)  # every step (the engine: 1-token steps)
                model.backend.block_n = bn or block_n
                side.graphs = GraphRunner(side.runner, batch_sizes=[b], max_q_len=q)
                fn = lambda: side.graphs.run_uniform(ids, ctx, q)  # noqa: E731
                runs[name].append(G.bench_ms(fn, inner=20, outer=5))
                del side.graphs
        pdl.set_attention_waits(*saved)  # (the engine's setting)
        model.backend.block_n = block_n
        off, on = min(runs["off"]), min(runs["on"])
        out[f"b{b}_q{q}"] = row = dict(batch=b, tokens=q, off_ms=off, on_ms=on, on_over_off=on / off, runs=runs)
        if alt_block_n:
            row["alt_block_n"] = alt_block_n
            row["alt_ms"] = min(runs[f"on, block_n {alt_block_n}"])
            row["alt_over_off"] = row["alt_ms"] / off
        G.log(f"{label} b={b:2d} q={q:2d}: off {off:.4f} ms, on {on:.4f} ms ({on / off:.3f}x)"
              + (f", on with block_n {alt_block_n} {row['alt_ms']:.4f} ({row['alt_over_off']:.3f}x)" if alt_block_n
                 else ""))
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    names, ratios = [], []
    for model, rows in res["models"].items():
        for key, r in rows.items():
            names.append(f"{model} {key}")
            ratios.append(r["on_over_off"])
    ax.barh(names, ratios, color=["tab:green" if x < 1 else "tab:red" for x in ratios])
    ax.axvline(1.0, color="k", lw=1)
    ax.set_xlabel("step time, attention chain with PDL / without")
    ax.set_title(f"PDL attention chain, {res['device']}, {res['ctx']} cached tokens")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/pdl_attention.json")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke run)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--no-small", action="store_true", help="skip the 0.6B-shape (draft) model")
    ap.add_argument("--alt-block-n", type=int, default=None, help="also: waits on with this attention key tile")
    ap.add_argument("--cases", default=None, help="comma list of BxQ (default: 1x1,4x1,16x1,1x5,4x5,1x16)")
    args = ap.parse_args()
    from quant_decode_gpu import model_bytes, quantize_as_engine

    if args.cases:
        global CASES
        CASES = tuple(tuple(int(x) for x in c.split("x")) for c in args.cases.split(","))
    bw = G.copy_bandwidth(2.0)
    model = G.build_model(G.QWEN3_8B, args.layers, seed=1)
    model.ops = G.FusedLayerOps()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, ctx=args.ctx, copy_bw_bytes_per_s=bw,
               models={})
    res["models"]["bf16"] = measure(model, args.ctx, args.repeats, "bf16", args.alt_block_n)
    quantize_as_engine(model)
    floor = model_bytes(model) / bw * 1e3
    res["int4_floor_ms"] = floor
    res["models"]["int4"] = measure(model, args.ctx, args.repeats, "int4", args.alt_block_n)
    if not args.no_small:
        del model
        torch.cuda.empty_cache()
        small = G.build_model(G.QWEN3_06B, args.layers, seed=2)
        small.ops = G.FusedLayerOps()
        res["models"]["bf16 0.6B"] = measure(small, args.ctx, args.repeats, "bf16 0.6B", args.alt_block_n)
    d = res["models"]["int4"]["b1_q1"]
    d["off_of_floor"], d["on_of_floor"] = floor / d["off_ms"], floor / d["on_ms"]
    print(f"\nattention chain with PDL, {args.ctx} cached tokens; int4 floor {floor:.3f} ms")
    alt = f" | on, block_n {args.alt_block_n} / off" if args.alt_block_n else ""
    print(f"| model | batch x tokens | off ms | on ms | on / off{alt} |\n| --- | --- | --- | --- | --- |"
          + (" --- |" if alt else ""))
    for name, rows in res["models"].items():
        for r in rows.values():
            print(f"| {name} | {r['batch']} x {r['tokens']} | {r['off_ms']:.4f} | {r['on_ms']:.4f} | "
                  f"{r['on_over_off']:.3f} |" + (f" {r['alt_over_off']:.3f} |" if alt else ""))
    print(f"int4 decode, batch 1: {100 * d['off_of_floor']:.1f} % of the floor off, {100 * d['on_of_floor']:.1f} % on")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
