"""Adaptive k on short answers, the CPU pair (session 59): the real Qwen2.5-Coder-1.5B target and 0.5B draft (Q4_K_M
GGUFs, `forerun models pull`), the 20 bench prompts with the chat template, greedy, 96 new tokens (`forerun
generate`'s default), one request at a time (--batch N: N prompts submitted together, a row per group), against
plain decoding and fixed k = 1 / k = 4. Each prompt starts a fresh k policy after a 2-token warm-up request, as
`forerun generate --compare-plain` (scripts/run) does; the configurations run interleaved prompt by prompt so they
see the same machine. Greedy output must equal plain output in every row.

"before": the k policy at git revision --before (`forerun/engine/k_policy.py` read with git and loaded beside the
current one; the row is named by --before-label). The default, before session 59: k = 1 tried only where it lost
by less than 10 % on the line between the forwards timed (1 and 5 tokens after two k = 4 rounds), and a probe's
draft catch-up priced on that line, which could shut probing out for the rest of a request.

    python benchmarks/adaptive_short_cpu.py --threads 2 --out benchmarks/results/adaptive_short_cpu.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from forerun.bench_prompts import CODE_PROMPTS  # noqa: E402
from forerun.config import SpecConfig  # noqa: E402
from forerun.engine.engine import draft_dtype, load_draft_model  # noqa: E402
from forerun.engine.k_policy import KPolicy  # noqa: E402
from forerun.engine.llm import LLM  # noqa: E402
from forerun.models.registry import load_model  # noqa: E402
from forerun.sampling_params import SamplingParams  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
ADAPTIVE, BEFORE = "adaptive k", "adaptive k, before session 59"


def policy_at(rev: str):
    """KPolicy as forerun/engine/k_policy.py was at git revision `rev` (a module beside the current one)."""
    src = subprocess.run(["git", "show", f"{rev}:forerun/engine/k_policy.py"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("forerun.engine.k_policy_before", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "forerun.engine"
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    exec(compile(src, f"k_policy.py@{rev}", "exec"), mod.__dict__)
    return mod.KPolicy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=len(CODE_PROMPTS))
    ap.add_argument("--out", default="benchmarks/results/adaptive_short_cpu.json")
    ap.add_argument("--batch", type=int, default=1, help="prompts submitted together (a row: one group of them)")
    ap.add_argument("--before", default="9155285", help="git revision whose k policy the 'before' row runs")
    ap.add_argument("--before-label", default="before session 59", help="the 'before' row's name: adaptive k, LABEL")
    args = ap.parse_args()
    global BEFORE
    BEFORE = f"{ADAPTIVE}, {args.before_label}"
    torch.set_num_threads(args.threads)
    before = policy_at(args.before)
    target = load_model(TARGET, quantize="auto", progress=False)
    draft = load_draft_model(DRAFT, "cpu", draft_dtype(SpecConfig(), torch.device("cpu"), torch.float32),
                             quantize="auto")
    spec = replace(SpecConfig.from_flags(DRAFT, "auto", 0.0, "auto"), draft_model=draft[:2])
    specs = {"plain": SpecConfig(), ADAPTIVE: spec, BEFORE: spec,
             "k = 1": replace(SpecConfig.from_flags(DRAFT, "1", 0.0, "auto"), draft_model=draft[:2]),
             "k = 4": replace(SpecConfig.from_flags(DRAFT, "4", 0.0, "auto"), draft_model=draft[:2])}
    llms = {name: LLM.from_model(target[0], target[1], spec=s, device="cpu") for name, s in specs.items()}
    sp, warm = SamplingParams(temperature=0, max_tokens=args.max_tokens), SamplingParams(temperature=0, max_tokens=2)
    rows = []
    load0 = os.getloadavg()
    prompts = CODE_PROMPTS[:args.prompts]
    for i in range(0, len(prompts), args.batch):
        group = list(prompts[i:i + args.batch])
        row = dict(prompt=i)
        for name, llm in llms.items():
            eng = llm.engine
            # a fresh process's policy, as `forerun generate` starts with
            eng.k_policy = (before if name == BEFORE else KPolicy)(eng.spec)
            llm.generate(group[:1], warm, chat=True)  # the CLI's warm-up request (--compare-plain)
            llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(group, sp, chat=True)
            sec = time.perf_counter() - t
            stats = [o.stats for o in outs]
            tokens = sum(len(o.token_ids) for o in outs)
            row[name] = dict(seconds=sec, tokens=tokens, tok_per_s=tokens / sec,
                             rounds=sum(m.rounds for m in stats),
                             drafting_rounds=sum(m.drafted_at[0] if m.drafted_at else 0 for m in stats),
                             drafted=sum(m.drafted for m in stats), accepted=sum(m.accepted for m in stats),
                             ids=[o.token_ids for o in outs])
        base = row["plain"]
        for name in llms:
            row[name]["vs_plain"] = row[name]["tok_per_s"] / base["tok_per_s"]
            row[name]["identical"] = row[name]["ids"] == base["ids"]
        for name in llms:
            row[name].pop("ids")
        rows.append(row)
        print(f"[{i:2d}] " + "  ".join(f"{n.split(',')[0] if n != BEFORE else 'before'}: "
                                        f"{row[n]['vs_plain']:.2f}x" for n in llms if n != "plain")
              + f"  (plain {base['tok_per_s']:.1f} tok/s)", flush=True)
    names = [n for n in llms if n != "plain"]
    summary = {n: dict(median_vs_plain=statistics.median(r[n]["vs_plain"] for r in rows),
                       min_vs_plain=min(r[n]["vs_plain"] for r in rows),
                       below_plain=sum(r[n]["vs_plain"] < 1.0 for r in rows),
                       total_vs_plain=sum(r["plain"]["seconds"] for r in rows) / sum(r[n]["seconds"] for r in rows),
                       drafting_rounds=sum(r[n]["drafting_rounds"] for r in rows),
                       identical=all(r[n]["identical"] for r in rows)) for n in names}
    print(f"\n{'configuration':48s} {'total':>7} {'median':>7} {'min':>6} {'<plain':>7} {'identical':>9}")
    for n, s in summary.items():
        print(f"{n:48s} {s['total_vs_plain']:6.3f}x {s['median_vs_plain']:6.3f}x {s['min_vs_plain']:5.2f}x "
              f"{s['below_plain']:>4}/{len(rows)} {str(s['identical']):>9}")
    res = dict(target=TARGET, draft=DRAFT, threads=args.threads, max_tokens=args.max_tokens, batch=args.batch,
               cpu=_cpu(),
               before=args.before, loadavg_before=load0, loadavg_after=os.getloadavg(), summary=summary, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    _plot(rows, names, os.path.splitext(args.out)[0] + ".png", args.batch)
    print(f"wrote {args.out}")
    return 0 if all(s["identical"] for s in summary.values()) else 1


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = {k.strip(): v for k, v in (line.split(":", 1) for line in f if ":" in line)}
        return f"{info['model name'].strip()} (family {info['cpu family'].strip()} model {info['model'].strip()})"
    except (OSError, KeyError):
        return "unknown"


def _plot(rows, names, path, batch: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4))
    w = 0.8 / len(names)
    for j, n in enumerate(names):
        ax.bar([i + j * w for i in range(len(rows))], [r[n]["vs_plain"] for r in rows], w, label=n)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("prompt" if batch == 1 else f"group of {batch} prompts (first prompt's index)")
    ax.set_xticks([i + (len(names) - 1) * w / 2 for i in range(len(rows))], [str(r["prompt"]) for r in rows])
    ax.set_ylabel("tokens/s over plain")
    ax.set_ylim(min(0.7, min(r[n]["vs_plain"] for r in rows for n in names) - 0.05), None)
    ax.set_title(f"CPU int4 pair, {batch} request(s) at once, short answers: adaptive k against fixed k")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
