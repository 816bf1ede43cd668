"""Cutting drafted EAGLE trees after the fact: a fixed number of nodes (the top N by cumulative draft probability)
against a confidence cut (the nodes of cumulative probability >= p), on the same recorded rounds (docs/eagle.md,
session 47).

    python benchmarks/eagle_cut_sim.py --head ~/.cache/forerun/eagle/qwen1.5b-s46 [--shapes "3,4,12;2,4,10"] \\
        [--out benchmarks/results/eagle_cut_sim.json]

The target decodes the 20 bench prompts greedily (`forerun.eagle.tree_sim.decode_prompts`); each shape is replayed
through the real drafter (`tree_sim.replay`) while every round's kept nodes, parents and cumulative scores are
recorded with the known continuation; then each cut of those trees is scored offline: tokens per round (accepted
drafts + 1), mean verify rows, and an estimated tok/s = tokens / (verify(rows) + the replay's median drafting time +
3 ms), verify(rows) a straight line through the measured 3-12-row verify forwards. (The next round starts where the
full tree left it, so a cut that accepts less is scored on rounds it would not quite have had: an estimate, to
choose the cuts that `tree_sim` (`--shapes 3,4,12@0.1`) and the benchmarks then measure for real.) Writes JSON and a
PNG (estimated tok/s against tokens per round, one line per kind of cut).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

THRESHOLDS = (0.02, 0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True, help="EAGLE head folder")
    ap.add_argument("--shapes", default="3,4,12;2,4,10", help="trees to draft: TOPK,STEPS,NODES;...")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "eagle_cut_sim.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from forerun.bench_prompts import CODE_PROMPTS
    from forerun.config import CacheConfig
    from forerun.drafters.eagle import EagleDrafter
    from forerun.eagle import tree_sim as TS
    from forerun.models.eagle_head import load_eagle_head
    from forerun.models.registry import load_model
    from forerun.runtime.runner import ModelRunner

    head = str(Path(a.head).expanduser())
    shapes = TS.parse_shapes(a.shapes)
    model, tok, _ = load_model(a.model, "cpu", torch.float32, quantize="auto", progress=False)
    target = ModelRunner(model, CacheConfig(block_size=16, num_blocks=512), "cpu", torch.float32)
    layers = tuple(load_eagle_head(head, model, dtype=torch.float32, device="cpu").eagle.aux_layers)
    samples = TS.decode_prompts(target, tok, list(CODE_PROMPTS[:20]), 48, layers)
    most = max(n for _, _, n in shapes)
    raw = TS.verify_costs(target, samples[0], list(range(1, most + 1)), 9)
    xs = list(range(3, most + 1))
    mx, my = sum(xs) / len(xs), sum(raw[x] for x in xs) / len(xs)
    slope = sum((x - mx) * (raw[x] - my) for x in xs) / sum((x - mx) ** 2 for x in xs)
    cost = {n: raw[n] if n < 3 else my + slope * (n - mx) for n in range(1, most + 1)}
    print(json.dumps({"verify_ms": {n: round(v, 1) for n, v in raw.items()}, "ms_per_row": round(slope, 2)}),
          flush=True)

    rec: list = []  # per round: (tokens, parents, kept scores, continuation)
    propose, accepted = EagleDrafter.propose_tree, TS.accepted_in_tree

    def recording_propose(self, *args, **kw):
        prop = propose(self, *args, **kw)
        t = self.last_tree  # (None: a plain round, no tree)
        rec.append(None if t is None else (t.nodes.shape[1], t.host[0]))
        return prop

    def recording_accepted(tokens, parents, truth):
        got = rec[-1]
        n = len(tokens)
        scores = [0.0] * n if got is None else got[1][2 * got[0]: 2 * got[0] + n]
        rec[-1] = (tokens, parents, scores, list(truth[:8]))
        return accepted(tokens, parents, truth)

    EagleDrafter.propose_tree, TS.accepted_in_tree = recording_propose, recording_accepted
    rows = []
    try:
        for shape in shapes:
            rec.clear()
            draft_ms = TS.replay(target, head, samples, shape=shape)["draft_ms_median"]
            rounds = [r for r in rec if r is not None and len(r) == 4]

            def score(keep_of, label: str, kind: str) -> None:
                toks = ms = nrows = 0
                for tokens, parents, scores, truth in rounds:
                    kept = sorted(keep_of(scores))
                    at = {j: i for i, j in enumerate(kept)}
                    a = accepted([tokens[j] for j in kept], [-1] + [at[parents[j]] for j in kept[1:]], truth)
                    toks += 1 + min(a, len(truth) - 1)
                    nrows += len(kept)
                    ms += cost[len(kept)] + draft_ms + 3.0
                row = {"shape": list(shape), "cut": label, "kind": kind, "tokens_per_round": round(toks / len(rounds), 3),
                       "mean_verify_rows": round(nrows / len(rounds), 2), "est_tok_per_s": round(1000 * toks / ms, 2),
                       "draft_ms": draft_ms}
                rows.append(row)
                print(json.dumps(row), flush=True)

            for n in range(2, shape[2] + 1):
                score(lambda s, n=n: [0] + sorted(range(1, len(s)), key=lambda j: (-s[j], j))[: n - 1], f"top{n}", "top")
            for p in THRESHOLDS:
                score(lambda s, p=p: [0] + [j for j in range(1, len(s)) if math.exp(s[j]) >= p], f"p>={p}", "cut")
    finally:
        EagleDrafter.propose_tree, TS.accepted_in_tree = propose, accepted
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "model": a.model,
            "head": head, "threads": a.threads, "prompts": len(samples), "max_tokens": 48,
            "verify_ms": {str(n): round(v, 2) for n, v in raw.items()}, "ms_per_row": round(slope, 2)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for shape in shapes:
            for kind, style in (("top", "o-"), ("cut", "s--")):
                pts = [r for r in rows if r["shape"] == list(shape) and r["kind"] == kind]
                ax.plot([r["tokens_per_round"] for r in pts], [r["est_tok_per_s"] for r in pts], style, ms=3,
                        label=f"{','.join(map(str, shape))}: {'top N nodes' if kind == 'top' else 'p >= c'}")
        ax.axvline(2.5, color="gray", lw=0.8)
        ax.set_xlabel("tokens per round")
        ax.set_ylabel("estimated tok/s")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.splitext(a.out)[0] + ".png", dpi=120)
    except ImportError:
        pass
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
