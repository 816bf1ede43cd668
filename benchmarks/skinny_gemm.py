#!/usr/bin/env python
"""Tune and measure the skinny Triton GEMM (forerun/kernels/skinny_gemm.py) against cuBLAS on one CUDA GPU.

For every linear layer shape of the benchmark models (Qwen3-8B / 0.6B, Qwen2.5-Coder-1.5B / 0.5B) and every
row count M in 1, 2, 4, 8, 16, each candidate configuration runs in a CUDA graph over enough distinct weight
copies that they do not fit in L2 (as in a real forward, where every layer has its own matrices); the best is
kept if it is correct (bf16 vs a float32 product: relative error < 1e-2) and compared with cuBLAS
(F.linear; for gate/up, F.linear then silu * up; for the head, F.linear then .float()) in the same run.

    python benchmarks/skinny_gemm.py [--quick]

Writes the winning configurations to forerun/kernels/skinny_configs.json under the card's name (read by
skinny_gemm.pick_config), the full results to benchmarks/results/skinny_gemm_<card>.json, and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time

import torch
import triton

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from forerun.kernels.skinny_gemm import CONFIG_FILE, GemmConfig, config_key, skinny_linear  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
T0 = time.perf_counter()

# (model, layer, N, K, kind): kind "glu" means W is [2N, K] (gate, up), "head" means float32 output
SHAPES = [
    ("qwen3-8b", "qkv", 6144, 4096, "plain"), ("qwen3-8b", "o", 4096, 4096, "plain"),
    ("qwen3-8b", "gate_up", 12288, 4096, "glu"), ("qwen3-8b", "down", 4096, 12288, "plain"),
    ("qwen3-8b", "head", 151936, 4096, "head"),
    ("qwen3-0.6b", "qkv", 4096, 1024, "plain"), ("qwen3-0.6b", "o", 1024, 2048, "plain"),
    ("qwen3-0.6b", "gate_up", 3072, 1024, "glu"), ("qwen3-0.6b", "down", 1024, 3072, "plain"),
    ("qwen3-0.6b", "head", 151936, 1024, "head"),
    ("qwen2.5-1.5b", "qkv", 2048, 1536, "bias"), ("qwen2.5-1.5b", "o", 1536, 1536, "plain"),
    ("qwen2.5-1.5b", "gate_up", 8960, 1536, "glu"), ("qwen2.5-1.5b", "down", 1536, 8960, "plain"),
    ("qwen2.5-0.5b", "qkv", 1152, 896, "bias"), ("qwen2.5-0.5b", "o", 896, 896, "plain"),
    ("qwen2.5-0.5b", "gate_up", 4864, 896, "glu"), ("qwen2.5-0.5b", "down", 896, 4864, "plain"),
]
ROWS = (1, 2, 4, 8, 16)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def candidates(m: int, k: int, quick: bool) -> list[GemmConfig]:
    """The search space for m rows: CUDA-core tiles for m <= 4, 16-row tensor-core tiles for any m."""
    bks = [b for b in (128, 256, 512, 1024) if b <= max(128, triton.next_power_of_2(k))]
    out = []
    if m <= 4:
        bns = (4, 8, 16) if m == 1 else (4, 8)
        for bn, bk, s in itertools.product(bns, bks[1:] or bks, (1, 3)):
            out.append(GemmConfig(bn, bk, False, 4, s))
        if m == 1:
            out += [GemmConfig(8, 1024, False, 8, 1), GemmConfig(16, 512, False, 8, 1), GemmConfig(16, 1024, False, 8, 1)]
    # tensor cores on a 16-row tile (rows past m masked): streams W through shared memory, pipelined
    for bn, bk, st, w in itertools.product((16, 32, 64), [b for b in bks if b <= 512], (3, 4, 6), (4, 8)):
        smem = st * (bn + 16) * bk * 2 * 2  # x and W tiles (twice for gate and up), bytes
        if smem <= 200 * 1024 and (w == 4 or bn == 64):
            out.append(GemmConfig(bn, bk, True, w, st))
    if quick:
        out = out[:: max(1, len(out) // 4)]
    return out


def _compile_job(job) -> str | None:
    """Worker: compile (by launching once on empty tensors) one kernel variant into Triton's on-disk cache."""
    m, n, k, kind, cfg = job
    try:
        rows_w = 2 * n if kind == "glu" else n
        x = torch.empty(m, k, dtype=BF16, device=DEV)
        w = torch.empty(rows_w, k, dtype=BF16, device=DEV)
        bias = torch.empty(n, dtype=BF16, device=DEV) if kind == "bias" else None
        skinny_linear(x, w, bias, glu=kind == "glu", out_dtype=torch.float32 if kind == "head" else None, config=cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:100]}"


def precompile(shapes, rows, quick: bool) -> None:
    """Compile every variant the sweep will time, in parallel processes (Triton compiles one kernel per
    configuration, K and epilogue; serially that would take longer than the timing)."""
    import concurrent.futures
    import multiprocessing

    jobs = [(m, n, k, kind, cfg) for (n, k, kind) in shapes for m in ROWS for cfg in candidates(m, k, quick)
            if m in (1, 2) or (m == 4 and not cfg.use_dot)]  # m = 4, 8, 16 share the 16-row tile of m = 2
    jobs = [j for j in jobs if j[0] in rows or (j[0] == 2 and j[4].use_dot and rows != [1])]
    workers = max(1, min(14, (os.cpu_count() or 2) - 2))
    log(f"compiling {len(jobs)} kernel variants in {workers} processes")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = sum(r is not None for r in pool.map(_compile_job, jobs, chunksize=4))
    log(f"compiled ({failed} variants rejected)")


def bench_graph(fn, reps: int = 20) -> float:
    """ms per call of fn, captured in a CUDA graph (median of 5 timings of `reps` replays)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[2]


def measure_shape(n: int, k: int, kind: str, rows, quick: bool, l2_bytes: int) -> list[dict]:
    rows_w = 2 * n if kind == "glu" else n
    one = rows_w * k * 2
    copies = max(2, min(256, -(-4 * l2_bytes // one)))  # the rotation spans 4x the L2
    weights = [torch.randn(rows_w, k, dtype=BF16, device=DEV) * 0.02 for _ in range(copies)]
    bias = torch.randn(n, dtype=BF16, device=DEV) if kind == "bias" else None
    out_dtype = torch.float32 if kind == "head" else None
    nbytes = copies * one
    results = []
    for m in rows:
        x = torch.randn(m, k, dtype=BF16, device=DEV)
        ref = x.float() @ weights[0].float().T
        if kind == "glu":
            g, u = ref.chunk(2, dim=-1)
            ref = torch.nn.functional.silu(g) * u
        elif bias is not None:
            ref = ref + bias.float()

        def cublas():
            for w in weights:
                y = torch.nn.functional.linear(x, w, bias)
                if kind == "glu":
                    g, u = y.chunk(2, dim=-1)
                    y = torch.nn.functional.silu(g) * u
                elif kind == "head":
                    y = y.float()

        t_cublas = bench_graph(cublas) / copies
        best = None
        tried = 0
        for cfg in candidates(m, k, quick):
            try:
                y = skinny_linear(x, weights[0], bias, glu=kind == "glu", out_dtype=out_dtype, config=cfg)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    log(f"  {n}x{k} m={m} {cfg}: wrong (rel err {err:.3g}), skipped")
                    continue
                t = bench_graph(lambda: [skinny_linear(x, w, bias, glu=kind == "glu", out_dtype=out_dtype, config=cfg)
                                         for w in weights]) / copies
            except Exception as e:  # a configuration the compiler rejects (resources)
                log(f"  {n}x{k} m={m} {cfg}: failed {type(e).__name__}: {str(e)[:120]}")
                continue
            tried += 1
            if best is None or t < best[0]:
                best = (t, cfg, err)
        per = nbytes / copies
        row = dict(n=n, k=k, kind=kind, m=m, copies=copies, cublas_us=t_cublas * 1e3,
                   cublas_GBps=per / (t_cublas * 1e-3) / 1e9, tried=tried)
        if best is not None:
            t, cfg, err = best
            row.update(triton_us=t * 1e3, triton_GBps=per / (t * 1e-3) / 1e9, speedup=t_cublas / t,
                       config=dict(block_n=cfg.block_n, block_k=cfg.block_k, use_dot=cfg.use_dot,
                                   num_warps=cfg.num_warps, num_stages=cfg.num_stages), rel_err=err)
        results.append(row)
        log(f"{n:>6}x{k:<6} {kind:5} m={m:2}: cuBLAS {row['cublas_us']:7.1f} us ({row['cublas_GBps']:5.0f} GB/s)"
            + (f", Triton {row['triton_us']:7.1f} us ({row['triton_GBps']:5.0f} GB/s) x{row['speedup']:.2f} {best[1]}"
               if best else ", no Triton config"))
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts to tune (others keep their entries)")
    ap.add_argument("--no-precompile", action="store_true", help="compile in this process, as the sweep goes")
    ap.add_argument("--models", default="qwen3-8b,qwen3-0.6b,qwen2.5-1.5b,qwen2.5-0.5b")
    args = ap.parse_args()
    card = torch.cuda.get_device_name(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    log(f"{card}, L2 {l2 / 2**20:.0f} MiB")
    wanted = args.models.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    res = dict(card=card, date=datetime.datetime.now().isoformat(timespec="seconds"), torch=torch.__version__,
               rows=[])
    shapes = list(dict.fromkeys((n, k, kind) for model, _, n, k, kind in SHAPES if model in wanted))
    if not args.no_precompile:
        precompile(shapes, rows, args.quick)
    seen = set()
    for model, layer, n, k, kind in SHAPES:
        if model not in wanted or (n, k, kind) in seen:
            continue
        seen.add((n, k, kind))
        for row in measure_shape(n, k, kind, rows, args.quick, l2):
            res["rows"].append(dict(row, model=model, layer=layer))
    safe = card.replace(" ", "_")
    out = os.path.join(REPO, "benchmarks", "results", f"skinny_gemm_{safe}" + ("" if rows == list(ROWS) else
                       "_m" + "-".join(map(str, rows))) + ".json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    # the configuration table: only where the Triton kernel beats cuBLAS (elsewhere cuBLAS stays in use)
    table = {}
    if os.path.exists(CONFIG_FILE):
        with open(CONFIG_FILE) as f:
            table = json.load(f)
    table.setdefault(card, {}).update({config_key(r["m"], r["n"], r["k"], r["kind"] == "glu"): dict(r["config"], us=round(r["triton_us"], 2),
                                                                              cublas_us=round(r["cublas_us"], 2))
                   for r in res["rows"] if "config" in r})
    with open(CONFIG_FILE, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    log(f"wrote {out} and {CONFIG_FILE}")
    print(f"\n{'model':13} {'layer':8} {'N x K':>14} " + " ".join(f"{'m=' + str(m):>13}" for m in ROWS))
    by = {}
    for r in res["rows"]:
        by.setdefault((r["model"], r["layer"], r["n"], r["k"]), {})[r["m"]] = r
    for (model, layer, n, k), rows in by.items():
        cells = [f"{rows[m].get('speedup', 0):5.2f}x {rows[m].get('triton_GBps', 0):5.0f}" if m in rows else " " * 13
                 for m in ROWS]
        print(f"{model:13} {layer:8} {f'{n}x{k}':>14} " + " ".join(cells))
    print("(cells: speed-up over cuBLAS, Triton GB/s)")


if __name__ == "__main__":
    main()
