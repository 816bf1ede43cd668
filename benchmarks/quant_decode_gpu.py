#!/usr/bin/env python
"""Q4 weight-only decode on the GPU (issue 12): the int4 word-layout kernel against its own weight-streaming
floor, at the Qwen3-8B shape with random weights quantized like GGUF Q4_1 (4-bit codes, a scale and an offset
per 32 weights).

1. Kernel sweep: each Qwen3-8B product (qkv, o, gate/up with the SwiGLU fused, down, head) at 1..16 rows, for a
   small grid of configurations, timed inside a CUDA graph over enough distinct weight copies that nothing is
   served from L2 (a product alone, timed eagerly, measures Triton's launch overhead, not the kernel). Reports
   the best configuration, its time, and its fraction of the floor (bytes streamed / copy bandwidth), beside
   the earlier chunk-layout kernel (quant_gemm.q4_linear) and bf16 (cuBLAS and forerun's skinny kernel).
   The best configurations are written to q4_configs.json (to commit under forerun/kernels/).
2. Whole model: the random 8B-shape model in bf16, then quantized (every linear and the head to int4), decode at
   batch 1 and verification of q = 1..16 tokens replayed from CUDA graphs, against the floors (weights streamed
   per step / copy bandwidth); the kernels of a Q4 decode step (torch profiler).

    python benchmarks/quant_decode_gpu.py [--quick]     # writes $OUT (else benchmarks/results)/quant_decode_h200.json

3. --bits 8: the same for 8-bit weights quantized like GGUF Q8_0 (int8 codes, one bf16 scale per 32 weights,
   CudaQ8Linear / q8v_linear; 1..8 rows): products and the whole model (bf16 vs q8), quant_decode_h200_q8.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import gpu as G  # noqa: E402  (benchmarks/gpu.py: model building, decode steps, profiler breakdown)
from skinny_gemm import bench_graph  # noqa: E402  (benchmarks/skinny_gemm.py)
from forerun.kernels.quant_gemm import (dequantize_int4, q4_linear, quantize_int4,  # noqa: E402
                                        repack_int4_w32)
from forerun.kernels.skinny_gemm import default_config, skinny_linear  # noqa: E402
from forerun.kernels import pdl  # noqa: E402
from forerun.models import quant_cuda  # noqa: E402
from forerun.kernels.quant_gemm import pack_int8_w32  # noqa: E402
from forerun.models.quant_cuda import (CudaQ4Linear, CudaQ8Linear, config_key, q4_product, q8_product,  # noqa: E402
                                       quantize_int8_groups, quantize_model_cuda)
from forerun.runtime.cuda_graph import GraphRunner  # noqa: E402

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (12288, 4096, True),
          "down": (4096, 12288, False), "head": (151936, 4096, False)}  # (N out, K, fused SwiGLU)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - G.T0:7.1f}s] {msg}", flush=True)


def graph_us(calls, reps: int = 10) -> float:
    """calls: zero-arg functions (one per weight copy), replayed together from one CUDA graph (skinny_gemm's
    bench_graph); microseconds per call."""
    return bench_graph(lambda: [f() for f in calls], reps=reps) * 1e3 / len(calls)


def best_config(grid: list[dict], ref: torch.Tensor, product, copies: list, what: str) -> dict:
    """The fastest configuration in `grid` whose product(weights, cfg) is within 2e-2 of ref (relative to its
    largest entry), timed over the weight copies; configurations the compiler refuses are logged and skipped."""
    best = None
    for cfg in grid:
        try:
            y = product(copies[0], cfg)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            if err > 2e-2:
                raise ValueError(f"rel err {err:.2e}")
            us = graph_us([lambda c=c, cfg=cfg: product(c, cfg) for c in copies])
        except Exception as e:  # e.g. more shared memory than the card has
            log(f"  {what} {cfg}: {type(e).__name__} {str(e)[:100]}")
            continue
        if best is None or us < best["us"]:
            best = {**cfg, "us": us, "rel_err": err}
    return best


def keep_committed(name: str, table: dict) -> dict:
    """The swept table over the committed one for this card (rows not swept this run keep theirs), in use from now
    on (quant_cuda.set_configs)."""
    try:
        committed = json.loads(quant_cuda.CONFIGS.read_text()).get(name, {})
    except (OSError, ValueError):
        committed = {}
    # a 1-row entry that is the CUDA C++ kernel (benchmarks/q4_cuda_gpu.py) stays; this sweep's Triton winner
    # becomes its fallback ("triton_<key>": what runs where NVRTC cannot)
    table = {("triton_" + k if committed.get(k, {}).get("kernel") == "c" else k): v for k, v in table.items()}
    table = {**committed, **table}
    quant_cuda.set_configs(name, table)
    return table


def sweep(bw: float, rows: list[int], quick: bool) -> tuple[list[dict], dict]:
    name = torch.cuda.get_device_name()
    results, table = [], {}
    for shape, (n, k, glu) in SHAPES.items():
        nw = 2 * n if glu else n
        w = torch.randn(nw, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, s, z = quantize_int4(w)
        q32 = repack_int4_w32(qw)
        wd = dequantize_int4(qw, s, z).to(torch.bfloat16)
        qbytes = q32.numel() * 4 + s.numel() * 2 + z.numel() * 2
        copies = max(2, min(24, int(3e8 // qbytes) + 1))  # > 300 MB streamed per replay: L2 (50 MB) cannot hold it
        Q = [(q32.clone(), s.clone(), z.clone()) for _ in range(copies)]
        old = [(qw.clone(), s.clone(), z.clone()) for _ in range(copies)] if not glu else []
        wb = [wd.clone() for _ in range(max(2, min(8, int(3e8 // wd.numel() // 2) + 1)))]
        del w
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ wd.float().t()
            if glu:
                ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
            bytes_ = qbytes + x.numel() * 2 + m * n * 2
            row = {"shape": shape, "n": n, "k": k, "glu": glu, "m": m, "q4_bytes": bytes_,
                   "floor_us": bytes_ / bw * 1e6}
            grid = []
            if m <= 2:  # the packed-f16 decode kernel, then the first word-layout kernel's winner (first H200 run)
                grid = [dict(kernel="v", block_n=bn, block_k=bk, use_dot=False, num_warps=nw, num_stages=2)
                        for bn in (2, 4, 8, 16) for nw in (2, 4, 8) for bk in (1024, 4096)]
                grid.append(dict(kernel="w", block_n=8, block_k=512, use_dot=False, num_warps=4, num_stages=3))
            else:  # packed f16 for <= 8 rows, the bf16-dequantizing tensor-core kernel, the earlier winners
                grid = [dict(kernel="r", block_n=bn, block_k=bk, use_dot=False, num_warps=nw, num_stages=2)
                        for bn in (2, 4, 8) for nw in (4, 8) for bk in (1024, 2048)] if m <= 8 else []
                grid += [dict(kernel="t", block_n=64, block_k=128, use_dot=True, num_warps=4, num_stages=3)]
                grid += [dict(kernel="w", block_n=32, block_k=256, use_dot=True, num_warps=4, num_stages=3),
                         dict(kernel="w2", block_n=32, block_k=256, use_dot=True, num_warps=4, num_stages=3)]
            if quick:
                grid = grid[:2] + grid[-1:]
            best = best_config(grid, ref, lambda c, cfg: q4_product(x, *c, glu, cfg), Q, f"{shape} m={m}")
            row["q4w"] = {**best, "of_floor": row["floor_us"] / best["us"]}
            table[config_key(m, n, k, glu)] = best
            if not glu:  # the chunk-layout kernel, its default config
                try:
                    row["q4_chunk_us"] = graph_us([lambda c=c: q4_linear(x, *c) for c in old])
                except Exception as e:
                    row["q4_chunk_error"] = repr(e)[:200]
            bf_bytes = wd.numel() * 2
            row["bf16_floor_us"] = bf_bytes / bw * 1e6
            if glu:
                row["bf16_cublas_us"] = graph_us([lambda t=t: torch.nn.functional.silu(
                    (x @ t.t())[:, :n]) for t in wb])
            else:
                row["bf16_cublas_us"] = graph_us([lambda t=t: x @ t.t() for t in wb])
                cfg = default_config(m, n, k, 2)
                if cfg is not None:
                    row["bf16_skinny_us"] = graph_us([lambda t=t: skinny_linear(x, t, None, config=cfg) for t in wb])
            results.append(row)
            log(f"{shape:8s} m={m:2d}: q4w {best['us']:7.1f} us ({100 * row['q4w']['of_floor']:5.1f}% of its floor "
                f"{row['floor_us']:.1f}), chunk q4 {row.get('q4_chunk_us', float('nan')):7.1f}, bf16 cuBLAS "
                f"{row['bf16_cublas_us']:7.1f} (floor {row['bf16_floor_us']:.1f}); "
                f"cfg {({k_: best[k_] for k_ in ('kernel', 'block_n', 'block_k', 'use_dot', 'num_warps', 'num_stages')})} "
                f"err {best['rel_err']:.1e}")
        del Q, old, wb, wd, qw, q32
        torch.cuda.empty_cache()
    table = keep_committed(name, table)
    return results, table


def sweep_q8(bw: float, rows: list[int], quick: bool) -> tuple[list[dict], dict]:
    """As sweep() for the 8-bit layout (q8v_linear), 1..8 rows; config keys q8_m*_n*_k*."""
    name = torch.cuda.get_device_name()
    results, table = [], {}
    for shape, (n, k, glu) in SHAPES.items():
        nw = 2 * n if glu else n
        w = torch.randn(nw, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s = quantize_int8_groups(w, torch.bfloat16)
        qw8 = pack_int8_w32(q)
        wd = (q.float().reshape(nw, k // 32, 32) * s.float()[..., None]).reshape(nw, k).to(torch.bfloat16)
        del w, q
        qbytes = qw8.numel() * 4 + s.numel() * 2
        copies = max(2, min(24, int(3e8 // qbytes) + 1))
        Q = [(qw8.clone(), s.clone()) for _ in range(copies)]
        for m in rows:
            if m > 8:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ wd.float().t()
            if glu:
                ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
            bytes_ = qbytes + x.numel() * 2 + m * n * 2
            row = {"shape": shape, "n": n, "k": k, "glu": glu, "m": m, "q8_bytes": bytes_,
                   "floor_us": bytes_ / bw * 1e6}
            grid = [dict(kernel="q8v", block_n=bn, block_k=bk, use_dot=False, num_warps=nw_, num_stages=2)
                    for bn, bk, nw_ in ((2, 1024, 4), (4, 1024, 4), (8, 1024, 4), (4, 2048, 4), (8, 2048, 8),
                                        (16, 1024, 8))]
            if m > 2:
                grid = grid[:4]
            if quick:
                grid = grid[:2]
            best = best_config(grid, ref, lambda c, cfg: q8_product(x, *c, glu, cfg), Q, f"q8 {shape} m={m}")
            row["q8"] = {**best, "of_floor": row["floor_us"] / best["us"]}
            table[config_key(m, n, k, glu, 8)] = best
            results.append(row)
            log(f"q8 {shape:8s} m={m:2d}: {best['us']:7.1f} us ({100 * row['q8']['of_floor']:5.1f}% of its floor "
                f"{row['floor_us']:.1f}); cfg bn {best['block_n']} bk {best['block_k']} warps {best['num_warps']} "
                f"err {best['rel_err']:.1e}")
        del Q, wd, qw8
        torch.cuda.empty_cache()
    table = keep_committed(name, table)
    return results, table


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step streams: every parameter and quantized buffer except the input embedding (rows)."""
    total = 0
    for mname, mod in model.named_modules():
        if isinstance(mod, (CudaQ4Linear, CudaQ8Linear)):
            total += mod.weight_bytes
    for pname, p in model.named_parameters():
        if "embed_tokens" not in pname:
            total += p.numel() * p.element_size()
    return total


def quantize_as_engine(model: torch.nn.Module, bits: int = 4) -> int:
    """Quantize the model's linears on the GPU (CudaQ4Linear / CudaQ8Linear) and let its norms wait under PDL, as
    `enable_cuda_graphs` sets them for quantized models; frees the bf16 weights. Returns how many were quantized."""
    n = quantize_model_cuda(model, bits=bits)
    model.ops.pdl_norms = True
    torch.cuda.empty_cache()
    return n


def int4_8b_model(layers: int | None = None, bw: float | None = None) -> tuple[torch.nn.Module, float | None]:
    """The random Qwen3-8B-shape model (seed 1) in int4 as the engine runs it on CUDA (FusedLayerOps, norms waiting
    under PDL), and its decode step's weight-streaming floor in ms at copy bandwidth bw (None without bw)."""
    model = G.build_model(G.QWEN3_8B, layers, seed=1)
    model.ops = G.FusedLayerOps()
    quantize_as_engine(model)
    return model, (model_bytes(model) / bw * 1e3 if bw else None)


def whole_model(bw: float, quick: bool, ctx0: int = 512, bits: int = 4) -> dict:
    out = {}
    quant = "q8" if bits == 8 else "q4"
    model = G.build_model(G.QWEN3_8B, 4 if quick else None, seed=1)
    model.ops = G.FusedLayerOps()  # the fused Triton layer kernels, as the engine runs on CUDA
    side = G.make_side(model, 1, ctx0 + 256)
    qs = list(range(1, 17))
    labels = ("bf16", "q4_no_pdl", "q4") if bits == 4 else ("bf16", "q8")
    for label in labels:  # PDL: forerun/kernels/pdl.py, on by default where supported
        pdl.set_enabled(label != "q4_no_pdl")
        if label != "bf16":
            del side.graphs
        if label == labels[1]:
            n = quantize_as_engine(model, bits=bits)
            log(f"quantized {n} linears to int{bits}")
        bytes_ = model_bytes(model)
        side.graphs = GraphRunner(side.runner, batch_sizes=[1], max_q_len=16)
        step, reset = G.plain_step_fn(side, 1, ctx0, 1.0)
        ms = G.bench_ms(step, inner=16, outer=5)
        reset()
        floor = bytes_ / bw * 1e3
        kv = ctx0 * G.kv_bytes_per_token(model.config) / bw * 1e3
        curve = {}
        for q in qs:
            ids = torch.zeros(1, q, dtype=torch.int64, device="cuda")
            ctx = torch.full((1,), ctx0, device="cuda")
            curve[q] = G.bench_ms(lambda: side.graphs.run_uniform(ids, ctx, q), inner=10, outer=3)
        out[label] = dict(weight_bytes=bytes_, floor_ms=floor, kv_floor_ms=kv, decode_ms=ms,
                          fraction_of_floor=floor / ms, fraction_of_floor_with_kv=(floor + kv) / ms,
                          tok_s=1e3 / ms, verify_ms=curve, verify_q5_over_q1=curve[5] / curve[1],
                          verify_q16_over_q1=curve[16] / curve[1])
        log(f"{label}: {bytes_ / 1e9:.2f} GB streamed per token, floor {floor:.3f} ms; decode {ms:.3f} ms/token "
            f"= {100 * floor / ms:.1f}% of floor ({100 * (floor + kv) / ms:.1f}% counting the KV); "
            f"verify q=1/5/16: {curve[1]:.3f} / {curve[5]:.3f} / {curve[16]:.3f} ms")
        if label == quant:
            out["pdl_launch_supported"] = pdl.enabled(ids.new_zeros(1, dtype=torch.float32))
            ids1 = torch.zeros(1, 1, dtype=torch.int64, device="cuda")
            ctx1 = torch.full((1,), ctx0, device="cuda")
            try:
                out[f"{quant}_kernels_b1"] = G.kernel_breakdown(lambda: side.graphs.run_uniform(ids1, ctx1, 1))
                ks = out[f"{quant}_kernels_b1"]["kernels"][:8]
                log(f"{quant} decode kernels: " + "; ".join(f"{k['name'][:40]} {k['us']:.0f} us x{k['count']:.0f}"
                                                       for k in ks))
            except Exception as e:
                log(f"no kernel breakdown: {e!r}")
    return out


def plot(res: dict, path: str) -> None:
    """Left: each product's time as a fraction of its floor by rows (q4 or q8 word layout); right: whole-model
    decode and verify cost (ms) against q, bf16 vs the quantized model, with the two floors."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quant = "q8" if res.get("bits") == 8 else "q4"
    key = "q8" if quant == "q8" else "q4w"
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for shape in SHAPES:
        rows = [r for r in res["kernels"] if r["shape"] == shape]
        a.plot([r["m"] for r in rows], [100 * r[key]["of_floor"] for r in rows], "o-", label=f"{quant} {shape}")
    a.axhline(75, color="r", ls="--", label="goal 75%")
    a.set_xscale("log", base=2)
    a.set_xlabel("rows (tokens in the product)")
    a.set_ylabel("% of its own floor (bytes / copy bw)")
    a.set_title(f"{'int8' if quant == 'q8' else 'int4'} products, {res['card']}")
    a.legend(fontsize=7)
    if "model" in res:
        for label, c in (("bf16", "C0"), (quant, "C1")):
            m = res["model"][label]
            qs = sorted(int(q) for q in m["verify_ms"])
            b.plot(qs, [m["verify_ms"][str(q)] if str(q) in m["verify_ms"] else m["verify_ms"][q] for q in qs], "o-",
                   color=c, label=f"{label} forward of q tokens")
            b.axhline(m["floor_ms"], color=c, ls="--", label=f"{label} floor {m['floor_ms']:.2f} ms")
        b.set_xlabel("q (tokens verified, batch 1)")
        b.set_ylabel("ms")
        b.set_title("Qwen3-8B shape, random weights, CUDA graphs")
        b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", metavar="JSON", help="only re-plot a result file (PNG beside it)")
    ap.add_argument("--quick", action="store_true", help="3 configs, 4 layers: a smoke run")
    ap.add_argument("--rows", default=None, help="rows swept (default 1,2,4,8,16; --bits 8: 1,2,4,8)")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4, help="4: int4 (Q4_1-like); 8: int8 (Q8_0-like)")
    ap.add_argument("--skip-model", action="store_true")
    a = ap.parse_args()
    if a.plot:
        with open(a.plot) as f:
            plot(json.load(f), a.plot[:-5] + ".png")
        return 0
    torch.manual_seed(0)
    outdir = os.environ.get("OUT") or os.path.join(REPO, "benchmarks", "results")
    os.makedirs(outdir, exist_ok=True)
    bw = G.copy_bandwidth(2.0)
    card = torch.cuda.get_device_name()
    log(f"{card}: copy bandwidth {bw / 1e12:.2f} TB/s")
    res = {"card": card, "date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
           "copy_bw_bytes_per_s": bw, "bits": a.bits}
    rows = [int(r) for r in (a.rows or ("1,2,4,8" if a.bits == 8 else "1,2,4,8,16")).split(",")]
    res["kernels"], table = (sweep_q8 if a.bits == 8 else sweep)(bw, rows, a.quick)
    path = os.path.join(outdir, "q4_configs.json")
    with open(path, "w") as f:
        json.dump({card: table}, f, indent=1, sort_keys=True)
    if not a.skip_model:
        res["model"] = whole_model(bw, a.quick, bits=a.bits)
    stem = "quant_decode_h200" if "H200" in card else "quant_decode_gpu"
    path = os.path.join(outdir, f"{stem}{'_q8' if a.bits == 8 else ''}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, path[:-5] + ".png")
    quant = "q8" if a.bits == 8 else "q4"
    if a.bits == 8:
        print("\n| product | rows | q8 us | % of floor | bf16 floor us |")
        print("| --- | --- | --- | --- | --- |")
        for r in res["kernels"]:
            print(f"| {r['shape']} | {r['m']} | {r['q8']['us']:.1f} | {100 * r['q8']['of_floor']:.0f}% | "
                  f"{2 * r['n'] * (2 if r['glu'] else 1) * r['k'] / bw * 1e6:.1f} |")
    else:
        print("\n| product | rows | q4 (word) us | % of floor | q4 (chunk) us | bf16 cuBLAS us | bf16 floor us |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in res["kernels"]:
            print(f"| {r['shape']} | {r['m']} | {r['q4w']['us']:.1f} | {100 * r['q4w']['of_floor']:.0f}% | "
                  f"{r.get('q4_chunk_us', float('nan')):.1f} | {r['bf16_cublas_us']:.1f} | {r['bf16_floor_us']:.1f} |")
    if "model" in res:
        print("\n| weights | GB/token | floor ms | decode ms | % of floor | verify q=5 / q=1 | q=16 / q=1 |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for label in (("bf16", "q4_no_pdl", "q4") if a.bits == 4 else ("bf16", "q8")):
            m = res["model"][label]
            print(f"| {label} | {m['weight_bytes'] / 1e9:.2f} | {m['floor_ms']:.3f} | {m['decode_ms']:.3f} | "
                  f"{100 * m['fraction_of_floor']:.1f}% | {m['verify_q5_over_q1']:.2f} | {m['verify_q16_over_q1']:.2f} |")
    print(f"wrote {path} ({quant})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
