"""Q4 / Q8 weight-only skinny GEMM (forerun/kernels/quant_gemm.py) on the GPU at the Qwen3-8B linear shapes,
against the bf16 floor, for 1..16 rows. Random weights quantized the same way as GGUF Q4_K / Q8_0 (group 32).

For each shape and row count: correctness against x @ dequantized(W)^T, the fastest of a small config sweep,
the bytes it streams (packed weights + scales/zeros + x + y), and the fraction of the card's copy bandwidth
that is (its own weight-streaming floor = bytes / copy bandwidth); cuBLAS bf16 (torch.matmul) and its floor
for comparison. Prints a table, writes quant_gemm_<card>.json (to $OUT when set, else benchmarks/results).

    python benchmarks/quant_gemm.py [--rows 1,2,4,8,16]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton

from forerun.kernels.quant_gemm import (dequantize_int4, dequantize_int8, q4_linear, q8_linear, quantize_int4,
                                        quantize_int8)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (2 * 12288, 4096), "down": (4096, 12288)}  # Qwen3-8B


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # seconds


def copy_bw() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / bench(lambda: y.copy_(x))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--quick", action="store_true", help="fewer configs")
    a = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bw()
    card = torch.cuda.get_device_name()
    print(f"{card}: copy bandwidth {bw / 1e12:.2f} TB/s")
    rows_list = [int(r) for r in a.rows.split(",")]
    cuda_core = [(bn, False, 4, 3) for bn in (4, 8, 16)]
    tensor_core = [(bn, True, nw, 3) for bn in (32, 64) for nw in (4, 8)]
    if a.quick:
        cuda_core, tensor_core = [(8, False, 4, 3)], [(32, True, 4, 3)]
    out = {"card": card, "copy_bw_bytes_per_s": bw, "results": []}
    totals = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, s, z = quantize_int4(w)
        q8, s8 = quantize_int8(w)
        wd4, wd8 = dequantize_int4(qw, s, z), dequantize_int8(q8, s8)
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "n": n, "k": k, "m": m}
            for kind in ("q4", "q8"):
                if kind == "q4":
                    ref = x.float() @ wd4.t()
                    wbytes = qw.numel() + 2 * s.numel() * s.element_size()
                    call = lambda cfg: q4_linear(x, qw, s, z, block_n=cfg[0], use_dot=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
                else:
                    ref = x.float() @ wd8.t()
                    wbytes = q8.numel() + s8.numel() * s8.element_size()
                    call = lambda cfg: q8_linear(x, q8, s8, block_n=cfg[0], use_dot=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
                best = None
                for cfg in (cuda_core if m <= 2 else []) + (tensor_core if m >= 2 else []):
                    try:
                        y = call(cfg)
                    except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory)
                        continue
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    if err > 2e-2:
                        raise AssertionError(f"{kind} {name} m={m} cfg={cfg}: rel err {err}")
                    t = bench(lambda: call(cfg))
                    if best is None or t < best[0]:
                        best = (t, cfg, err)
                t, cfg, err = best
                nbytes = wbytes + 2 * m * k + 2 * m * n
                row[kind] = {"us": round(t * 1e6, 2), "config": cfg, "rel_err": err, "bytes": nbytes,
                             "floor_us": round(nbytes / bw * 1e6, 2), "of_floor": round(nbytes / bw / t, 3)}
            wb = w.t()  # torch.matmul(x, W^T): cuBLAS bf16
            t = bench(lambda: x @ wb)
            nbytes = 2 * n * k + 2 * m * k + 2 * m * n
            row["bf16"] = {"us": round(t * 1e6, 2), "bytes": nbytes, "floor_us": round(nbytes / bw * 1e6, 2),
                           "of_floor": round(nbytes / bw / t, 3)}
            out["results"].append(row)
            for kind in ("q4", "q8", "bf16"):
                tt = totals.setdefault((kind, m), [0.0, 0.0])
                tt[0] += row[kind]["us"]
                tt[1] += row[kind]["floor_us"]
            print(f"{name:8s} m={m:2d}  q4 {row['q4']['us']:8.1f} us ({row['q4']['of_floor']:.0%} of floor)  "
                  f"q8 {row['q8']['us']:8.1f} us ({row['q8']['of_floor']:.0%})  bf16 {row['bf16']['us']:8.1f} us "
                  f"({row['bf16']['of_floor']:.0%})  q4 cfg {row['q4']['config']}", flush=True)
    out["layer_totals"] = {f"{kind}_m{m}": {"us": round(v[0], 1), "floor_us": round(v[1], 1), "of_floor": round(v[1] / v[0], 3)}
                           for (kind, m), v in totals.items()}
    print("one decoder layer's 4 linears (qkv, o, gate_up, down):")
    for key, v in out["layer_totals"].items():
        print(f"  {key:10s} {v['us']:8.1f} us, floor {v['floor_us']:8.1f} us, {v['of_floor']:.0%} of floor")
    dest = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    dest.mkdir(parents=True, exist_ok=True)
    f = dest / f"quant_gemm_{card.replace(' ', '_')}.json"
    f.write_text(json.dumps(out, indent=1))
    print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
