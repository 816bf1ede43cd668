"""The host gap of a round on the GPU: per engine step, wall time vs the time the GPU spent running kernels
(torch.profiler's CUDA kernel durations, CUDA-graph replays included). gap = wall - kernels is the time the
GPU waited for the host: scheduling, metadata, syncs, verification bookkeeping, detokenization.

  python benchmarks/host_gap.py --gpu [--label before]    random Qwen3-8B-shape target + 0.6B-shape draft
  python benchmarks/host_gap.py --tiny                     CPU smoke run (tiny random models; no kernel times)

Configs: plain decoding (overlapped on CUDA graphs) and a k = 4 draft round with synthetic acceptance 0.8
(benchmarks/online.py's SyntheticSampler), at concurrency 1 and 16. Also prints the host functions that
cost the most (cProfile, tottime) for the k = 4, c = 1 case. Writes benchmarks/results/host_gap_<label>.json.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pstats
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from forerun.config import CacheConfig, SpecConfig  # noqa: E402
from forerun.engine.engine import Engine  # noqa: E402
from forerun.sampling_params import SamplingParams  # noqa: E402
from online import SyntheticSampler  # noqa: E402


def kernel_seconds(prof) -> float:
    """Sum of GPU kernel (and memcpy/memset) durations in a profile: one stream, so they do not overlap."""
    total = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return total * 1e-6


def run_steps(eng: Engine, prompts, new_tokens: int, steps: int, prof_steps: int | None, cuda: bool):
    """Start len(prompts) requests, step until they have emitted a few tokens, then time `steps` steps."""
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, sp)
    for _ in range(4):  # past the prefill
        eng.step()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    toks = 0
    for _ in range(steps):
        toks += sum(len(d.new_token_ids) for d in eng.step())
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    busy = None
    if cuda and prof_steps:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(prof_steps):
                eng.step()
            torch.cuda.synchronize()
        busy = kernel_seconds(prof) / prof_steps
        # the profiler slows the host: the gap is wall (unprofiled) minus kernels (profiled)
    while eng.has_unfinished():  # drain
        for r in list(eng.requests):
            eng.abort(r)
        eng.step()
    return dict(steps=steps, wall_ms_per_step=wall / steps * 1e3, tokens_per_step=toks / steps,
                kernel_ms_per_step=None if busy is None else busy * 1e3,
                gap_ms_per_step=None if busy is None else (wall / steps - busy) * 1e3)


def host_profile(eng: Engine, prompts, new_tokens: int, steps: int) -> str:
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, sp)
    for _ in range(4):
        eng.step()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        eng.step()
    pr.disable()
    for r in list(eng.requests):
        eng.abort(r)
    while eng.has_unfinished():
        eng.step()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--gpu", action="store_true")
    g.add_argument("--tiny", action="store_true")
    ap.add_argument("--label", default="now")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    T0 = time.perf_counter()

    def log(m):
        print(f"[{time.perf_counter() - T0:6.1f}s] {m}", flush=True)

    if args.gpu:
        from gpu import BF16, QWEN3_06B, QWEN3_8B, _NoTextTokenizer, build_model

        target, draft = build_model(QWEN3_8B, None, seed=0), build_model(QWEN3_06B, None, seed=3)
        tok, vocab, kw = _NoTextTokenizer(), 151936, dict(device="cuda", dtype=BF16)
    else:
        sys.path.insert(0, os.path.join(REPO, "tests"))
        from tiny import hf_model, model_from_hf as ours, tiny_tokenizer

        vocab = 1000
        target, draft = ours(hf_model("qwen3", 0, vocab_size=vocab)), ours(hf_model("qwen3", 1, vocab_size=vocab, num_hidden_layers=1))
        tok, kw = tiny_tokenizer(vocab), dict(device="cpu")
    cuda = args.gpu
    cache = CacheConfig(block_size=16, num_blocks=4000 if cuda else 512)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (128,), generator=gen).tolist() for _ in range(max(args.concurrency))]
    log("models built")

    def make(k, overlap_spec=False):
        if k == 0:
            return Engine.from_model(target, tok, cache=cache, max_num_seqs=64, **kw, enable_prefix_caching=False)
        eng = Engine.from_model(target, tok, cache=cache, max_num_seqs=64, overlap_spec=overlap_spec,
                                spec=SpecConfig(method="draft", draft_model=(draft, tok), k=k), **kw,
                                enable_prefix_caching=False)
        eng.round.sampler = eng.sampler = SyntheticSampler(0.8)
        return eng

    rows, text = [], ""
    for k, ovs in ((0, False), (4, False), (4, True)):  # (k = 4 overlapped: engine/overlap_spec.py, CUDA graphs)
        if ovs and not cuda:
            continue
        eng = make(k, ovs)
        run_steps(eng, prompts[:1], 64, 8, None, cuda)  # capture graphs
        for c in args.concurrency:
            run_steps(eng, prompts[:c], 400, 8, None, cuda)  # graphs for this batch size
            r = run_steps(eng, prompts[:c], 400, args.steps, 10 if cuda else None, cuda)
            r.update(config="plain" if k == 0 else f"k={k}, synthetic a=0.8" + (", overlapped" if ovs else ""),
                     concurrency=c)
            rows.append(r)
            log(f"{r['config']:>22} c={c:<3} wall {r['wall_ms_per_step']:7.2f} ms/step  "
                f"kernels {r['kernel_ms_per_step'] or float('nan'):7.2f}  gap {r['gap_ms_per_step'] or float('nan'):6.2f}  "
                f"tokens/step {r['tokens_per_step']:.2f}")
        if k and not ovs:
            text = host_profile(eng, prompts[:1], 400, args.steps)
        del eng
    print(text)
    res = dict(label=args.label, rows=rows, host_profile_k4_c1=text.splitlines()[:45],
               device=torch.cuda.get_device_name() if cuda else "cpu (tiny models)",
               date=datetime.datetime.now().isoformat(timespec="seconds"))
    out = os.path.join(os.environ.get("OUT") or os.path.join(REPO, "benchmarks", "results"), f"host_gap_{args.label}.json")
    if cuda:
        json.dump(res, open(out, "w"), indent=1)
        print("wrote", out)


if __name__ == "__main__":
    main()
