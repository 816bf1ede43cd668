#!/usr/bin/env python
"""Wide int4 products on the H200 (#12): more rows than the decode / verify kernels take (prefill pieces,
verification of long chains or trees at a batch: 16 requests x 16 nodes is 256 rows). Such products dequantize
each matrix to bf16 and multiply with cuBLAS. Per Qwen3-8B product (qkv, o, gate/up, down, head) and row count,
timed in CUDA graphs over enough weight copies that nothing comes from L2:

  * ``bf16 cuBLAS``: the product with a bf16 matrix already there (what a bf16 model pays; a lower bound);
  * ``dequant Triton + cuBLAS``: `quant_gemm.dequantize_int4_w32`, then cuBLAS (the path before session 34);
  * ``dequant CUDA vN + cuBLAS``: `q4_cuda.q4c_dequant` (N words per thread and step), then cuBLAS;
  * ``dequant Triton`` / ``dequant CUDA vN`` alone, against their floor (int4 bytes read + bf16 bytes written over
    the copy bandwidth);
  * ``32-row kernel calls``: the tensor-core kernel (kernels/q4_mma.py) over the rows 32 at a time;
  * the int8 layout of the same matrix (CudaQ8Linear): Triton's and the CUDA dequantization pass.

Then whole forward steps of the random 8B-shape int4 model (batch x tokens: 4 x 16 = 64 rows, 8 x 16, 16 x 16,
32 x 16) with each wide path, beside bf16. Prints tables, writes JSON (+ PNG).

    python benchmarks/q4_wide_gpu.py --out benchmarks/results/q4_wide_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu as G  # noqa: E402
from skinny_gemm import bench_graph  # noqa: E402
from forerun.kernels.q4_cuda import q4c_dequant, q8c_dequant  # noqa: E402
from forerun.kernels.quant_gemm import dequantize_int4_w32, dequantize_int8_w32, unpack_int4_w32, unpack_int8_w32  # noqa: E402,E501
from forerun.models.quant_cuda import CudaQ4Linear, CudaQ8Linear, q4_product, tuned  # noqa: E402
from q4_mma_gpu import steps  # noqa: E402

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate/up": (12288, 4096, True),
          "down": (4096, 12288, False), "head": (151936, 4096, False)}  # outputs (per half with SwiGLU), K, SwiGLU
ROWS = (48, 64, 128, 256, 512)
VECS = (1, 2, 4)
STEPS = ((4, 16), (8, 16), (16, 16), (32, 16))
F = torch.nn.functional


def _glu(y: torch.Tensor, n: int, glu: bool) -> torch.Tensor:
    return F.silu(y[:, :n]) * y[:, n:] if glu else y


def exact_weights(lin: CudaQ4Linear) -> torch.Tensor:
    """code * scale + zero in float32 (a multiply, then an add), rounded once to bf16: what both passes give."""
    q = unpack_int4_w32(lin.qw32).float().reshape(lin.out_features, -1, 32)
    w = q.mul_(lin.scale.float()[..., None]).add_(lin.zero.float()[..., None])
    return w.reshape(lin.out_features, -1).to(torch.bfloat16)


def products(bw: float, l2: int, rows) -> dict:
    out = {}
    for name, (n, k, glu) in SHAPES.items():
        rows_w = 2 * n if glu else n
        one = CudaQ4Linear.from_float(torch.randn(rows_w, k, device=G.DEV, dtype=torch.bfloat16) * 0.02)
        int4_bytes, bf16_bytes = one.weight_bytes, rows_w * k * 2
        copies = max(2, min(32, -(-4 * l2 // int4_bytes)))
        mats = [SimpleNamespace(qw32=one.qw32, scale=one.scale, zero=one.zero, lane_scales=one.lane_scales)]
        mats += [SimpleNamespace(qw32=one.qw32.clone(), scale=one.scale.clone(), zero=one.zero.clone(),
                                 lane_scales=None if one.lane_scales is None else one.lane_scales.clone())
                 for _ in range(copies - 1)]
        ref_w = exact_weights(one)  # bf16 [rows_w, K]
        # (the bf16 row: fewer copies of the 4x larger matrix still span the L2 twice)
        bcopies = max(2, min(copies, -(-2 * l2 // bf16_bytes)))
        wb = [ref_w] + [ref_w.clone() for _ in range(bcopies - 1)]
        exact = {"triton": torch.equal(dequantize_int4_w32(one.qw32, one.scale, one.zero, torch.bfloat16), ref_w)}
        for v in VECS:
            exact[f"cuda v{v}"] = torch.equal(q4c_dequant(one.qw32, one.scale, one.zero, vec=v), ref_w)
        row0 = dict(n=n, k=k, glu=glu, int4_bytes=int4_bytes, bf16_bytes=bf16_bytes, copies=copies,
                    dequant_floor_us=(int4_bytes + bf16_bytes) / bw * 1e6, exact_vs_reference=exact, dequant={})
        row0["dequant"]["Triton"] = bench_graph(
            lambda: [dequantize_int4_w32(c.qw32, c.scale, c.zero, torch.bfloat16) for c in mats]) * 1e3 / copies
        for v in VECS:
            row0["dequant"][f"CUDA v{v}"] = bench_graph(
                lambda v=v: [q4c_dequant(c.qw32, c.scale, c.zero, vec=v) for c in mats]) * 1e3 / copies
        G.log(f"{name:8s} dequant: floor {row0['dequant_floor_us']:.1f} us | " + " | ".join(
            f"{key} {us:.1f}" for key, us in row0["dequant"].items()) + f" | exact {exact}")
        # the int8 layout (CudaQ8Linear: GGUF Q8_0 / Q6_K heads of Q4_K_M files) of the same matrix, its two passes
        q8 = CudaQ8Linear.from_float(ref_w)
        m8 = [q8] + [SimpleNamespace(qw8=q8.qw8.clone(), scale=q8.scale.clone()) for _ in range(copies - 1)]
        want8 = (unpack_int8_w32(q8.qw8).float().reshape(rows_w, -1, 32) * q8.scale.float()[..., None]).reshape(
            rows_w, k).to(torch.bfloat16)
        row0["int8"] = dict(bytes=q8.weight_bytes, floor_us=(q8.weight_bytes + bf16_bytes) / bw * 1e6, exact=dict(
            triton=torch.equal(dequantize_int8_w32(q8.qw8, q8.scale, torch.bfloat16), want8),
            cuda=torch.equal(q8c_dequant(q8.qw8, q8.scale), want8)))
        row0["int8"]["Triton"] = bench_graph(
            lambda: [dequantize_int8_w32(c.qw8, c.scale, torch.bfloat16) for c in m8]) * 1e3 / copies
        row0["int8"]["CUDA"] = bench_graph(lambda: [q8c_dequant(c.qw8, c.scale) for c in m8]) * 1e3 / copies
        G.log(f"{name:8s} int8 dequant: floor {row0['int8']['floor_us']:.1f} us | Triton {row0['int8']['Triton']:.1f} "
              f"| CUDA {row0['int8']['CUDA']:.1f} | exact {row0['int8']['exact']}")
        q8 = m8 = want8 = None
        best_vec = min(VECS, key=lambda v: row0["dequant"][f"CUDA v{v}"])
        row0["best_vec"], row0["rows"] = best_vec, {}
        for m in rows:
            x = torch.randn(m, k, device=G.DEV, dtype=torch.bfloat16)
            t = {}
            t["bf16 cuBLAS"] = bench_graph(lambda: [_glu(F.linear(x, w), n, glu) for w in wb]) * 1e3 / bcopies
            t["dequant Triton + cuBLAS"] = bench_graph(lambda: [_glu(F.linear(
                x, dequantize_int4_w32(c.qw32, c.scale, c.zero, torch.bfloat16)), n, glu) for c in mats]) * 1e3 / copies
            t[f"dequant CUDA v{best_vec} + cuBLAS"] = bench_graph(lambda: [_glu(F.linear(
                x, q4c_dequant(c.qw32, c.scale, c.zero, vec=best_vec)), n, glu) for c in mats]) * 1e3 / copies
            cfg = tuned(32, n, k, glu)
            if cfg["kernel"] == "m":
                t["32-row kernel calls"] = bench_graph(lambda: [torch.cat([q4_product(
                    x[a: a + 32], c.qw32, c.scale, c.zero, glu, cfg, c.lane_scales) for a in range(0, m, 32)])
                    for c in mats]) * 1e3 / copies
            row0["rows"][m] = t
            G.log(f"{name:8s} m={m:3d}: " + " | ".join(f"{key} {us:.1f}" for key, us in t.items()))
        out[name] = row0
        mats = wb = one = ref_w = None  # (freed before the next shape)
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_wide.json")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers in the steps (a smoke run)")
    ap.add_argument("--no-steps", action="store_true")
    args = ap.parse_args()
    from quant_decode_gpu import quantize_as_engine

    bw = G.copy_bandwidth(2.0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw_bytes_per_s=bw,
               products=products(bw, l2, ROWS), steps={})
    if not args.no_steps:
        model = G.build_model(G.QWEN3_8B, args.layers, seed=1)
        model.ops = G.FusedLayerOps()
        steps(model, "bf16", res["steps"], shapes=STEPS, inner=5, outer=3)
        quantize_as_engine(model)
        for label, env, chunked in (("int4, dequant Triton", "triton", None), ("int4, dequant CUDA", "cuda", None),
                                    ("int4, 32-row kernel calls", "cuda", 1 << 20)):
            os.environ["FORERUN_Q4_DEQUANT"] = env
            saved = CudaQ4Linear.CHUNKED_ROWS
            if chunked:
                CudaQ4Linear.CHUNKED_ROWS = chunked
            steps(model, label, res["steps"], shapes=STEPS, inner=5, outer=3)
            CudaQ4Linear.CHUNKED_ROWS = saved
        os.environ.pop("FORERUN_Q4_DEQUANT", None)
    report(res)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.splitext(args.out)[0] + ".png")
    return 0


def report(res: dict) -> None:
    print("\n| product | dequant floor us | Triton us | " + " | ".join(f"CUDA v{v} us" for v in VECS) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in VECS) + " |")
    for name, r in res["products"].items():
        d = r["dequant"]
        print(f"| {name} | {r['dequant_floor_us']:.1f} | {d['Triton']:.1f} ({r['dequant_floor_us'] / d['Triton']:.0%}) | "
              + " | ".join(f"{d[f'CUDA v{v}']:.1f} ({r['dequant_floor_us'] / d[f'CUDA v{v}']:.0%})" for v in VECS) + " |")
    if any("int8" in r for r in res["products"].values()):
        print("\n| product (int8 layout) | dequant floor us | Triton us | CUDA us |\n| --- | --- | --- | --- |")
        for name, r in res["products"].items():
            e = r.get("int8")
            if e:
                print(f"| {name} | {e['floor_us']:.1f} | {e['Triton']:.1f} ({e['floor_us'] / e['Triton']:.0%}) | "
                      f"{e['CUDA']:.1f} ({e['floor_us'] / e['CUDA']:.0%}) |")
    labels = sorted({key for r in res["products"].values() for t in r["rows"].values() for key in t}, key=str)
    print("\n| product | rows | " + " | ".join(labels) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in labels) + " |")
    for name, r in res["products"].items():
        for m, t in r["rows"].items():
            print(f"| {name} | {m} | " + " | ".join(f"{t[key]:.1f}" if key in t else "-" for key in labels) + " |")
    if res["steps"]:
        cols = list(next(iter(res["steps"].values())))
        print("\n| step (batch x tokens) | " + " | ".join(f"{c} ms" for c in cols) + " |")
        print("| --- | " + " | ".join("---" for _ in cols) + " |")
        for key, r in res["steps"].items():
            print(f"| {key} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    ax = axes[0]
    r = res["products"]["gate/up"]
    labels = list(next(iter(r["rows"].values())))
    for label in labels:
        ms = [m for m in r["rows"] if label in r["rows"][m]]
        ax.plot([int(m) for m in ms], [r["rows"][m][label] for m in ms], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows")
    ax.set_ylabel("us per product")
    ax.set_title("8B gate/up (SwiGLU), int4 wide products")
    ax.legend(fontsize=7)
    ax = axes[1]
    if res["steps"]:
        keys = list(res["steps"])
        cols = list(res["steps"][keys[0]])
        wdt = 0.8 / len(cols)
        for i, c in enumerate(cols):
            ax.bar([j + wdt * (i - (len(cols) - 1) / 2) for j in range(len(keys))],
                   [res["steps"][k][c] for k in keys], wdt, label=c)
        ax.set_xticks(range(len(keys)), keys)
        ax.set_xlabel("batch x tokens per step")
        ax.set_ylabel("forward (ms)")
        ax.set_title(f"random 8B-shape forward, {res['device']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
