"""Stress arrivals joining overlapped speculative sessions on CUDA graphs (issue 9; the twelfth session's one
unexplained failure of `test_session_joins_and_leaves_on_cuda_graphs_equal_plain[True]`).

Many seeded random workloads (prompts, max_tokens, arrival steps) on the tiny sharpened float32 model of that test,
each run plainly (the reference), and speculatively with joins in session (`Engine.JOIN_IN_SESSION`) twice, with
a weak and a self draft. For every output that differs from plain it reports the request, the position, and the
reference model's (transformers, float64 on the CPU) top-1 / top-2 logit gap at that position: a gap near zero
is a float tie that batch shapes may flip; a clear gap is a bug (a stream-order hazard, a wrong row). Two runs of
the same workload that differ from each other point at a race.

    python benchmarks/joins_stress_gpu.py --trials 30 --out $OUT/joins_stress.json
    CUDA_LAUNCH_BLOCKING=1 python benchmarks/joins_stress_gpu.py ...   (a race usually vanishes)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--in-session", choices=["on", "off"], default="on")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true", help="eager graph stand-ins on the CPU (checks this script)")
    args = ap.parse_args()

    from tiny import hf_model, sharpen, tiny_tokenizer  # noqa: E402
    from forerun.config import CacheConfig, ModelConfig, SpecConfig
    from forerun.engine.engine import Engine
    from forerun.models.llama import LlamaForCausalLM
    from forerun.sampling_params import SamplingParams

    dev = torch.device("cpu" if args.cpu else "cuda")
    hf = sharpen(hf_model("llama"), 3.0)
    dhf = sharpen(hf_model("llama", seed=1, num_hidden_layers=1), 3.0)

    def build(h):
        m = LlamaForCausalLM(ModelConfig.from_hf(h.config.to_dict())).eval()
        m.load_weights(h.state_dict().items())
        m = m.to(dev, torch.float32)
        m.reset_rope(dev)
        return m

    tok = tiny_tokenizer()
    kw = dict(device=dev.type, dtype=torch.float32, cache=CacheConfig(block_size=16, num_blocks=512))
    plain = Engine.from_model(build(hf), tok, **kw, enable_prefix_caching=False)
    engines = {}
    for name, d in (("weak draft", dhf), ("self-draft", hf)):
        eng = Engine.from_model(build(hf), tok, spec=SpecConfig(method="draft", draft_model=(build(d), tok), k=3),
                                check_invariants=True, overlap_spec=True, **kw, enable_prefix_caching=False)
        eng.JOIN_IN_SESSION = args.in_session == "on"
        if args.cpu:  # eager stand-ins for the CUDA graphs, on both runners (as tests/test_overlap_spec.py does)
            from forerun.runtime.cuda_graph import GraphRunner

            for runner in (eng.runner, eng.drafter.runner):
                runner.graphs = GraphRunner(runner, batch_sizes=(1, 2, 4, 8), max_q_len=eng.spec.max_draft_tokens + 1,
                                            use_graphs=False)
            eng.scheduler.draft_prefill = False
        else:
            eng.warmup(max_batch=8)
        engines[name] = eng
    ref64 = hf.double()

    def gap(prefix: list[int]) -> float:
        with torch.no_grad():
            logits = ref64(torch.tensor([prefix])).logits[0, -1]
        top = logits.topk(2).values
        return float(top[0] - top[1])

    def drive(eng, work, tag):
        out, step = {}, 0
        arrivals = [w[2] for w in work]
        while step <= max(arrivals) or eng.has_unfinished():
            for i, (p, m, at) in enumerate(work):
                if at == step:
                    eng.add_request(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True),
                                    request_id=f"{tag}-{i}")
            for d in eng.step():
                out.setdefault(int(d.request_id.split("-")[-1]), []).extend(d.new_token_ids)
            step += 1
        return out

    rng = random.Random(args.seed)
    results, t0 = [], time.time()
    print(f"{'trial':>5} {'draft':>10} {'run':>3} {'joins':>5} {'mixed':>5} {'reads':>5} {'diffs':>5}  "
          "first difference (req, pos, got, want, gap)")
    for trial in range(args.trials):
        n = rng.randint(3, 10)
        work = []
        for i in range(n):
            plen = rng.choice([2, 3, 5, 9, 17, 33, 70, 120])
            work.append(([rng.randrange(2, 97) for _ in range(plen)], rng.randint(2, 45), rng.randint(0, 20)))
        want = drive(plain, work, f"t{trial}p")
        for name, eng in engines.items():
            runs = []
            for rep in range(2):
                joins0, reads0, mixed0 = eng.session_joins, eng.session_reads, eng.mixed_joins
                got = drive(eng, work, f"t{trial}{name[0]}{rep}")
                diffs = []
                for i in range(n):
                    g, w = got.get(i, []), want[i]
                    if g != w:
                        pos = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
                        gp = gap(work[i][0] + w[:pos]) if pos < len(w) else None
                        diffs.append(dict(request=i, position=pos, got=g[pos] if pos < len(g) else None,
                                          want=w[pos] if pos < len(w) else None, gap=gp, got_len=len(g),
                                          want_len=len(w)))
                runs.append(got)
                free_ok = (eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks - 1
                           and eng.drafter.kv.num_free_blocks == eng.drafter.kv.num_blocks - 1)
                row = dict(trial=trial, draft=name, rep=rep, joins=eng.session_joins - joins0,
                           mixed=eng.mixed_joins - mixed0,
                           reads=eng.session_reads - reads0, diffs=diffs, blocks_back=free_ok)
                results.append(row)
                first = diffs[0] if diffs else None
                fd = "" if first is None else (f"{first['request']}, {first['position']}, {first['got']}, "
                                               f"{first['want']}, {first['gap'] if first['gap'] is None else round(first['gap'], 6)}")
                print(f"{trial:>5} {name:>10} {rep:>3} {row['joins']:>5} {row['mixed']:>5} {row['reads']:>5} "
                      f"{len(diffs):>5}  {fd}"
                      + ("" if free_ok else "  BLOCKS LEAKED"), flush=True)
            if runs[0] != runs[1]:
                print(f"      {name}: the two runs of trial {trial} differ from each other", flush=True)
                results.append(dict(trial=trial, draft=name, nondeterministic=True))
    bad = [r for r in results if r.get("diffs") or r.get("nondeterministic") or r.get("blocks_back") is False]
    summary = dict(trials=args.trials, in_session=args.in_session, runs=sum(1 for r in results if "rep" in r),
                   failing=len(bad), seconds=round(time.time() - t0, 1),
                   blocking=os.environ.get("CUDA_LAUNCH_BLOCKING", "0"), device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(summary=summary, results=results), f, indent=1)


if __name__ == "__main__":
    main()
