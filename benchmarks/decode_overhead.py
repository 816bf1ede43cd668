"""Where a plain decode step's time goes on the engine path (LLM.generate, as `forerun bench` runs it) versus
the bare model forward of one token (as benchmarks/quant_cost.py times it), on the real GGUF target.

Why: issue 12 compares forerun's end-to-end tok/s with llama.cpp's; the gap between the two numbers below is
engine/Python/sampling overhead, the rest is the forward (linears, attention, logits).

    python benchmarks/decode_overhead.py [--quantize auto] [--threads 2] [--tokens 48] [--profile]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--profile", action="store_true", help="torch profiler table of one engine generate")
    ap.add_argument("--others", default="layers", help="int4 layout: quant.INT4_OTHERS (int8, layers, int4)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from forerun.bench_prompts import CODE_PROMPTS
    from forerun.config import CacheConfig
    from forerun.engine.llm import LLM
    from forerun.models.registry import load_model
    from forerun.runtime.runner import Chunk, ModelRunner
    from forerun.sampling_params import SamplingParams

    from forerun.models import quant

    quant.INT4_OTHERS = a.others
    t0 = time.perf_counter()
    model, tok, _ = load_model(a.model, quantize=a.quantize, progress=False)
    print(f"loaded in {time.perf_counter() - t0:.0f}s ({a.quantize}), threads {a.threads}, load {os.getloadavg()}")
    prompts = list(CODE_PROMPTS[: a.prompts])
    llm = LLM.from_model(model, tok, device="cpu", enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=a.tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), chat=True)
    tps = []
    for p in prompts:
        t = time.perf_counter()
        out = llm.generate([p], sp, chat=True)
        dt = time.perf_counter() - t
        tps.append(len(out[0].token_ids) / dt)
    print(f"engine generate: {statistics.median(tps):.2f} tok/s (median of {len(prompts)} prompts, incl. prefill)")

    # engine decode steps alone: time per step after the prefill
    eng = llm.engine
    r = eng.make_request(prompts[0], sp, chat=True)
    eng.enqueue(r)
    steps = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    dec = statistics.median(steps[2:]) * 1e3
    print(f"engine step (decode, median): {dec:.2f} ms  -> {1e3 / dec:.1f} tok/s; prefill step {steps[0] * 1e3:.1f} ms")

    runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=64), "cpu", torch.float32)
    prefix = tok.encode("def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n" * 6)[:64]
    runner.kv.add_sequence(0)
    with torch.inference_mode():
        runner.forward([Chunk(0, prefix, logits="last")])
        res = {}
        for name, kw in (("bare forward q=1 (logits)", dict(logits="last")), ("bare forward q=1 no logits", dict(logits="none"))):
            ts = []
            for i in range(12):
                t = time.perf_counter()
                out = runner.forward([Chunk(0, [100 + i], **kw)])
                ts.append(time.perf_counter() - t)
            res[name] = statistics.median(ts[2:]) * 1e3
            print(f"{name}: {res[name]:.2f} ms")
        h = torch.randn(1, model.config.hidden_size)
        lm = model.lm_head
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            lg = lm(h)
            ts.append(time.perf_counter() - t)
        print(f"lm_head alone ({type(lm).__name__}): {statistics.median(ts[2:]) * 1e3:.2f} ms")
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            lg.argmax(-1).item()
            ts.append(time.perf_counter() - t)
        print(f"argmax over vocab: {statistics.median(ts[2:]) * 1e3:.3f} ms")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(prompts[1:2], SamplingParams(temperature=0, max_tokens=24), chat=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
