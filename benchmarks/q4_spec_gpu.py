#!/usr/bin/env python
"""Speculative decoding with int4 weights on the GPU (#12, "verify rows nearly as cheap as one"), end to end: the
random Qwen3-8B-shape target and Qwen3-0.6B-shape draft, first in bf16, then both quantized as the engine runs them
on CUDA (int4 weight-only, PDL norms), with the 2-16-row products on the tuned table's Triton kernels and then on
the tensor-core kernel (kernels/q4_mma.py, FORERUN_Q4_MMA). Batch 1 (and 4), synthetic acceptance as in gpu.py: a
round's verdict is drawn with probability a per draft token, the real draft steps, verify forward and verify
kernel all run. Prints a table of tok/s and the speedup over plain decoding in the same weights; writes JSON and a
PNG.

    python benchmarks/q4_spec_gpu.py --out benchmarks/results/q4_spec_h200.json [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu as G  # noqa: E402
from quant_decode_gpu import model_bytes, quantize_as_engine  # noqa: E402
from forerun.runtime.cuda_graph import GraphRunner  # noqa: E402

MODES = ("bf16", "int4, Triton verify", "int4, tensor-core verify")


def measure(target: G.Side, draft: G.Side, batches, accepts, ks, ctx0: int, rounds: int, warm: int) -> dict:
    """Plain step, draft step, target forward by q, and synthetic speculative rounds, with the kernels the
    environment selects now (graphs captured afresh)."""
    for side in (target, draft):
        side.graphs = GraphRunner(side.runner, batch_sizes=list(batches), max_q_len=16)
    out: dict = {}
    for b in batches:
        draft.graphs.capture(b, 2, device_prep=True)  # a round's first draft step feeds two tokens
        step, reset = G.plain_step_fn(target, b, ctx0, 1.0)
        plain = G.bench_ms(step, inner=8, outer=3)
        reset()
        dstep, dreset = G.draft_step_fn(draft, b, ctx0)
        dms = G.bench_ms(dstep, inner=8, outer=3)
        dreset()
        fwd = {}
        for q in (1, 3, 4, 5, 6):
            ids = torch.zeros(b, q, dtype=torch.int64, device=G.DEV)
            ctx = torch.full((b,), ctx0, device=G.DEV)
            fwd[str(q)] = G.bench_ms(lambda: target.graphs.run_uniform(ids, ctx, q), inner=4, outer=3)
        row = dict(plain_step_ms=plain, plain_tok_s=b / plain * 1e3, draft_step_ms=dms, target_forward_ms=fwd,
                   spec=[])
        for a in accepts:
            for k in ks:
                r = G.run_spec(target, draft, b, k, a, rounds, warm, ctx0, seed=int(a * 100) + k + 1000 * b)
                r["speedup"] = r["tok_s"] / row["plain_tok_s"]
                row["spec"].append(r)
                G.log(f"  b={b} a={a} k={k}: {r['tok_s']:.1f} tok/s, {r['speedup']:.2f}x plain "
                      f"({r['tokens_per_round']:.2f} tokens / round)")
        G.log(f"  b={b}: plain {plain:.3f} ms, draft step {dms:.3f} ms, target forward q=1/5: "
              f"{fwd['1']:.3f} / {fwd['5']:.3f} ms")
        out[str(b)] = row
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    b1 = {m: res["modes"][m]["1"] for m in MODES if m in res["modes"]}
    labels = [f"a={r['a']} k={r['k']}" for r in next(iter(b1.values()))["spec"]]
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.8), 4.5))
    w = 0.8 / len(b1)
    for i, (m, row) in enumerate(b1.items()):
        ax.bar([j + i * w for j in range(len(labels))], [r["speedup"] for r in row["spec"]], w, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + w * (len(b1) - 1) / 2 for j in range(len(labels))], labels, rotation=45, ha="right")
    ax.set_ylabel("speedup over plain decoding (same weights)")
    ax.set_title(f"{res['card']}: 8B-shape target, 0.6B-shape draft, batch 1, synthetic acceptance")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_spec.json")
    ap.add_argument("--quick", action="store_true", help="few layers and configurations: a smoke run")
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    quick = args.quick
    batches = (1,) if quick else (1, 4)
    accepts = (0.8,) if quick else (0.6, 0.8, 0.9)
    ks = (2, 4) if quick else (2, 3, 4, 5)
    rounds, warm = (8, 2) if quick else (96, 4)
    ctx0 = args.context
    capacity = ctx0 + 256 + 16 * 7 + 64  # run_spec wraps the context back every 16 rounds
    torch.manual_seed(0)
    res: dict = dict(card=torch.cuda.get_device_name(0), date=datetime.datetime.now().isoformat(timespec="seconds"),
                     torch=torch.__version__, context=ctx0, quick=quick, modes={})
    res["copy_bandwidth_TBps"] = G.copy_bandwidth(0.5 if quick else 2.0) / 1e12
    tmodel = G.build_model(G.QWEN3_8B, 4 if quick else None, seed=1)
    dmodel = G.build_model(G.QWEN3_06B, 2 if quick else None, seed=2)
    for m in (tmodel, dmodel):
        m.ops = G.FusedLayerOps()
    target, draft = G.make_side(tmodel, max(batches), capacity), G.make_side(dmodel, max(batches), capacity)
    env = os.environ.get("FORERUN_Q4_MMA")
    try:
        G.log("bf16")
        res["bytes"] = {"bf16": [model_bytes(tmodel), model_bytes(dmodel)]}
        res["modes"]["bf16"] = measure(target, draft, batches, accepts, ks, ctx0, rounds, warm)
        for m in (tmodel, dmodel):
            quantize_as_engine(m)
        res["bytes"]["int4"] = [model_bytes(tmodel), model_bytes(dmodel)]
        for mode, flag in ((MODES[1], "0"), (MODES[2], "1")):
            os.environ["FORERUN_Q4_MMA"] = flag
            G.log(mode)
            res["modes"][mode] = measure(target, draft, batches, accepts, ks, ctx0, rounds, warm)
    finally:
        if env is None:
            os.environ.pop("FORERUN_Q4_MMA", None)
        else:
            os.environ["FORERUN_Q4_MMA"] = env
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.splitext(args.out)[0] + ".png")
    for b in batches:
        print(f"\nbatch {b}: plain step ms " + ", ".join(f"{m} {res['modes'][m][str(b)]['plain_step_ms']:.3f}"
                                                        for m in MODES))
        print("| a | k | " + " | ".join(f"{m} tok/s (x plain)" for m in MODES) + " |")
        print("| --- | --- |" + " --- |" * len(MODES))
        rows = zip(*(res["modes"][m][str(b)]["spec"] for m in MODES))
        for rs in rows:
            print(f"| {rs[0]['a']} | {rs[0]['k']} | " + " | ".join(f"{r['tok_s']:.1f} ({r['speedup']:.2f}x)"
                                                                     for r in rs) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
