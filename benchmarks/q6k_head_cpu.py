"""The Q4_K_M target's Q6_K output head on the CPU: kept in its GGUF blocks (Q6KLinear, cpu_q4.c's q6k_gemm, the
default since session 41) against the 8-bit re-quantization it replaced (Q8Linear) and the exact fp32 head. Prints
tables, writes JSON and a PNG plot.

    python benchmarks/q6k_head_cpu.py [--model qwen2.5-coder-1.5b-instruct] [--threads 2] [--repeats 15]
        [--out benchmarks/results/q6k_head_cpu.json]

1. Accuracy: the head's inputs (final-norm hidden states) of the real model over quant_accuracy.py's texts, logits of
   each head against the fp32 head of the same blocks (gguf's dequantization): KL per position, top-1 agreement.
2. The product alone at 1-8 rows (the decode row and verify rows), the heads taking turns, best and median of
   --repeats calls.
3. Decode end to end: plain greedy decoding of three bench prompts (64 new tokens) with the model's head swapped,
   taking turns, best of 3; outputs compared token for token.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/q6k_head_cpu.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import quant_accuracy as qa
    from gguf import GGMLQuantizationType, quants

    from forerun.bench_prompts import CODE_PROMPTS
    from forerun.engine.llm import LLM
    from forerun.models import hub
    from forerun.models.gguf_reader import FastGGUFReader
    from forerun.models.quant import Q6KLinear, Q8Linear
    from forerun.models.registry import load_model
    from forerun.sampling_params import SamplingParams

    path = str(hub.resolve_model(a.model, progress=False))
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "model": a.model,
           "threads": a.threads, "loadavg_start": os.getloadavg()}
    model, tok, _ = load_model(path, quantize="auto", progress=False)
    t = next(t for t in FastGGUFReader(path).tensors if t.name == "output.weight")
    if t.tensor_type.name != "Q6_K":
        print(f"{a.model}'s output head is {t.tensor_type.name}, not Q6_K: nothing to compare")
        return 1
    blocks = t.data
    n, k = blocks.shape[0], blocks.shape[1] // 210 * 256
    w = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q6_K).reshape(n, k).astype(np.float32))
    heads = {"Q6KLinear (exact, re-laid out)": Q6KLinear.from_blocks(blocks, k), "Q8Linear (re-quantized, before)": Q8Linear.from_float(w)}
    res["bytes"] = {"Q6KLinear": heads["Q6KLinear (exact, re-laid out)"].weight_bytes,
                    "Q8Linear": heads["Q8Linear (re-quantized, before)"].weight_bytes, "fp32": n * k * 4}
    print(f"head [{n}, {k}]: Q6_K blocks {res['bytes']['Q6KLinear'] / 1e6:.1f} MB, Q8Linear "
          f"{res['bytes']['Q8Linear'] / 1e6:.1f} MB, fp32 {res['bytes']['fp32'] / 1e6:.1f} MB")
    print("model's head:", type(model.lm_head).__name__)
    if not isinstance(model.lm_head, (Q6KLinear, Q8Linear)):  # e.g. oneDNN's Int8Linear where the CPU has VNNI
        own = f"{type(model.lm_head).__name__} (this CPU's default)"
        heads[own] = model.lm_head
        res["bytes"][type(model.lm_head).__name__] = model.lm_head.weight_bytes

    def rows(h, x):
        return h.rows(x) if hasattr(h, "rows") else h(x)

    # 1. accuracy
    xs = []
    head = model.lm_head
    if hasattr(head, "rows"):
        real = head.rows

        def capture(x, threads=None):
            xs.append(x.detach().clone())
            return real(x, threads)

        head.rows = capture
        qa.logits(model, qa.texts(tok))
        del head.rows
    else:
        hook = head.register_forward_pre_hook(lambda mod, args: xs.append(args[0].detach().reshape(-1, k).clone()))
        qa.logits(model, qa.texts(tok))
        hook.remove()
    x_all = torch.cat(xs)
    acc = {name: {"kl": [], "top1": []} for name in heads}
    for i in range(0, x_all.shape[0], 64):
        x = x_all[i:i + 64]
        ref = torch.log_softmax((x @ w.T).double(), -1)
        for name, h in heads.items():
            lp = torch.log_softmax(rows(h, x).double(), -1)
            acc[name]["kl"].append((ref.exp() * (ref - lp)).sum(-1))
            acc[name]["top1"].append((ref.argmax(-1) == lp.argmax(-1)).float())
    res["accuracy"] = {}
    print(f"\n{x_all.shape[0]} positions, logits against the fp32 head of the same blocks")
    for name, d in acc.items():
        kl, top1 = torch.cat(d["kl"]), torch.cat(d["top1"])
        res["accuracy"][name] = {"kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
                                 "kl_max": kl.max().item(), "top1": top1.mean().item()}
        print(f"  {name:34s} KL mean {kl.mean():.2e}  p99 {kl.quantile(0.99):.2e}  max {kl.max():.2e}  "
              f"top-1 {top1.mean():.4f}")

    # 2. the product alone
    res["product_ms"] = {}
    print(f"\nproduct alone, {a.threads} threads (ms, best / median of {a.repeats})")
    for m in (1, 2, 3, 5, 8):
        x = x_all[:m].contiguous()
        times = {name: [] for name in heads}
        for name, h in heads.items():
            rows(h, x)
        for _ in range(a.repeats):
            for name, h in heads.items():
                t0 = time.perf_counter()
                rows(h, x)
                times[name].append(time.perf_counter() - t0)
        row = {name: {"best": min(v) * 1e3, "median": statistics.median(v) * 1e3} for name, v in times.items()}
        res["product_ms"][m] = row
        print(f"  {m} rows: " + "   ".join(f"{name.split()[0]} {r['best']:.2f} / {r['median']:.2f}"
                                           for name, r in row.items()))

    # 3. decode end to end
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = list(CODE_PROMPTS[:3])
    llm = LLM.from_model(model, tok, device="cpu", enable_prefix_caching=False)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), chat=True)
    e2e = {name: [] for name in heads}
    outs = {}
    for rep in range(3):
        for name, h in (heads.items() if rep % 2 == 0 else reversed(list(heads.items()))):
            model.lm_head = h
            t0 = time.perf_counter()
            o = llm.generate(prompts, params, chat=True)
            e2e[name].append(sum(len(r.token_ids) for r in o) / (time.perf_counter() - t0))
            outs[name] = [r.token_ids for r in o]
    model.lm_head = head
    names = list(heads)
    res["decode_tok_s"] = {name: {"runs": v, "best": max(v)} for name, v in e2e.items()}
    res["decode_same_tokens"] = sum(a == b for a, b in zip(outs[names[0]], outs[names[1]]))
    res["decode_speedup"] = max(e2e[names[0]]) / max(e2e[names[1]])
    if len(names) > 2:  # against this CPU's default head
        res["decode_same_tokens_vs_default"] = sum(a == b for a, b in zip(outs[names[0]], outs[names[2]]))
        res["decode_speedup_vs_default"] = max(e2e[names[0]]) / max(e2e[names[2]])
        print(f"Q6KLinear against {names[2]}: {res['decode_speedup_vs_default']:.3f}x, same tokens in "
              f"{res['decode_same_tokens_vs_default']}/3 prompts")
    print(f"\nplain decode, 3 prompts x 64 tokens (tok/s, best of 3): " + ", ".join(
        f"{name.split()[0]} {max(v):.2f}" for name, v in e2e.items()) + f"; ratio {res['decode_speedup']:.3f}; "
        f"same tokens in {res['decode_same_tokens']}/3 prompts")
    res["loadavg_end"] = os.getloadavg()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, a.out.replace(".json", ".png"))
    print("wrote", a.out)
    return 0


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    rows = sorted(res["product_ms"], key=int)
    for name in res["accuracy"]:
        ax1.plot([int(m) for m in rows], [res["product_ms"][m][name]["best"] for m in rows], marker="o",
                 label=name)
    ax1.set_xlabel("rows")
    ax1.set_ylabel("ms (best)")
    ax1.set_title(f"{res['model']} head product, {res['threads']} threads")
    ax1.legend(fontsize=8)
    names = list(res["accuracy"])
    ax2.bar(names, [res["accuracy"][n]["kl_mean"] for n in names], color=["tab:blue", "tab:gray", "tab:orange"][:len(names)])
    ax2.set_ylabel("mean KL to the fp32 head")
    ax2.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
