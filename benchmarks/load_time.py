"""Model load time: forerun's `load_model` (checkpoint parse, weights into their layout, tokenizer) in a fresh process
per load, this tree against another git revision (a temporary worktree), taking turns; llama.cpp's load of the same
GGUF (plus one token) beside them. Prints a table and writes JSON and a PNG plot.

    python benchmarks/load_time.py --against HEAD~1 [--repeats 3] [--threads 2]
        [--cases qwen2.5-coder-1.5b-instruct:auto,qwen2.5-coder-0.5b-instruct:auto,smollm2-135m-instruct:auto,
                 qwen2.5-coder-1.5b-instruct:none] [--out benchmarks/results/load_time_cpu.json]

Each tree loads every case once untimed first (page cache warm for the GGUF files, forerun's tokenizer cache
filled where the tree has one); then `--repeats` timed rounds, the trees taking turns going first. A fresh
process includes Python's imports (torch, transformers), as a user's `forerun generate` does.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[3]))
from forerun.models.registry import load_model
model, tok, ckpt = load_model(sys.argv[1], quantize=sys.argv[2], progress=False)
t1 = time.perf_counter()
tok.encode("warm")
print(json.dumps({"seconds": t1 - t0, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def load_once(tree: Path, model: str, layout: str, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", CHILD, model, layout, str(threads)], cwd=tree, env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"load of {model} ({layout}) in {tree} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llamacpp_load(model: str, threads: int) -> float | None:
    """Seconds for llama.cpp's llama-simple to load the GGUF and decode one token (None if not built)."""
    from forerun.bench import llamacpp_built
    from forerun.models.hub import resolve_model

    bins = llamacpp_built()
    if bins is None or not (bins / "llama-simple").exists():
        return None
    t = time.perf_counter()
    subprocess.run([str(bins / "llama-simple"), "-m", str(resolve_model(model)), "-n", "1", "hi"],
                   capture_output=True, check=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="HEAD", help="git revision to compare with (default HEAD: the last commit)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default="qwen2.5-coder-1.5b-instruct:auto,qwen2.5-coder-0.5b-instruct:auto,"
                                       "smollm2-135m-instruct:auto,qwen2.5-coder-1.5b-instruct:none")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "load_time_cpu.json"))
    a = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", a.against], cwd=REPO, check=True, capture_output=True,
                         text=True).stdout.strip()
    wt = Path(tempfile.mkdtemp(prefix="load_time_")) / rev
    subprocess.run(["git", "worktree", "add", "--detach", str(wt), rev], cwd=REPO, check=True, capture_output=True)
    trees = {"before": wt, "now": REPO}
    cases = [tuple(c.split(":")) for c in a.cases.split(",")]
    try:
        for model, layout in cases:  # warm-up: page cache, tokenizer cache
            for t in trees.values():
                load_once(t, model, layout, a.threads)
            llamacpp_load(model, a.threads)
        times = {(m, l): {v: [] for v in trees} for m, l in cases}
        rss = {(m, l): {} for m, l in cases}
        llama = {m: [] for m, _ in cases}
        for r in range(a.repeats):
            for model, layout in cases:
                order = list(trees) if r % 2 == 0 else list(trees)[::-1]
                for v in order:
                    got = load_once(trees[v], model, layout, a.threads)
                    times[(model, layout)][v].append(got["seconds"])
                    rss[(model, layout)][v] = got["peak_rss_gb"]
                if layout in ("auto", "int4"):
                    s = llamacpp_load(model, a.threads)
                    if s is not None:
                        llama[model].append(s)
                print(f"round {r + 1}/{a.repeats}: {model} {layout} done", file=sys.stderr, flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=REPO, capture_output=True)
    rows = []
    print(f"{'model':>30} {'layout':>6} {'before s':>9} {'now s':>7} {'now/before':>10} {'RSS GB':>7} {'llama.cpp s':>11}")
    for model, layout in cases:
        t = times[(model, layout)]
        b, n = statistics.median(t["before"]), statistics.median(t["now"])
        lc = statistics.median(llama[model]) if llama[model] and layout in ("auto", "int4") else None
        rows.append({"model": model, "layout": layout, "before_s": b, "now_s": n, "ratio": n / b,
                     "before_all": t["before"], "now_all": t["now"], "peak_rss_gb_now": rss[(model, layout)]["now"],
                     "peak_rss_gb_before": rss[(model, layout)]["before"], "llamacpp_load_and_1_token_s": lc})
        print(f"{model:>30} {layout:>6} {b:9.1f} {n:7.1f} {n / b:10.2f} {rss[(model, layout)]['now']:7.2f} "
              f"{'-' if lc is None else f'{lc:.2f}':>11}")
    from forerun.kernels import cbuild

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"against": rev, "threads": a.threads, "repeats": a.repeats, "cpu": cbuild.cpu_name(),
                               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "rows": rows}, indent=1))
    _plot(rows, out.with_suffix(".png"), rev)
    print(f"wrote {out}")
    return 0


def _plot(rows: list[dict], png: Path, rev: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model'].split('-instruct')[0]}\n{r['layout']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.27 for i in x], [r["before_s"] for r in rows], 0.27, label=f"forerun {rev}")
    ax.bar(list(x), [r["now_s"] for r in rows], 0.27, label="forerun now")
    ax.bar([i + 0.27 for i in x], [r["llamacpp_load_and_1_token_s"] or 0 for r in rows], 0.27,
           label="llama.cpp (load + 1 token)")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("seconds (fresh process)")
    ax.set_title("model load time, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
