"""A/B of the CPU int4 kernel (forerun/kernels/cpu_q4.c) against its source at another git revision: the same packed
weights (random, DRAM-sized: copies rotate so no cache holds them), the same activation rows, both builds called
alternately in one process, taking turns going first, each call on another copy than the call before (so neither
build reads weights the other left in the L3), ratios in one run on a noisy host; outputs compared bit for bit (the layout did not
change, so they must be equal). Prints a table of ms per product and writes JSON.

    python benchmarks/cpu_q4_ab.py --against HEAD~1 [--threads 2] [--rows 3,5,8,16,45]
        [--shapes 1536x8960,17920x1536,896x4864,9728x896] [--out benchmarks/results/cpu_q4_ab.json]
    python benchmarks/cpu_q4_ab.py --against REV --q6k [--shapes 151936x1536]    the exact Q6_K head (q6k_gemm)
    python benchmarks/cpu_q4_ab.py --against REV --q8 [--shapes ...]             the int8 layout (q8_gemm)
    python benchmarks/cpu_q4_ab.py --against HEAD --flags=-mtune=znver2           compiler flags alone
    python benchmarks/cpu_q4_ab.py --against HEAD --entry-offsets 0,16,32,48 --rows 1,2   where run_groups lands
    python benchmarks/cpu_q4_ab.py --against REV --forward qwen2.5-coder-1.5b-instruct [--rows 1,2,3,4,8]
        whole forwards of q = rows new tokens after a 64-token prefix (the model loaded once, int4; the two builds
        swapped in as cpu_q4's library call by call, taking turns going first); logits compared bit for bit

Default shapes: the Qwen2.5-Coder-1.5B down and gate/up products (N x K), the 0.5B draft's down and gate/up; with
--q6k the 1.5B's output head (random Q6_K blocks, two copies), whose outputs are compared to 1e-5 of their size
instead of bit for bit (a kernel may add its float lanes in another order; each build is row-invariant by itself,
tests/test_quant.py).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SRC = "forerun/kernels/cpu_q4.c"


def random_packs(n: int, k: int, mb: float, g: torch.Generator, q8: bool = False) -> list[torch.Tensor]:
    """Copies of random int4 weights [n, k] packed for cpu_q4 (codes 0..15, fp16 scales, offset -8 * scale; with q8
    the int8 layout: codes -128..127, fp16 scales), about `mb` megabytes of int4 in all and at least 5, so that calls
    taking turns over them never find their weights in cache."""
    from forerun.kernels import cpu_q4

    copies = max(5, int(mb * 1e6 // (n * k * 5 / 8)))  # (odd or >= 5: consecutive calls never share one)
    packs = []
    for _ in range(copies):
        s = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        if q8:
            packs.append(cpu_q4.pack_q8(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g), s))
            continue
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        packs.append(cpu_q4.pack_weights(q, s, -8 * s))
    return packs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="git revision whose cpu_q4.c is the baseline")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,5,8,16,45")
    ap.add_argument("--shapes", default="1536x8960,17920x1536,896x4864,9728x896")
    ap.add_argument("--mb", type=float, default=100.0, help="weight megabytes per shape (copies rotate)")
    ap.add_argument("--q6k", action="store_true", help="the Q6_K head's product (q6k_gemm) instead of the int4 one")
    ap.add_argument("--q8", action="store_true", help="the int8 layout's product (q8_gemm, Q8Linear) instead")
    ap.add_argument("--flags", default="", help="extra compiler flags for the current source's build, e.g. "
                    "'-mtune=znver2' (with --against HEAD: an A/B of the flags alone)")
    ap.add_argument("--forward", metavar="MODEL", help="whole forwards of this model (int4) instead of single products")
    ap.add_argument("--repeats", type=int, default=9, help="--forward: forwards per build and q")
    ap.add_argument("--entry-offsets", metavar="0,16,32,48", help="the current source once per offset of run_groups "
                    "past a 64-byte boundary (-DRUN_GROUPS_ENTRY), each against the baseline")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cpu_q4_ab.json"))
    a = ap.parse_args()
    if a.q6k and a.shapes == ap.get_default("shapes"):
        a.shapes = "151936x1536"
    torch.set_num_threads(a.threads)
    from forerun.kernels import cbuild, cpu_q4

    if not cpu_q4.available():
        print("cpu_q4_ab: the C kernel does not build here", file=sys.stderr)
        return 2
    try:
        old_src = subprocess.run(["git", "show", f"{a.against}:{SRC}"], cwd=REPO, check=True, capture_output=True,
                                 text=True).stdout
    except subprocess.CalledProcessError as e:
        print(f"cpu_q4_ab: git show {a.against}:{SRC} failed: {e.stderr.strip()}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="cpu_q4_ab_")) / "cpu_q4.c"
    tmp.write_text(old_src)
    before = cbuild.library_for(tmp, cbuild.isa(), [], cpu_q4._declare)
    rows_list = [int(x) for x in a.rows.split(",")]
    variants = [a.flags] if not a.entry_offsets else [f"{a.flags} -DRUN_GROUPS_ENTRY={e}".strip()
                                                     for e in a.entry_offsets.split(",")]
    results = []
    for flags in variants:
        if a.entry_offsets:
            print(f"-- the current source built with {flags}")
        now = cpu_q4._load() if not flags else cbuild.library_for(Path(cpu_q4.__file__).with_name("cpu_q4.c"),
                                                                  cbuild.isa(), flags.split(), cpu_q4._declare)
        libs = {"before": before, "now": now}
        part = (forward_ab if a.forward else q6k_ab if a.q6k else products_ab)(libs, a, rows_list)
        if part is None:
            return 1
        results += [{**r, "flags": flags} for r in part] if a.entry_offsets else part
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "against": a.against, "flags": a.flags,
            "threads": a.threads, "isa": cbuild.isa(),
            "product": f"{a.forward} forward (int4)" if a.forward else "q6k_gemm" if a.q6k else "q8_gemm" if a.q8
            else "q4_gemm", "bit_identical": not a.q6k}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {a.out}")
    return 0


def products_ab(libs: dict, a, rows_list: list[int]) -> list[dict] | None:
    """Single products (q4_gemm, or q8_gemm with --q8) on random weights of each shape: both builds alternately,
    taking turns going first, each call on another of >= 5 DRAM-sized weight copies; outputs compared bit for bit."""
    from forerun.kernels import cpu_q4

    results = []
    print(f"{'N x K':>12} {'rows':>5} {'before ms':>10} {'now ms':>8} {'now/before':>10}")
    for shape in a.shapes.split(","):
        n, k = (int(x) for x in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        packs = random_packs(n, k, a.mb, g, q8=a.q8)
        copies = len(packs)
        for m in rows_list:
            xq, xs, isum = cpu_q4.quantize_activations_c(torch.randn(m, k, generator=g))
            ys = {v: torch.empty(m, n) for v in libs}
            def gemm(lib, pk, y):
                if a.q8:
                    lib.q8_gemm(pk.data_ptr(), n, k, xq.data_ptr(), xs.data_ptr(), m, y.data_ptr(), a.threads)
                else:
                    lib.q4_gemm(pk.data_ptr(), n, k, xq.data_ptr(), xs.data_ptr(), isum.data_ptr(), m, y.data_ptr(),
                                a.threads)

            for v, lib in libs.items():  # the same bits from both
                gemm(lib, packs[0], ys[v])
            if not torch.equal(ys["before"], ys["now"]):
                print(f"cpu_q4_ab: outputs differ at {shape}, {m} rows", file=sys.stderr)
                return None
            times = {v: [] for v in libs}
            names = list(libs)
            for it in range(3 * copies):  # every call reads another copy than the call before (no L3 reuse), and
                order = names if it % 2 == 0 else names[::-1]  # the builds take turns going first
                for j, v in enumerate(order):
                    pk = packs[(2 * it + j) % copies]
                    t = time.perf_counter()
                    gemm(libs[v], pk, ys[v])
                    times[v].append(time.perf_counter() - t)
            med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
            results.append({"n": n, "k": k, "rows": m, "before_ms": round(med["before"], 4),
                            "now_ms": round(med["now"], 4), "ratio": round(med["now"] / med["before"], 3)})
            print(f"{shape:>12} {m:>5} {med['before']:>10.3f} {med['now']:>8.3f} {med['now'] / med['before']:>10.3f}",
                  flush=True)
    return results


@functools.lru_cache(maxsize=1)
def _runner_with_prefix(model_name: str):
    """The model (int4) in a CPU runner whose sequence 0 holds a 64-token prefix (loaded once per process: every
    --entry-offsets variant reuses it). Returns (runner, prefix length)."""
    from forerun.config import CacheConfig
    from forerun.models.registry import load_model
    from forerun.runtime.runner import Chunk, ModelRunner

    model, tok, _ = load_model(model_name, quantize="int4", progress=False)
    runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=64), "cpu", torch.float32)
    prefix = tok.encode("def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n" * 6)[:64]
    runner.kv.add_sequence(0)
    with torch.inference_mode():
        runner.forward([Chunk(0, prefix, logits="last")])
    return runner, len(prefix)


def forward_ab(libs: dict, a, rows_list: list[int]) -> list[dict] | None:
    """--forward: the model's forward of q new tokens after a 64-token prefix with each build as cpu_q4's library
    (every C product of the forward: int4, int8 and the Q6_K head), alternating, median ms per forward."""
    from forerun.kernels import cpu_q4
    from forerun.runtime.runner import Chunk

    runner, prefix_len = _runner_with_prefix(a.forward)
    loader = cpu_q4._load

    def forward(v: str, q: int):
        cpu_q4._load = lambda: libs[v]  # cpu_q4 and cpu_layer look the library up at every call
        out = runner.forward([Chunk(0, list(range(100, 100 + q)), logits="all")])[0].logits
        runner.kv.truncate(0, prefix_len)
        return out

    results = []
    print(f"{'q':>3} {'before ms':>10} {'now ms':>8} {'now/before':>10}")
    try:
        with torch.inference_mode():
            for q in rows_list:
                if not torch.equal(forward("before", q), forward("now", q)):
                    print(f"cpu_q4_ab: the forward's logits differ at q = {q}", file=sys.stderr)
                    return None
                times = {v: [] for v in libs}
                for it in range(a.repeats):
                    for v in (list(libs) if it % 2 == 0 else list(libs)[::-1]):
                        t = time.perf_counter()
                        forward(v, q)
                        times[v].append(time.perf_counter() - t)
                med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
                results.append({"q": q, "before_ms": round(med["before"], 3), "now_ms": round(med["now"], 3),
                                "ratio": round(med["now"] / med["before"], 3)})
                print(f"{q:>3} {med['before']:>10.2f} {med['now']:>8.2f} {med['now'] / med['before']:>10.3f}",
                      flush=True)
    finally:
        cpu_q4._load = loader
    return results


def q6k_ab(libs: dict, a, rows_list: list[int]) -> list[dict] | None:
    """--q6k: q6k_gemm of both builds on random Q6_K blocks (two copies, taking turns), median ms per product."""
    import numpy as np

    from forerun.kernels import cpu_q4

    results = []
    print(f"{'N x K':>12} {'rows':>5} {'before ms':>10} {'now ms':>8} {'now/before':>10}")
    for shape in a.shapes.split(","):
        n, k = (int(x) for x in shape.split("x"))
        rng = np.random.default_rng(0)
        packs = []
        for _ in range(2):
            b = rng.integers(0, 256, size=(n * k // 256, cpu_q4.Q6K_BLOCK), dtype=np.uint8)
            b[:, 208:210] = np.float16(rng.uniform(0.001, 0.01, size=(b.shape[0], 1))).view(np.uint8)
            packs.append(cpu_q4.pack_q6k(b.reshape(n, -1)))
        for m in rows_list:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            xq, xs, bsum = cpu_q4.q6k_activations(x)
            ys = {v: torch.empty(m, n) for v in libs}
            times = {v: [] for v in libs}
            names = list(libs)
            for it in range(12):
                order = names if it % 2 == 0 else names[::-1]
                for j, v in enumerate(order):
                    pk = packs[(it + j) % 2]
                    t = time.perf_counter()
                    libs[v].q6k_gemm(pk.ctypes.data, n, k, xq.data_ptr(), xs.data_ptr(), bsum.data_ptr(), m,
                                     ys[v].data_ptr(), a.threads)
                    times[v].append(time.perf_counter() - t)
            for v in libs:  # both on the same copy for the comparison
                libs[v].q6k_gemm(packs[0].ctypes.data, n, k, xq.data_ptr(), xs.data_ptr(), bsum.data_ptr(), m,
                                 ys[v].data_ptr(), a.threads)
            diff = float((ys["now"] - ys["before"]).abs().max() / ys["before"].abs().max())
            if not diff <= 1e-5:
                print(f"cpu_q4_ab: q6k outputs differ by {diff:.2e} of their size at {shape}, {m} rows", file=sys.stderr)
                return None
            med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
            results.append({"n": n, "k": k, "rows": m, "before_ms": round(med["before"], 4),
                            "now_ms": round(med["now"], 4), "ratio": round(med["now"] / med["before"], 3),
                            "max_rel_diff": diff})
            print(f"{shape:>12} {m:>5} {med['before']:>10.3f} {med['now']:>8.3f} {med['now'] / med['before']:>10.3f}",
                  flush=True)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
