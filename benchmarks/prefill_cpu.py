"""Prefill (one forward over a prompt of M tokens) on the CPU with the int4 kernels, session 43's two changes on
and off: the products in passes of q4_row_block(K) activation rows (cpu_q4.c: the rows' int8 activations stay in
cache while every output block reads them) and attention in items of up to 16 rows sharing each tile of keys and
values, scored 16 keys at a time with a vector exp (cpu_layer.c). The same model and prompt, the four settings
taking turns, best of --repeats; the logits compared bit for bit where only the row blocks differ. With
--llamacpp, llama.cpp's llama-bench on the same GGUF and threads (prompt processing, -p M -n 0) in the same run.
Prints a table, writes JSON and a PNG plot.

    python benchmarks/prefill_cpu.py [--model qwen2.5-coder-1.5b-instruct] [--rows 128,512,1024,2048]
        [--threads 2] [--repeats 2] [--llamacpp] [--out benchmarks/results/prefill_cpu.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rows", default="128,512,1024,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--llamacpp", action="store_true", help="also llama.cpp's llama-bench prompt processing")
    ap.add_argument("--greedy-check", type=int, default=0, metavar="N",
                    help="also decode the first N bench prompts greedily (48 tokens) with the scalar and the blocked "
                         "attention, and count the identical outputs (the two sum their scores in other orders)")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/prefill_cpu.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from forerun.config import CacheConfig
    from forerun.kernels import cbuild, cpu_layer, cpu_q4
    from forerun.models.registry import load_model
    from forerun.runtime.runner import Chunk, ModelRunner

    lib, layer = cpu_q4._load(), cpu_layer._load()
    if lib is None or layer is None:
        print("prefill_cpu: the C kernels do not run here", file=sys.stderr)
        return 2
    rows = [int(r) for r in a.rows.split(",")]
    model, tok, _ = load_model(a.model, quantize="auto", progress=False)
    runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=max(rows) // 16 + 8), "cpu", torch.float32,
                         max_batch_tokens=max(rows))
    text = open(REPO / "forerun/engine/engine.py").read()  # a long prompt (any text: the cost does not depend on it)
    ids = tok.encode(text)[:max(rows)]
    budget = lib.q4_row_block_bytes(-1)
    settings = {"session 42": (0, 0), "row blocks": (budget, 0), "blocked attention": (0, 1), "both (now)": (budget, 1)}
    out = []
    print(f"{a.model}, {a.threads} threads, ISA {cbuild.isa()}, row block budget {budget} bytes")
    print("| tokens | " + " | ".join(f"{n} ms" for n in settings) + " | now x session 42 | tok/s now |")
    print("| --- " * (len(settings) + 3) + "|")
    with torch.inference_mode():
        for m in rows:
            best, logits = {}, {}
            for _ in range(a.repeats):
                for name, (b, att) in settings.items():
                    lib.q4_row_block_bytes(b)
                    layer.attn_rows_blocked(att)
                    runner.kv.add_sequence(0)
                    t = time.perf_counter()
                    o, _ = runner.forward([Chunk(0, ids[:m], logits="last")])
                    dt = time.perf_counter() - t
                    runner.kv.free(0)
                    best[name] = min(best.get(name, dt), dt)
                    logits[name] = o.logits
            lib.q4_row_block_bytes(budget)
            layer.attn_rows_blocked(1)
            row = {"tokens": m, **{f"{n} ms": round(1e3 * best[n], 1) for n in settings},
                   "speedup": round(best["session 42"] / best["both (now)"], 3),
                   "tok_per_s_now": round(m / best["both (now)"], 1),
                   "row_blocks_bit_identical": torch.equal(logits["session 42"], logits["row blocks"])
                   and torch.equal(logits["blocked attention"], logits["both (now)"]),
                   "attention_max_rel_diff": round(((logits["both (now)"] - logits["row blocks"]).abs().max()
                                                    / logits["row blocks"].abs().max()).item(), 7)}
            out.append(row)
            print(f"| {m} | " + " | ".join(str(row[f'{n} ms']) for n in settings) +
                  f" | {row['speedup']}x | {row['tok_per_s_now']} |", flush=True)
    greedy = greedy_check(model, tok, layer, a.greedy_check) if a.greedy_check else None
    peer = llamacpp_prefill(a.model, rows, a.threads) if a.llamacpp else None
    if peer:
        for row in out:
            got = peer.get(row["tokens"])
            if got:
                row["llamacpp_tok_per_s"] = got
                row["now_x_llamacpp"] = round(row["tok_per_s_now"] / got, 3)
                print(f"llama.cpp prompt processing, {row['tokens']} tokens: {got} tok/s; forerun now "
                      f"{row['now_x_llamacpp']}x")
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "model": a.model, "threads": a.threads, "repeats": a.repeats, "isa": cbuild.isa(),
                    "row_block_bytes": budget, "amx_min_rows": cpu_q4.amx_min_rows(),
                    "loadavg": list(os.getloadavg())},
           "forward": out, "greedy_check": greedy}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for n, mark in zip(settings, "o^vs"):
        ax.plot(rows, [r[f"{n} ms"] / r["tokens"] for r in out], mark + "-", label=f"forerun, {n}")
    if peer:
        ax.plot([r["tokens"] for r in out if "llamacpp_tok_per_s" in r],
                [1e3 / r["llamacpp_tok_per_s"] for r in out if "llamacpp_tok_per_s" in r], "k*--", label="llama.cpp")
    ax.set_xlabel("prompt tokens in one forward")
    ax.set_ylabel("ms per token")
    ax.set_title(f"{a.model} int4 prefill, {a.threads} threads ({cbuild.isa()})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.splitext(a.out)[0] + ".png", dpi=110)
    print(f"wrote {a.out}")
    return 0


def greedy_check(model, tok, layer, n: int) -> dict:
    """The first n bench prompts (chat template), 48 greedy tokens each, with the scalar attention and the blocked
    one: how many outputs are identical, and where the first difference falls in the others."""
    from forerun.bench_prompts import CODE_PROMPTS
    from forerun.engine.llm import LLM
    from forerun.sampling_params import SamplingParams

    llm = LLM.from_model(model, tok, device="cpu", max_num_seqs=1, enable_prefix_caching=False)
    got = {}
    for on in (0, 1):
        layer.attn_rows_blocked(on)
        got[on] = [o.token_ids for o in llm.generate(list(CODE_PROMPTS[:n]), SamplingParams(temperature=0, max_tokens=48),
                                                     chat=True)]
    layer.attn_rows_blocked(1)
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(got[0], got[1]) if a != b]
    res = {"prompts": n, "identical": sum(a == b for a, b in zip(got[0], got[1])), "first_difference_at": firsts}
    print(f"greedy, {n} bench prompts x 48 tokens: {res['identical']} identical with the scalar and the blocked "
          f"attention; first differences at tokens {firsts}")
    return res


def llamacpp_prefill(model: str, rows: list[int], threads: int) -> dict[int, float]:
    """llama.cpp's prompt processing (llama-bench -p M -n 0, its default repetitions) on the same GGUF: {M: tok/s}."""
    import subprocess

    from forerun.bench import llamacpp_built
    from forerun.models.hub import model_path

    b = llamacpp_built()
    if b is None:
        print("llama.cpp is not built (python benchmarks/llamacpp.py build): no peer rows", file=sys.stderr)
        return {}
    cmd = [str(b / "llama-bench"), "-m", str(model_path(model)), "-p", ",".join(map(str, rows)), "-n", "0", "-t",
           str(threads), "-o", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        print(f"llama-bench failed: {res.stderr[-500:]}", file=sys.stderr)
        return {}
    return {int(r["n_prompt"]): round(float(r["avg_ts"]), 1) for r in json.loads(res.stdout)}


if __name__ == "__main__":
    sys.exit(main())
