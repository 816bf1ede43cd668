"""The CPU layer kernels (forerun/kernels/cpu_layer.c: attention rows, add + RMSNorm, RoPE + cache write) against
the torch ops they replace, inside one forward of the real int4 target: forwards of q = 1 and q = 3 tokens after a
150-token prefix, the two variants alternated forward by forward (this host's speed moves by up to 2x within
minutes, so only paired ratios compare), plus the time each op kind takes per forward. Writes JSON.

    python benchmarks/cpu_layer_ab.py [--threads 2] [--pairs 120] [--out benchmarks/results/cpu_layer_ab.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=120)
    ap.add_argument("--out", default="benchmarks/results/cpu_layer_ab.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from forerun.config import CacheConfig
    from forerun.kernels import cpu_layer
    from forerun.models.cpu_ops import CpuLayerOps
    from forerun.models.ops import LayerOps
    from forerun.models.registry import load_model
    from forerun.runtime.runner import Chunk, ModelRunner

    if not cpu_layer.available():
        raise SystemExit("the C layer kernels cannot be built here (gcc, AVX-512)")
    model, tok, _ = load_model(a.model, quantize="auto", progress=False)
    runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=64), "cpu", torch.float32)
    prefix = tok.encode("def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n" * 12)[:150]
    runner.kv.add_sequence(0)
    c_attn, c_ops, torch_ops = cpu_layer.attention_rows, CpuLayerOps(), LayerOps()

    def use(c: bool) -> None:
        model.ops = c_ops if c else torch_ops
        cpu_layer.attention_rows = c_attn if c else (lambda *x, **k: None)

    times = {(c, q): [] for c in (False, True) for q in (1, 3)}
    try:
        with torch.inference_mode():
            runner.forward([Chunk(0, prefix, logits="last")])
            for i in range(a.pairs):
                for q in (1, 3):
                    for c in ((False, True) if i % 2 else (True, False)):
                        use(c)
                        t = time.perf_counter()
                        runner.forward([Chunk(0, list(range(100, 100 + q)), logits="all")])
                        times[(c, q)].append(time.perf_counter() - t)
                        runner.kv.truncate(0, len(prefix))
    finally:
        use(True)
    rows = []
    for q in (1, 3):
        t0, t1 = times[(False, q)], times[(True, q)]
        ratios = sorted(x / y for x, y in zip(t0, t1))
        rows.append(dict(q=q, torch_ops_ms_median=statistics.median(t0) * 1e3, c_ms_median=statistics.median(t1) * 1e3,
                         torch_ops_ms_min=min(t0) * 1e3, c_ms_min=min(t1) * 1e3,
                         paired_speedup_median=ratios[len(ratios) // 2],
                         paired_speedup_p25=ratios[len(ratios) // 4], paired_speedup_p75=ratios[3 * len(ratios) // 4]))
    print("| q | torch ops ms (median / min) | C ms (median / min) | paired speedup (median, p25-p75) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['q']} | {r['torch_ops_ms_median']:.1f} / {r['torch_ops_ms_min']:.1f} | {r['c_ms_median']:.1f} / "
              f"{r['c_ms_min']:.1f} | {r['paired_speedup_median']:.3f} ({r['paired_speedup_p25']:.3f}-"
              f"{r['paired_speedup_p75']:.3f}) |")
    res = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), model=a.model, threads=a.threads,
               pairs=a.pairs, prefix_tokens=len(prefix), load_average=os.getloadavg(), rows=rows)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, (key, label) in enumerate((("torch_ops_ms_median", "torch ops"), ("c_ms_median", "C layer kernels"))):
        ax.bar([r["q"] + (i - 0.5) * 0.8 for r in rows], [r[key] for r in rows], width=0.8, label=label)
    ax.set_xticks([r["q"] for r in rows])
    ax.set_xlabel("tokens in the forward (q)")
    ax.set_ylabel("ms per forward (median)")
    ax.set_title(f"{a.model}, int4, {a.threads} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out[:-5] + ".png", dpi=110)
    print(f"wrote {a.out} and its .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
