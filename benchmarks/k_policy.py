"""Replay the engine's adaptive-k policy (forerun.engine.k_policy.choose_k) on the costs measured on the H200
(benchmarks/results/gpu_h200.json) and compare it with the best k of the benchmark's exhaustive prediction.

No GPU needed: `python benchmarks/k_policy.py` prints a table and writes benchmarks/results/k_policy_h200.json.
"""
from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from forerun.engine.k_policy import CostModel, choose_k  # noqa: E402


def main() -> None:
    data = json.load(open(os.path.join(REPO, "benchmarks", "results", "gpu_h200.json")))
    rows = []
    for row in data["batch_sweep"]:
        b, a, c = row["batch"], row["a"], data["costs"][str(row["batch"])]
        overhead = c["plain_step_ms"] - c["target_forward_ms"]["1"]  # step preparation + sampling
        cost = CostModel()
        for q, ms in c["target_forward_ms"].items():  # what the engine would have observed, in seconds
            cost.record_target(b * int(q), (ms + overhead) / 1e3)
        cost.record_draft_step(c["draft_step_ms"] / 1e3)
        pred = {int(k): v for k, v in row["predicted_tok_s"].items()}
        k_engine = choose_k(a, max(pred), b, cost)
        best = max(pred, key=pred.get)
        rows.append(dict(batch=b, a=a, k_best=best, k_engine=k_engine,
                         engine_vs_best=pred[k_engine] / pred[best], engine_vs_plain=pred[k_engine] / pred[0]))
    print(f"{'batch':>5} {'a':>4} {'k best':>6} {'k engine':>8} {'engine/best':>11} {'engine/plain':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['a']:>4} {r['k_best']:>6} {r['k_engine']:>8} {r['engine_vs_best']:>11.3f} "
              f"{r['engine_vs_plain']:>12.3f}")
    worst = min(r["engine_vs_best"] for r in rows)
    print(f"engine's k within {100 * (1 - worst):.1f}% of the best predicted throughput in every cell; "
          f"never below plain: {all(r['engine_vs_plain'] >= 1.0 for r in rows)}")
    out = os.path.join(REPO, "benchmarks", "results", "k_policy_h200.json")
    json.dump(dict(source="gpu_h200.json", date=data.get("date"), rows=rows), open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
