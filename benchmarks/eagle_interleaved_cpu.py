"""EAGLE rows against the 0.5B draft model with the configurations taking turns prompt by prompt (issue 13's CPU
goal on a noisy VM): `forerun bench` runs one configuration after another, and this machine's speed drifts by
tens of percent within minutes (plain decoding 14.8-22.6 tok/s in runs an hour apart), so a row's ratio to another
row depends on when each ran. Here every configuration is built once over the same target weights, and for each
bench prompt all of them decode it back to back, in an order that rotates from prompt to prompt; each config's
time is summed over the prompts, so drift hits all of them alike. Greedy, batch 1, chat template, the bench's
prompts and token budget; every speculative output is checked token-identical to plain decoding.

    python benchmarks/eagle_interleaved_cpu.py --head ~/.cache/forerun/eagle/qwen1.5b-s46 \\
        [--configs "plain;draft:4;eagle:3;tree:3,4,8"] [--num-prompts 20] [--max-tokens 48] [--threads 2] \\
        [--out benchmarks/results/eagle_interleaved_cpu.json]

Writes JSON and a PNG (tok/s per configuration, tokens per round on the bars).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build(kind: str, arg: str, target, draft, head: str):
    """(label, LLM) of one configuration: plain, draft:K (the 0.5B draft model), eagle:K (chain), tree:T,S,N (or
    tree:T,S,N@C: only nodes of cumulative draft probability >= C verified, --confidence)."""
    from forerun.config import SpecConfig
    from forerun.engine.llm import LLM

    if kind == "plain":
        spec, label = None, "plain"
    elif kind == "draft":
        spec = replace(SpecConfig.from_flags("qwen2.5-coder-0.5b-instruct", arg, 0.0, "auto"), draft_model=draft)
        label = f"draft k={arg}"
    elif kind == "eagle":
        spec, label = SpecConfig.from_flags(f"eagle:{head}", arg, None, "auto"), f"eagle k={arg}"
    elif kind == "tree":
        from forerun.config import parse_eagle_tree_row

        shape, conf = parse_eagle_tree_row(arg)
        spec = SpecConfig.from_flags(f"eagle:{head}", "auto", conf, None, tree=",".join(map(str, shape)))
        label = f"eagle tree {arg.partition('@')[0]}" + ("" if conf is None else f" p>={conf:g}")
    else:
        raise SystemExit(f"unknown configuration kind {kind!r} (plain, draft:K, eagle:K, tree:T,S,N)")
    llm = LLM.from_model(target[0], target[1], spec=spec, device="cpu")
    if kind == "tree":
        llm.engine.drafter.budget = None  # the fixed tree, as forerun bench's tree rows
    return label, llm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True, help="EAGLE head folder")
    ap.add_argument("--configs", default="plain;draft:4;eagle:3;tree:3,4,8")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "eagle_interleaved_cpu.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from forerun.bench_prompts import CODE_PROMPTS
    from forerun.config import SpecConfig
    from forerun.engine.engine import draft_dtype, load_draft_model
    from forerun.models.registry import load_model
    from forerun.sampling_params import SamplingParams

    parts = [c.split(":", 1) + [""] for c in a.configs.split(";") if c]
    if parts[0][0] != "plain":
        raise SystemExit("--configs must start with plain (the outputs every other configuration is checked against)")
    head = str(Path(a.head).expanduser())
    target = load_model(a.model, quantize="auto")
    draft = None
    if any(p[0] == "draft" for p in parts):
        ddtype = draft_dtype(SpecConfig(), torch.device("cpu"), torch.float32)
        draft = load_draft_model("qwen2.5-coder-0.5b-instruct", "cpu", ddtype, quantize="auto")
        draft = (draft[0], draft[1])
    runs = [build(p[0], p[1], target, draft, head) for p in parts]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    for _, llm in runs:  # warm-up
        llm.generate([CODE_PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4), chat=True)
    prompts = list(CODE_PROMPTS[: a.num_prompts])
    secs = {label: 0.0 for label, _ in runs}
    outs = {label: [] for label, _ in runs}
    for i, p in enumerate(tqdm(prompts, desc="prompts", file=sys.stderr)):
        order = runs[i % len(runs):] + runs[: i % len(runs)]  # each configuration goes first in turn
        for label, llm in order:
            t = time.perf_counter()
            outs[label] += llm.generate([p], sp, chat=True)
            secs[label] += time.perf_counter() - t
    plain_ids = [o.token_ids for o in outs["plain"]]
    rows = []
    for label, llm in runs:
        agg = llm.aggregate_stats(outs[label]).as_dict()
        ids = [o.token_ids for o in outs[label]]
        tokens = sum(map(len, ids))
        rows.append({"config": label, "tokens": tokens, "seconds": round(secs[label], 2),
                     "tok_per_s": round(tokens / secs[label], 3), "identical_to_plain": ids == plain_ids,
                     "rounds": agg["rounds"], "tokens_per_target_call": agg["tokens_per_target_call"],
                     "mean_verify_rows": round(1 + agg["drafted_nodes"] / max(1, agg["rounds"]), 3),
                     "per_position_acceptance": agg.get("per_position_acceptance")})
    base = rows[0]["tok_per_s"]
    drafts = [r["tok_per_s"] for r in rows if r["config"].startswith("draft")]
    for r in rows:
        r["speedup_vs_plain"] = round(r["tok_per_s"] / base, 3)
        if drafts and r["config"].startswith("eagle"):
            r["ratio_vs_best_draft_model"] = round(r["tok_per_s"] / max(drafts), 3)
    print(f"{'config':<28} {'tok/s':>7} {'x plain':>8} {'x draft':>8} {'tok/round':>10} {'rows':>6} identical")
    for r in rows:
        print(f"{r['config']:<28} {r['tok_per_s']:>7.2f} {r['speedup_vs_plain']:>8.3f} "
              f"{r.get('ratio_vs_best_draft_model', float('nan')):>8.3f} {r['tokens_per_target_call']:>10.3f} "
              f"{r['mean_verify_rows']:>6.2f} {r['identical_to_plain']}")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "model": a.model,
            "head": head, "threads": a.threads, "num_prompts": a.num_prompts, "max_tokens": a.max_tokens,
            "order": "configurations take turns per prompt, the first one rotating", "loadavg": os.getloadavg()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar([r["config"] for r in rows], [r["tok_per_s"] for r in rows],
               color=["tab:gray" if r["config"] == "plain" else "tab:green" if r["config"].startswith("eagle")
                      else "tab:blue" for r in rows])
        for j, r in enumerate(rows):
            ax.text(j, r["tok_per_s"], f"{r['tokens_per_target_call']:.2f} tok/round", ha="center", va="bottom",
                    fontsize=8)
        ax.set_ylabel("tok/s (configurations interleaved per prompt)")
        ax.set_title(f"{a.model}, {a.num_prompts} prompts x {a.max_tokens} tokens, {a.threads} threads", fontsize=9)
        plt.xticks(rotation=15, fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.splitext(a.out)[0] + ".png", dpi=120)
    except ImportError:
        pass
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
