"""What prefix caching (on by default since session 41) costs and saves on the CPU. Prints tables, writes JSON and a
PNG plot.

    python benchmarks/prefix_cache_cost.py [--model smollm2-135m-instruct] [--threads 2] [--num-prompts 20]
        [--max-tokens 32] [--repeats 3] [--out benchmarks/results/prefix_cache_cost_cpu.json]

1. The pool's bookkeeping alone (kvcache/pool.py, block size 16, host time, median of many calls): a prompt that
   finds nothing (`add_sequence` with its tokens), a finished sequence's blocks entering the cache (`free` with
   its tokens: one sha256 per block), a prompt found whole (shared blocks + a copied partial block), and the token
   pairs that name an EAGLE head's rows (`EagleDrafter.prefix_key`).
2. End to end, plain decoding of the real model, the bench's code prompts one after the other (as a chat user sends
   them), a fresh engine per repetition, cache on / off taking turns: (a) chat-templated prompts, which share the
   template's system prefix; (b) the same prompts raw, each behind a distinct 8-token prefix, so nothing is found
   and what is left is the bookkeeping's cost. Outputs are compared token for token.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def pool_costs(lengths=(256, 1024, 4096), reps: int = 50) -> list[dict]:
    import torch

    from forerun.config import CacheConfig, ModelConfig
    from forerun.drafters.eagle import EagleDrafter
    from forerun.kvcache.pool import KVPool

    cfg = ModelConfig(arch="llama", vocab_size=151936, hidden_size=64, intermediate_size=64, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=8)
    rows = []
    for n in lengths:
        rng = random.Random(n)
        pool = KVPool(cfg, CacheConfig(block_size=16, num_blocks=4 * (n // 16 + 2) + 2), torch.float32, "cpu",
                      prefix_caching=True)
        t_miss, t_reg, t_hit, t_pairs = [], [], [], []
        for i in range(reps):
            toks = [rng.randrange(151936) for _ in range(n)]
            t = time.perf_counter()
            pool.add_sequence(2 * i, toks)
            t_miss.append(time.perf_counter() - t)
            pool.reserve(2 * i, n)
            pool.set_length(2 * i, n)
            t = time.perf_counter()
            pool.free(2 * i, toks)
            t_reg.append(time.perf_counter() - t)
            t = time.perf_counter()
            hit = pool.add_sequence(2 * i + 1, toks[:-8] + [1, 2, 3, 4, 5, 6, 7, 8])
            t_hit.append(time.perf_counter() - t)
            assert hit == n - 8, hit
            pool.free(2 * i + 1)
            pool.reset_prefix_cache()
            t = time.perf_counter()
            EagleDrafter.prefix_key(None, toks)
            t_pairs.append(time.perf_counter() - t)
        med = lambda xs: round(statistics.median(xs) * 1e6, 1)  # noqa: E731
        rows.append({"tokens": n, "lookup_miss_us": med(t_miss), "register_us": med(t_reg), "lookup_hit_us": med(t_hit),
                     "eagle_pairs_us": med(t_pairs)})
    return rows


def end_to_end(a) -> dict:
    import torch

    from forerun.bench_prompts import CODE_PROMPTS
    from forerun.engine.llm import LLM
    from forerun.models.registry import load_model
    from forerun.sampling_params import SamplingParams

    torch.set_num_threads(a.threads)
    model, tok, _ = load_model(a.model, quantize="auto", progress=False)
    prompts = list(CODE_PROMPTS[: a.num_prompts])
    rng = random.Random(0)
    raw = [[rng.randrange(1000, 20000) for _ in range(8)] + tok.encode(p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    cases = {"chat": (prompts, True), "raw, nothing shared": (raw, False)}
    warm = LLM.from_model(model, tok, device="cpu", enable_prefix_caching=False)
    warm.generate(prompts[:1], params, chat=True)
    out = {}
    for name, (ps, chat) in cases.items():
        runs = {True: [], False: []}
        tokens = {}
        cached = {}
        for rep in range(a.repeats):
            for on in ((True, False) if rep % 2 == 0 else (False, True)):
                llm = LLM.from_model(model, tok, device="cpu", enable_prefix_caching=on)
                t = time.perf_counter()
                outs = [llm.generate([p], params, chat=chat)[0] for p in ps]
                runs[on].append(time.perf_counter() - t)
                tokens.setdefault(on, [o.token_ids for o in outs])
                cached[on] = sum(o.stats.cached_tokens for o in outs)
                n_prompt = sum(len(o.prompt_token_ids) for o in outs)
        best = {on: min(v) for on, v in runs.items()}
        out[name] = {"seconds_on": runs[True], "seconds_off": runs[False], "best_on": best[True],
                     "best_off": best[False], "on_over_off": best[True] / best[False],
                     "cached_prompt_tokens": cached[True], "identical": tokens[True] == tokens[False],
                     "prompts": len(ps), "new_tokens_each": a.max_tokens, "prompt_tokens": n_prompt}
        print(f"{name:22s} on {best[True]:7.2f} s  off {best[False]:7.2f} s  on/off {best[True] / best[False]:.3f}  "
              f"cached prompt tokens {cached[True]}  identical {tokens[True] == tokens[False]}", flush=True)
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    rows = res["pool"]
    xs = [r["tokens"] for r in rows]
    for key, label in (("lookup_miss_us", "lookup, nothing found"), ("register_us", "register at free"),
                       ("lookup_hit_us", "lookup, found whole"), ("eagle_pairs_us", "EAGLE token pairs")):
        ax1.plot(xs, [r[key] for r in rows], marker="o", label=label)
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("tokens")
    ax1.set_ylabel("host time per call (us)")
    ax1.set_title("pool bookkeeping (block 16)")
    ax1.legend(fontsize=8)
    names = list(res["end_to_end"])
    ax2.bar([f"{n}\ncache on" for n in names] + [f"{n}\ncache off" for n in names],
            [res["end_to_end"][n]["best_on"] for n in names] + [res["end_to_end"][n]["best_off"] for n in names],
            color=["tab:blue"] * len(names) + ["tab:gray"] * len(names))
    ax2.set_ylabel("seconds for the prompts (best of repeats)")
    ax2.set_title(f"{res['model']}, plain decoding, {res['threads']} threads")
    ax2.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/prefix_cache_cost_cpu.json"))
    a = ap.parse_args()
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "model": a.model,
           "threads": a.threads, "loadavg_start": os.getloadavg()}
    res["pool"] = pool_costs()
    print(f"{'tokens':>7} {'lookup miss us':>15} {'register us':>12} {'lookup hit us':>14} {'EAGLE pairs us':>15}")
    for r in res["pool"]:
        print(f"{r['tokens']:7d} {r['lookup_miss_us']:15.1f} {r['register_us']:12.1f} {r['lookup_hit_us']:14.1f} "
              f"{r['eagle_pairs_us']:15.1f}")
    res["end_to_end"] = end_to_end(a)
    res["loadavg_end"] = os.getloadavg()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, a.out.replace(".json", ".png"))
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
