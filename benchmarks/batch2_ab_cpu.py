"""Two requests decoding together on the CPU (plain greedy, batch 2, the int4 1.5B target) with forerun imported from
two source trees, run alternately: an end-to-end A/B of a kernel change that touches 2-row products (session 49:
cpu_q4.c's 2-row path). Each tree runs in its own process (its C kernels build from its own source); the child
prints tok/s for 3 pairs of bench prompts, twice. Prints a table, writes JSON.

    python benchmarks/batch2_ab_cpu.py --before /tmp/clone_at_old_rev --after /tmp/clone_at_new_rev [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import sys, time, json, torch
torch.set_num_threads(2)
from forerun import LLM, SamplingParams
import forerun, forerun.bench_prompts as BP
assert forerun.__file__.startswith(sys.argv[1]), forerun.__file__
P = list(BP.CODE_PROMPTS[:6])
llm = LLM("qwen2.5-coder-1.5b-instruct")
sp = SamplingParams(temperature=0, max_tokens=64)
llm.generate(P[:2], sp, chat=True)  # (warm-up)
out, texts = [], []
for rep in range(2):
    for a in range(0, 6, 2):
        t = time.perf_counter(); o = llm.generate(P[a:a + 2], sp, chat=True); dt = time.perf_counter() - t
        out.append(sum(len(x.token_ids) for x in o) / dt)
        texts += [x.text for x in o]
print(json.dumps({"tok_s": out, "texts": texts}))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "batch2_ab_cpu.json"))
    a = ap.parse_args()
    res = {"before": [], "after": []}
    texts = {}
    for _ in range(a.rounds):
        for name, tree in (("before", a.before), ("after", a.after)):
            p = subprocess.run([sys.executable, "-c", CHILD, str(Path(tree).resolve())], capture_output=True,
                               text=True, cwd=str(Path(tree).resolve()), env={"PYTHONPATH": str(Path(tree).resolve()), "PATH": "/usr/bin:/bin",
                                               "HOME": str(Path.home())})
            if p.returncode:
                print(p.stderr[-2000:], file=sys.stderr)
                return 1
            got = json.loads(p.stdout.strip().splitlines()[-1])
            res[name] += got["tok_s"]
            texts[name] = got["texts"]
            print(f"{name:6s} {' '.join(f'{x:.1f}' for x in got['tok_s'])}", flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    same = texts["before"] == texts["after"]
    print(f"median tok/s (2 requests together): before {med['before']:.1f}, after {med['after']:.1f}, "
          f"after / before {med['after'] / med['before']:.3f}; outputs identical: {same}")
    Path(a.out).write_text(json.dumps({"before": a.before, "after": a.after, "tok_s": res, "median": med,
                                       "ratio": med["after"] / med["before"], "outputs_identical": same}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
