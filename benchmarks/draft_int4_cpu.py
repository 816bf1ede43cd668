"""A separate draft model held all-int4 on the CPU (quant.DRAFT_INT4_OTHERS, the default since the twenty-fourth
session) against the target's policy ("layers": the GGUF's 8-bit matrices and the head stay int8): the real
Qwen2.5-Coder-1.5B target and 0.5B draft (Q4_K_M GGUFs, `forerun models pull`), the 20 bench prompts with the chat
template, greedy, 48 new tokens, batch 1, draft k = 4, and plain decoding; the three configurations run
interleaved prompt by prompt (each prompt through each one in turn) so they see the same machine. Greedy output
must equal plain output in every row. Prints a table, writes JSON and a PNG.

    python benchmarks/draft_int4_cpu.py --threads 2 --out benchmarks/results/cpu_draft_int4.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from forerun.bench_prompts import CODE_PROMPTS  # noqa: E402
from forerun.config import SpecConfig  # noqa: E402
from forerun.engine.engine import draft_dtype, load_draft_model  # noqa: E402
from forerun.engine.llm import LLM  # noqa: E402
from forerun.models import quant  # noqa: E402
from forerun.models.registry import load_model  # noqa: E402
from forerun.sampling_params import SamplingParams  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", default="4")
    ap.add_argument("--out", default="benchmarks/results/cpu_draft_int4.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(TARGET, quantize="auto", progress=False)
    ddtype = draft_dtype(SpecConfig(), torch.device("cpu"), torch.float32)
    with quant.int4_others("layers"):
        d_layers = load_model(DRAFT, dtype=ddtype, quantize="auto", progress=False)
    d_int4 = load_draft_model(DRAFT, "cpu", ddtype, quantize="auto")
    spec = SpecConfig.from_flags(DRAFT, args.k, 0.0, "auto")
    llms = {"plain": LLM.from_model(target[0], target[1], spec=SpecConfig(), device="cpu", enable_prefix_caching=False),
            f"draft k={args.k}, draft 8-bit parts int8 (before)":
                LLM.from_model(target[0], target[1], spec=replace(spec, draft_model=d_layers[:2]), device="cpu",
                               enable_prefix_caching=False),
            f"draft k={args.k}, draft all int4 (default)":
                LLM.from_model(target[0], target[1], spec=replace(spec, draft_model=d_int4[:2]), device="cpu",
                               enable_prefix_caching=False)}
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for llm in llms.values():  # warm-up
        llm.generate(CODE_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), chat=True)
    secs = {name: 0.0 for name in llms}
    outs: dict[str, list] = {name: [] for name in llms}
    load0 = os.getloadavg()
    for i, prompt in enumerate(CODE_PROMPTS):
        for name, llm in llms.items():
            t = time.perf_counter()
            outs[name] += llm.generate([prompt], sp, chat=True)
            secs[name] += time.perf_counter() - t
        print(f"[{i + 1}/{len(CODE_PROMPTS)}] " + ", ".join(f"{n.split(',')[-1].strip()}: {secs[n]:.0f}s" for n in llms),
              file=sys.stderr, flush=True)
    plain_ids = [o.token_ids for o in outs["plain"]]
    rows = {}
    for name, llm in llms.items():
        tokens = sum(len(o.token_ids) for o in outs[name])
        agg = llm.aggregate_stats(outs[name]).as_dict()
        rows[name] = dict(tok_per_s=round(tokens / secs[name], 3), tokens=tokens, seconds=round(secs[name], 2),
                          identical_to_plain=[o.token_ids for o in outs[name]] == plain_ids, **agg)
    base = rows["plain"]["tok_per_s"]
    res = dict(target=TARGET, draft=DRAFT, threads=args.threads, prompts=len(CODE_PROMPTS), max_tokens=args.max_tokens,
               load_average_start=load0, load_average_end=os.getloadavg(),
               draft_heads={"before": type(d_layers[0].lm_head).__name__, "default": type(d_int4[0].lm_head).__name__},
               rows=rows)
    print("\n| config | tok/s | x plain | acceptance | tokens / round | identical to plain |\n| --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['tok_per_s']:.2f} | {r['tok_per_s'] / base:.2f} | {r.get('acceptance_rate', 0):.3f} | "
              f"{r.get('tokens_per_target_call', 1):.2f} | {r['identical_to_plain']} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    ax.barh(list(rows), [r["tok_per_s"] for r in rows.values()], color=["gray", "tab:blue", "tab:green"])
    ax.set_xlabel("tok/s (interleaved, greedy, batch 1)")
    ax.set_title(f"1.5B target + 0.5B draft on this CPU, {args.threads} threads")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=110)
    return 0 if all(r["identical_to_plain"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
