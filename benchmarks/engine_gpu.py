"""The user-facing path on the GPU: `LLM.generate` (host-side step preparation, verification, stop checks)
at the Qwen3-8B shape with random bf16 weights, batch 1 and 8, with overlapped decoding on and off side by
side, plus a torch.profiler summary of where the host time goes. Run on the H200 machine: `python benchmarks/engine_gpu.py`; prints a table, writes
benchmarks/results/engine_h200.json.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from gpu import BF16, QWEN3_06B, QWEN3_8B, _NoTextTokenizer, build_model, copy_bandwidth, weight_bytes  # noqa: E402

from forerun.config import SpecConfig  # noqa: E402
from forerun.engine.llm import LLM  # noqa: E402
from forerun.sampling_params import SamplingParams  # noqa: E402


def _timed(llm: LLM, prompts: list[list[int]], n: int) -> tuple[float, int]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    torch.cuda.synchronize()
    return time.perf_counter() - t, sum(len(o.token_ids) for o in outs)


def timed_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    """Decode speed with the prefill taken out: time(new_tokens) - time(1 token), over new_tokens - 1 steps."""
    t1, _ = _timed(llm, prompts, 1)
    tn, tokens = _timed(llm, prompts, new_tokens)
    steps = new_tokens - 1
    decode = tn - t1
    return dict(batch=len(prompts), tokens=tokens, seconds=tn, prefill_plus_first_s=t1, decode_s=decode,
                ms_per_step=decode / steps * 1e3, tok_s=len(prompts) * steps / decode)


def main() -> None:
    torch.manual_seed(0)
    model = build_model(QWEN3_8B, None, seed=0)
    _, read = weight_bytes(model)
    llm = LLM.from_model(model, _NoTextTokenizer(), device="cuda", dtype=BF16, enable_prefix_caching=False)
    prompt_len, new = 512, 128
    prompts = [torch.randint(0, model.config.vocab_size, (prompt_len,)).tolist() for _ in range(8)]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # capture + compile
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    bw = copy_bandwidth(2.0)
    total, _ = weight_bytes(model)
    floor_ms = total / bw * 1e3
    res = dict(device=torch.cuda.get_device_name(), date=datetime.datetime.now().isoformat(timespec="seconds"),
               torch=torch.__version__, shape="Qwen3-8B (random bf16)", prompt_len=prompt_len, new_tokens=new,
               copy_bandwidth_TBps=bw / 1e12, floor_ms=floor_ms,
               note="decode only: time of generate(max_tokens=128) minus generate(max_tokens=1), per step; "
                    "overlap on (the default) and off, alternated, twice each",
               runs=[])
    for b in (1, 8) if "--spec-only" not in sys.argv else ():
        for rep in range(2):
            for overlap in (False, True):
                llm.overlap = overlap
                r = timed_generate(llm, prompts[:b], new)
                r.update(overlap=overlap, rep=rep, fraction_of_floor=floor_ms / r["ms_per_step"] if b == 1 else None)
                res["runs"].append(r)
                print(f"LLM.generate batch {b}, overlap {'on ' if overlap else 'off'}: {r['tok_s']:.1f} tok/s decode "
                      f"({r['ms_per_step']:.3f} ms per step" + (f", {r['fraction_of_floor']:.1%} of the floor)" if b == 1
                                                               else ")"), flush=True)
    llm.overlap = True
    # Adaptive speculation with a draft that never agrees (random 0.6B-shaped weights, unrelated to the target):
    # k falls to 0, those rounds run overlapped between the scheduler's probes; it must not lose to plain decoding.
    tok = llm.tokenizer
    draft = build_model(QWEN3_06B, None, seed=3)
    spec_llm = LLM.from_model(model, tok, device="cuda", dtype=BF16,
                              spec=SpecConfig(method="draft", draft_model=(draft, tok), adaptive=True),
                              enable_prefix_caching=False)
    for b in (1, 8):  # warm-up: CUDA graphs of the probe / verify shapes are captured on first use (~1 s each)
        spec_llm.generate(prompts[:b], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    res["useless_draft_adaptive"] = []
    for b in (1, 8):
        ref = None
        for name, engine in (("plain", llm), ("adaptive spec, useless draft", spec_llm)):
            r = timed_generate(engine, prompts[:b], new)
            outs = engine.generate(prompts[:b], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
            st = engine.aggregate_stats(outs)
            ids = [o.token_ids for o in outs]
            ref = ref or ids  # bf16: verify rows may round differently from decode rows (near-ties can flip)
            r.update(config=name, drafted=st.drafted, accepted=st.accepted, rounds=st.rounds, identical_to_plain=ids == ref)
            res["useless_draft_adaptive"].append(r)
            print(f"LLM.generate batch {b}, {name}: {r['tok_s']:.1f} tok/s decode ({r['ms_per_step']:.3f} ms per step; "
                  f"drafted {st.drafted}, accepted {st.accepted})", flush=True)
    # where the host time goes: 32 decode steps at batch 1 under the profiler
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    print(table)
    ev = {e.key: dict(count=e.count, self_cpu_ms=e.self_cpu_time_total / 1e3) for e in prof.key_averages()}
    res["profile_b1_32_steps"] = dict(sorted(ev.items(), key=lambda kv: -kv[1]["self_cpu_ms"])[:40])
    res["graph_replays"], res["eager_steps"] = llm.runner.graphs.replays, llm.runner.graphs.eager_steps
    out = os.path.join(REPO, "benchmarks", "results", "engine_h200.json")
    json.dump(res, open(out, "w"), indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
