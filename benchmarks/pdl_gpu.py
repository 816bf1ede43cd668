"""Programmatic dependent launch on the bf16 path (forerun/kernels/pdl.py): each forward with PDL off and on,
in one process, on random weights at the Qwen3-8B target and Qwen3-0.6B draft shapes (CUDA graphs, fused layer
ops, 512 cached tokens). Rows: decode at batch 1 and 4, a verify of q = 4 / 5 tokens at batch 1 and 4, and the
8B model in Q4 (#12). Prints a table, writes JSON (+ PNG).

    python benchmarks/pdl_gpu.py --out benchmarks/results/pdl_h200.json
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
from forerun.kernels import pdl, skinny_gemm  # noqa: E402
from forerun.runtime.cuda_graph import GraphRunner  # noqa: E402


def measure(side, cases, ctx0: int) -> dict:
    out = {}
    for b, q in cases:
        ids = torch.zeros(b, q, dtype=torch.int64, device=G.DEV)
        ctx = torch.full((b,), ctx0, dtype=torch.int64, device=G.DEV)
        out[f"b{b}_q{q}"] = G.bench_ms(lambda: side.graphs.run_uniform(ids, ctx, q), inner=20, outer=5)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/pdl_gpu.json")
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b", "qwen3-8b q4"])
    ap.add_argument("--variants", nargs="*", default=None, help="only these (and off)")
    ap.add_argument("--cases", default="1x1,4x1,1x4,4x4,1x5,4x5", help="batch x q")
    args = ap.parse_args()
    ctx0 = 512
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    res = {"device": torch.cuda.get_device_name(), "ctx": ctx0, "pdl_supported": None, "models": {},
           "copy_bw": G.copy_bandwidth(2.0)}
    shapes = [(n, sh, q) for n, sh, q in (("qwen3-0.6b", G.QWEN3_06B, False), ("qwen3-8b", G.QWEN3_8B, False),
                                          ("qwen3-8b q4", G.QWEN3_8B, True)) if n in args.models]
    for name, shape, q4 in shapes:
        model = G.build_model(shape, None, seed=1)
        model.ops = G.FusedLayerOps()
        if q4:
            from forerun.models.quant_cuda import quantize_model_cuda

            quantize_model_cuda(model)
            torch.cuda.empty_cache()
        side = G.make_side(model, 4, ctx0 + 64)
        row = {}
        # PDL off / on for everything, for only the products or only the norms (bf16); for q4 (whose products
        # always wait when PDL is on): the norms not waiting (as before) or as the engine sets them (<= 8 rows)
        if q4:
            variants = {"off": (False, False, False), "products only": (True, False, False),
                        "engine": (True, False, True)}
        else:
            variants = {"off": (False, True, True), "on": (True, True, True), "products only": (True, True, False),
                        "norms only": (True, False, True)}
        if args.variants:
            variants = {k: v for k, v in variants.items() if k in args.variants or k == "off"}
        for name_v in list(variants) * 2:  # twice each, interleaved: the card's clocks drift
            on, prod, norm = variants[name_v]
            pdl.set_enabled(on)
            skinny_gemm.USE_PDL[0] = prod
            model.ops.pdl_norms = norm
            side.graphs = GraphRunner(side.runner, batch_sizes=[1, 4], max_q_len=8)
            t = measure(side, cases, ctx0)
            for key, ms in t.items():
                row.setdefault(key, {v: [] for v in variants})[name_v].append(ms)
            res["pdl_supported"] = pdl.enabled(torch.zeros(1, device=G.DEV))
            del side.graphs
        summary = {k: {"ms": {n: min(t) for n, t in v.items()},
                       "over_off": {n: min(t) / min(v["off"]) for n, t in v.items()}, "runs": v} for k, v in row.items()}
        if q4:
            from quant_decode_gpu import model_bytes

            floor = model_bytes(model) / res["copy_bw"] * 1e3
            summary["floor_ms"] = floor
            summary["b1_q1_fraction_of_floor"] = {n: floor / ms for n, ms in summary["b1_q1"]["ms"].items()}
        res["models"][name] = summary
        for k, v in summary.items():
            if isinstance(v, dict) and "ms" in v:
                G.log(f"{name:12} {k:7} " + "  ".join(f"{n} {ms:.3f} ms ({v['over_off'][n]:.3f})" for n, ms in v["ms"].items()))
        if q4:
            G.log(f"{name}: floor {floor:.3f} ms; decode b1 as % of floor: "
                  + ", ".join(f"{n} {100 * f:.1f} %" for n, f in summary["b1_q1_fraction_of_floor"].items()))
        del side, model
        torch.cuda.empty_cache()
    pdl.set_enabled(True)
    skinny_gemm.USE_PDL[0] = False
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        names = list(res["models"])
        keys = [f"b{b}_q{q}" for b, q in cases]
        for i, n in enumerate(names):
            for v in res["models"][n]["b1_q1"]["ms"]:
                if v != "off":
                    ax.plot(keys, [res["models"][n][k]["over_off"][v] for k in keys], "o-", label=f"{n}: {v}")
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_ylabel("forward time / PDL off")
        ax.set_title(f"PDL on the bf16 / q4 forward, {res['device']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=110)
    except Exception as e:  # the plot is optional
        print("no plot:", e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
