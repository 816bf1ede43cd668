#!/usr/bin/env python
"""Where the int4 tensor-core product (kernels/q4_mma.py) loses time at 2-16 rows, by knock-out, on the H200.

At 8 rows the head product runs at 56 % of its floor (163.6 us against 91) while 1-row products reach 85-100 %,
and its time grows with the row count although the unpacking and the MMAs do not (2 rows 106.7 us, 4 rows 121.3,
8 rows 163.6; q4_mma_h200_head.json). Suspects: the loads that go through L1 in many pieces. Per lane and
superblock (64 weights) the kernel issues 2 weight loads (16 bytes, 4 lanes contiguous), 4 scale / zero loads of
2 bytes from 8 rows each, and 4 activation loads (16 bytes at a 64-byte stride: 2 cache lines per token and
load). Variants of the kernel's source, same grid and configuration, launched with PDL as the engine does:

  * ``scales [N, K/32]``  the scales and offsets read from CudaQ4Linear's scale / zero (the kernel until session
                          33; the first run of this script, ``q4_mma_loads_h200_first.json``, without PDL);
  * ``packed scales``     (exact) from `q4_mma.packed_scales`: a tile's superblock in one 256-byte piece in lane
                          order, one 8-byte load per lane instead of four 2-byte ones (the kernel since session 33);
  * ``packed + x fragments`` (exact) also the activations stored as each MMA operand wants them (a 16-byte load
                          per lane is 512 contiguous bytes across the warp): what a producer writing that layout,
                          or staging through shared memory, could give;
  * ``packed + x staged`` (exact) the kernel's XST option: the activations of the warp's superblock loaded whole
                          (256 contiguous bytes per token), put in fragment order through shared memory, read back
                          per lane (session 33, not yet measured; direct loads where it does not fit 48 KB);
  * ``x one token``       (wrong values; packed) every lane reads token 0's activations: activation loads as
                          cheap as at 1 row;
  * ``weights in L2``     (wrong values; packed) every block reads the first tile's weights: no HBM traffic, the
                          arithmetic and L1 work left.

Outputs of the exact variants are compared with the first's (bit for bit). Products timed in CUDA graphs over
rotating weight copies (nothing from L2), as benchmarks/q4_mma_gpu.py. Prints a table, writes JSON (+ PNG).

    python benchmarks/q4_mma_loads_gpu.py --out benchmarks/results/q4_mma_loads_h200.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu as G  # noqa: E402
from skinny_gemm import bench_graph  # noqa: E402
from forerun.kernels import nvrtc, q4_mma  # noqa: E402
from forerun.models.quant_cuda import CudaQ4Linear, tuned  # noqa: E402

SHAPES = {"qkv": (6144, 4096, False), "gate/up": (12288, 4096, True), "down": (4096, 12288, False),
          "head": (151936, 4096, False)}
ROWS = (2, 4, 8, 16)

_X_ROW = "x + (long)tok * (K_ / 8) + gi * 4 + i"
_EDITS = {  # variant part -> [(old, new)] on the formatted source (each old must occur exactly once)
    "xfrag": [(_X_ROW, "x + (((long)(s0 + s) * 4 + i) * (8 * NT) + tok) * 4 + t")],
    "x0": [(_X_ROW, "x + gi * 4 + i")],
    "l2": [("(long)(n0 + g + 8 * h + (r ? glu_off : 0)) * G_", "(long)(g + 8 * h + (r ? glu_off : 0)) * G_")],
}
_PARTS = {  # variant -> (lane-ordered scales, activations staged (the kernel's XST), edits)
    "scales [N, K/32]": (False, False, ()), "packed scales": (True, False, ()),
    "packed + x fragments": (True, False, ("xfrag",)), "packed + x staged": (True, True, ()),
    "x one token": (True, False, ("x0",)), "weights in L2": (True, False, ("l2",))}
VARIANTS = tuple(_PARTS)
EXACT = ("packed scales", "packed + x fragments", "packed + x staged")


def variant_source(k: int, warps: int, depth: int, tiles: int, glu: bool, variant: str) -> str:
    packed, staged, parts = _PARTS[variant]
    src = q4_mma.source(k, warps, depth, tiles, glu, True, packed, staged and q4_mma.staged_fits(warps, tiles, glu))
    for part in parts:
        for old, new in _EDITS[part]:
            assert src.count(old) == 1, (variant, old)
            src = src.replace(old, new)
    return src


def x_fragments(x: torch.Tensor, tiles: int) -> torch.Tensor:
    """x [T, K] bf16 -> [K/128 superblocks, 4 (16-byte piece i), 8 tiles tokens, 4 (group t), 8] bf16 (padded)."""
    t, k = x.shape
    xp = torch.zeros(8 * tiles, k, dtype=x.dtype, device=x.device)
    xp[:t] = x
    return xp.view(8 * tiles, k // 128, 4, 4, 8).permute(1, 3, 0, 2, 4).contiguous()


def launch(kern, xin, m: int, w, packed, glu: bool, warps: int) -> torch.Tensor:
    n_out = w.qw32.shape[0] // (2 if glu else 1)
    y = torch.empty(m, n_out, dtype=torch.bfloat16, device=xin.device)
    nvrtc.launch(kern, n_out // 16, 32 * warps, 0, [xin, w.qw32, w.scale, w.zero, y, m, n_out, n_out,
                                                    packed if packed is not None else ctypes.c_void_p(0)], True)
    return y


def measure(bw: float, l2: int) -> list[dict]:
    rows_out = []
    for name, (n, k, glu) in SHAPES.items():
        one = CudaQ4Linear.from_float(torch.randn((2 if glu else 1) * n, k, device=G.DEV, dtype=torch.bfloat16) * 0.02)
        copies = max(2, min(64, -(-4 * l2 // one.weight_bytes)))
        mats = [one] + [SimpleNamespace(qw32=one.qw32.clone(), scale=one.scale.clone(), zero=one.zero.clone())
                        for _ in range(copies - 1)]
        packs = [q4_mma.packed_scales(c.scale, c.zero) for c in mats]
        floor_us = one.weight_bytes / bw * 1e6
        for m in ROWS:
            cfg = tuned(m, n, k, glu)
            warps = cfg["num_warps"] if cfg.get("kernel") == "m" else q4_mma.default_warps(k)
            depth = cfg["num_stages"] if cfg.get("kernel") == "m" else 4
            tiles = -(-m // 8)
            x = torch.randn(m, k, device=G.DEV, dtype=torch.bfloat16)
            xf = x_fragments(x, tiles)
            row = dict(shape=name, rows=m, n=n, k=k, glu=glu, warps=warps, depth=depth, floor_us=floor_us, us={},
                       same_as_unpacked={})
            ref = None
            for v in VARIANTS:
                kern = nvrtc.kernel(variant_source(k, warps, depth, tiles, glu, v), "q4m_gemm")
                xin = xf if "fragments" in v else x
                pk = (lambda i: packs[i]) if _PARTS[v][0] else (lambda i: None)
                y = launch(kern, xin, m, mats[0], pk(0), glu, warps)
                if ref is None:
                    ref = y
                elif v in EXACT:
                    row["same_as_unpacked"][v] = bool(torch.equal(y, ref))
                fn = lambda: [launch(kern, xin, m, c, pk(i), glu, warps) for i, c in enumerate(mats)]  # noqa: E731
                row["us"][v] = bench_graph(fn) * 1e3 / copies
            rows_out.append(row)
            G.log(f"{name:8s} m={m:2d} floor {floor_us:6.1f} us | " + " | ".join(
                f"{v} {row['us'][v]:6.1f}" for v in VARIANTS) + f" | exact {row['same_as_unpacked']}")
        del mats, one, packs
        torch.cuda.empty_cache()
    return rows_out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_mma_loads.json")
    args = ap.parse_args()
    bw = G.copy_bandwidth(2.0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw_bytes_per_s=bw,
               rows=measure(bw, l2))
    print("\n| product | rows | floor us | " + " | ".join(VARIANTS) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in VARIANTS) + " |")
    for r in res["rows"]:
        print(f"| {r['shape']} | {r['rows']} | {r['floor_us']:.1f} | " + " | ".join(
            f"{r['us'][v]:.1f} ({100 * r['floor_us'] / r['us'][v]:.0f} %)" for v in VARIANTS) + " |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.splitext(args.out)[0] + ".png")
    return 0


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(SHAPES)
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.6), sharey=True)
    for ax, s in zip(axes, shapes):
        rows = [r for r in res["rows"] if r["shape"] == s]
        for v in VARIANTS:
            ax.plot([r["rows"] for r in rows], [100 * r["floor_us"] / r["us"][v] for r in rows], "o-", label=v)
        ax.set_title(s)
        ax.set_xlabel("rows")
        ax.set_xscale("log", base=2)
    axes[0].set_ylabel("% of the int4 floor")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"int4 tensor-core product: load knock-outs, {res['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
