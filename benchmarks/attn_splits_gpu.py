"""Split attention (flash-decoding) against one pass, by context length: the whole forward of the Qwen3-8B target
and Qwen3-0.6B draft shapes (random bf16 weights, fused layer ops, CUDA graphs) replayed with the Triton
backend's split count chosen as the engine does (from the grid size: up to 16 splits plus a merge kernel per
layer) and with one split (no merge kernel), at several cached-context lengths. Small batches at short contexts
are where the split kernel's programs find one tile or none and the merge's launch is pure cost. Prints a table,
writes JSON (+ PNG).

    python benchmarks/attn_splits_gpu.py --out benchmarks/results/attn_splits_h200.json
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
from forerun.runtime.cuda_graph import GraphRunner  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/attn_splits_gpu.json")
    ap.add_argument("--cases", default="1x1,4x1,4x2,1x4,4x4,16x1,16x4", help="batch x q")
    ap.add_argument("--contexts", default="128,256,512,1024,2048")
    args = ap.parse_args()
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    res = {"device": torch.cuda.get_device_name(), "cases": args.cases, "contexts": contexts, "models": {}}
    for name, shape in (("qwen3-0.6b", G.QWEN3_06B), ("qwen3-8b", G.QWEN3_8B)):
        model = G.build_model(shape, None, seed=1)
        model.ops = G.FusedLayerOps()
        side = G.make_side(model, 16, max(contexts) + 32)
        rows = {}
        for variant in ("auto", "one", "auto", "one"):  # twice each, interleaved: the card's clocks drift
            model.backend.num_splits = None if variant == "auto" else 1
            side.graphs = GraphRunner(side.runner, batch_sizes=[1, 4, 16], max_q_len=8)
            for b, q in cases:
                ids = torch.zeros(b, q, dtype=torch.int64, device=G.DEV)
                for ctx0 in contexts:
                    ctx = torch.full((b,), ctx0, dtype=torch.int64, device=G.DEV)
                    ms = G.bench_ms(lambda: side.graphs.run_uniform(ids, ctx, q), inner=20, outer=5)
                    rows.setdefault(f"b{b}_q{q}_ctx{ctx0}", {"auto": [], "one": []})[variant].append(ms)
            del side.graphs
        model.backend.num_splits = None
        summary = {k: {"auto_ms": min(v["auto"]), "one_ms": min(v["one"]), "one_over_auto": min(v["one"]) / min(v["auto"]),
                       "runs": v} for k, v in rows.items()}
        res["models"][name] = summary
        for k, v in summary.items():
            G.log(f"{name:11} {k:16} auto {v['auto_ms']:.3f} ms  one split {v['one_ms']:.3f} ms  ({v['one_over_auto']:.3f})")
        del side, model
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        for ax, (name, summary) in zip(axes, res["models"].items()):
            for b, q in cases:
                ax.plot(contexts, [summary[f"b{b}_q{q}_ctx{c}"]["one_over_auto"] for c in contexts], "o-",
                        label=f"b{b} q{q}")
            ax.axhline(1.0, color="k", lw=0.5)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("cached tokens")
            ax.set_ylabel("forward time, one split / split + merge")
            ax.set_title(name)
            ax.legend(fontsize=7)
        fig.suptitle(f"attention splits, {res['device']}")
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=110)
    except Exception as e:  # the plot is optional
        print("no plot:", e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
