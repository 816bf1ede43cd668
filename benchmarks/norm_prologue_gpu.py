"""add + RMSNorm fused into the skinny product after it (`skinny_norm_linear`) versus its own kernel:
forward time (CUDA-graph replay, no sampling) of random-weight Qwen3-0.6B (the draft) and Qwen3-8B (the target)
shapes, 512 cached tokens, interleaved variants in one process. Variants set
`FusedLayerOps.NORM_PROLOGUE_MAX` (elements of the step's rows): "off" (0), "4 rows of 1024" (4096: the
draft shape at up to 4 rows), "engine" (its default), "all"
(every skinny product, the LM head included); "engine+pdl" adds PDL launches of the products (for the draft,
where `benchmarks/pdl_gpu.py` measured them 2 % faster). A kernel breakdown (torch profiler) of the draft's
4-row step off and as the engine sets it. Prints a table, writes JSON (+ PNG).

    python benchmarks/norm_prologue_gpu.py --out benchmarks/results/norm_prologue_h200.json
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
from forerun.kernels import skinny_gemm  # noqa: E402
from forerun.kernels.layer_ops import FusedLayerOps  # noqa: E402
from forerun.runtime.cuda_graph import GraphRunner  # noqa: E402

ENGINE = FusedLayerOps.NORM_PROLOGUE_MAX
VARIANTS = {"off": (0, False), "4 rows of 1024": (4096, False), "engine": (ENGINE, False), "all": (1 << 30, False),
            "engine+pdl": (ENGINE, True)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/norm_prologue_gpu.json")
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    ap.add_argument("--cases", default="1x1,4x1,1x4,4x4,8x1,16x1", help="batch x q")
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions of every variant")
    args = ap.parse_args()
    ctx0 = 512
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    batches = sorted({b for b, _ in cases})
    res = {"device": torch.cuda.get_device_name(), "ctx": ctx0, "engine_norm_prologue_max": ENGINE,
           "variants": {k: {"norm_prologue_max": v[0], "pdl_products": v[1]} for k, v in VARIANTS.items()},
           "models": {}}
    shapes = {"qwen3-0.6b": G.QWEN3_06B, "qwen3-8b": G.QWEN3_8B}
    for name in args.models:
        model = G.build_model(shapes[name], None, seed=1)
        model.ops = FusedLayerOps()
        side = G.make_side(model, max(batches), ctx0 + 64)
        row: dict[str, dict[str, list[float]]] = {}
        for v in list(VARIANTS) * args.reps:  # interleaved: the card's clocks drift
            model.ops.NORM_PROLOGUE_MAX, skinny_gemm.USE_PDL[0] = VARIANTS[v]
            side.graphs = GraphRunner(side.runner, batch_sizes=batches, max_q_len=max(q for _, q in cases))
            for b, q in cases:
                ids = torch.zeros(b, q, dtype=torch.int64, device=G.DEV)
                ctx = torch.full((b,), ctx0, dtype=torch.int64, device=G.DEV)
                ms = G.bench_ms(lambda: side.graphs.run_uniform(ids, ctx, q), inner=20, outer=5)
                row.setdefault(f"b{b}_q{q}", {n: [] for n in VARIANTS})[v].append(ms)
            del side.graphs
        summary = {k: {"ms": {n: min(t) for n, t in v.items()},
                       "over_off": {n: min(t) / min(v["off"]) for n, t in v.items()}, "runs": v}
                   for k, v in row.items()}
        if name == "qwen3-0.6b":  # where the time goes in the draft's step at batch 4
            ids = torch.zeros(4, 1, dtype=torch.int64, device=G.DEV)
            ctx = torch.full((4,), ctx0, dtype=torch.int64, device=G.DEV)
            summary["kernels_b4_q1"] = {}
            for v in ("off", "engine"):
                model.ops.NORM_PROLOGUE_MAX, skinny_gemm.USE_PDL[0] = VARIANTS[v]
                side.graphs = GraphRunner(side.runner, batch_sizes=[4], max_q_len=1)
                summary["kernels_b4_q1"][v] = G.kernel_breakdown(lambda: side.graphs.run_uniform(ids, ctx, 1), top=12)
                del side.graphs
        res["models"][name] = summary
        for k, v in summary.items():
            if "ms" in v:
                G.log(f"{name:11} {k:7} " + "  ".join(f"{n} {ms:.3f} ms ({v['over_off'][n]:.3f})"
                                                     for n, ms in v["ms"].items()))
        for v, kb in summary.get("kernels_b4_q1", {}).items():
            G.log(f"{name} b4_q1 kernels ({v}): {kb['total_us']:.0f} us: "
                  + ", ".join(f"{c} {d['us']:.0f} us / {d['count']:.0f}" for c, d in kb["categories"].items()))
        del side, model
        torch.cuda.empty_cache()
    model_ops_reset = FusedLayerOps.NORM_PROLOGUE_MAX  # (class attribute untouched: instances were set)
    assert model_ops_reset == ENGINE
    skinny_gemm.USE_PDL[0] = False
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        keys = [f"b{b}_q{q}" for b, q in cases]
        for n, s in res["models"].items():
            for v in VARIANTS:
                if v != "off":
                    ax.plot(keys, [s[k]["over_off"][v] for k in keys], "o-", label=f"{n}: {v}")
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_ylabel("forward time / norm kernel")
        ax.set_title(f"add + RMSNorm in the product's prologue, {res['device']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=110)
    except Exception as e:  # the plot is optional
        print("no plot:", e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
