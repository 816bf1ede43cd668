"""Where the time of each 1-row int4 product goes inside a chain of them, block by block (issue 12, session 51).

The engine's decode step runs one CUDA C++ kernel per product (kernels/q4_cuda.py) under PDL, and the 145 chained
products of the 8B shape take ~1.5-1.8 us more each than their bytes need (1.75-1.79 ms against a 1.565 ms floor on
the H100, 1.383 against 1.118 on the H200, q4_persistent_gpu.py / q4_stream_gpu.py). This script says which part of
a product that overhead is. It builds the engine's kernel with four timestamps added by source edit (the kernel is
otherwise unchanged): thread 0 of every block records %globaltimer and clock64 at its start, after
`griddepcontrol.wait`, after the activation row is converted (the __syncthreads before the dot products), and at
its end (after a closing __syncthreads), and its SM. A chain of LAYERS layers + the head (the tuned configurations
of q4_configs.json, PDL on, each product reading the one before) is replayed from a CUDA graph; per product:

  * release: first wait released - the previous product's last block end (the PDL hand-over);
  * convert: the row's read and conversion after the wait (clock64, median over blocks);
  * dot products: conversion done -> block end (median);
  * tail: last block end - median block end (the slowest blocks);
  * duration: last block end - the previous product's last block end; floor: its bytes / copy bandwidth.

Prints a table per product kind, writes JSON + PNG.

    python benchmarks/q4_block_timing_gpu.py --out benchmarks/results/q4_block_timing_h100.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu as G  # noqa: E402
from forerun.kernels import nvrtc, q4_cuda  # noqa: E402
from q4_persistent_gpu import H, I, QKV, V, build_chain, c_config, card, chain_bytes, engine_chain  # noqa: E402

SLOTS = 10  # u64 per block: globaltimer x 4, clock64 x 4, SM id
# thread 0 keeps the stamps in shared memory (in registers they cost the SwiGLU build 13 more and half its occupancy)
_T = ('if (threadIdx.x == 0) {{ unsigned long long _g; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(_g)); '
      '_ts[{i}] = _g; _ts[4 + {i}] = clock64(); }}')


def timed_source(k: int, rows: int, warps: int, depth: int, glu: bool) -> str:
    """q4_cuda's plain PDL kernel with the four timestamps (an AssertionError if its source moved)."""
    src = q4_cuda.source(k, rows, warps, depth, glu, True)
    edits = [
        ("int n_part)", "int n_part, unsigned long long* __restrict__ ts)"),
        ("    const int row0 = (blockIdx.x * WARPS + warp) * R_;\n",
         "    const int row0 = (blockIdx.x * WARPS + warp) * R_;\n"
         "    __shared__ unsigned long long _ts[8];\n    " + _T.format(i=0) + "\n"),
        ('    asm volatile("griddepcontrol.wait;" ::: "memory");\n#endif\n',
         '    asm volatile("griddepcontrol.wait;" ::: "memory");\n#endif\n    ' + _T.format(i=1) + "\n"),
        ("    __syncthreads();\n\n    float acc[NW];", "    __syncthreads();\n    " + _T.format(i=2)
         + "\n\n    float acc[NW];"),
    ]
    for old, new in edits:
        assert src.count(old) == 1, f"q4_cuda's source moved: {old!r}"
        src = src.replace(old, new)
    end = src.rindex("\n}\n")
    tail = ("\n    __syncthreads();\n    " + _T.format(i=3) + "\n    if (threadIdx.x == 0) {\n"
            "        unsigned int sm; asm volatile(\"mov.u32 %0, %smid;\" : \"=r\"(sm));\n"
            f"        unsigned long long* t = ts + (long)blockIdx.x * {SLOTS};\n"
            "        for (int i = 0; i < 8; i++) t[i] = _ts[i];\n        t[8] = sm;\n    }")
    return src[:end] + tail + src[end:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_block_timing.json")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--carveout", type=int, default=-1,
                    help="every kernel's preferred shared-memory carveout, %% (gpu.set_carveout; -1: the driver's)")
    args = ap.parse_args()
    if (dev := card()) is None:
        return 1
    name, sms, bw, table = dev

    h, prods = build_chain(args.layers)
    kinds = {(QKV, H, False): "qkv", (H, H, False): "o", (I, H, True): "gate/up + SwiGLU", (H, I, False): "down",
             (V, H, False): "head"}
    launches, bufs, meta = [], [], []
    null = ctypes.c_void_p(0)
    for qw, s, z, x, y, glu in prods:
        n, k = y.shape[1], x.shape[1]
        cfg = c_config(table, n, k, glu)
        rows, warps, depth = cfg["rows"], cfg["warps"], cfg["depth"]
        kern = nvrtc.kernel(timed_source(k, rows, warps, depth, glu), "q4c_gemv")
        blocks = -(-n // (rows * warps))
        ts = torch.zeros(blocks, SLOTS, dtype=torch.int64, device="cuda")
        bufs.append(ts)
        launches.append((kern, blocks, 32 * warps, q4_cuda.smem_bytes(k),
                         [x, qw, s, z, y, n, n, null, null, null, ctypes.c_float(0.0), null, null, 0, ts]))
        meta.append(dict(kind=kinds[(n, k, glu)], blocks=blocks, rows=rows, warps=warps, depth=depth,
                         bytes=qw.numel() * 4 + s.numel() * 2 + z.numel() * 2))

    def run(pdl: bool = True):
        for kern, blocks, threads, smem, a in launches:
            nvrtc.launch(kern, blocks, threads, smem, a, pdl)

    # the outputs should equal the engine kernel's (the timestamps change nothing else): checked with PDL launches
    # and without (a difference only with PDL would be a read moved above griddepcontrol.wait)
    engine_chain(h, prods, table, write=True)()  # the engine's kernels into the products' buffers
    torch.cuda.synchronize()
    ref = [y.clone() for *_, y, _ in prods]
    check = {}
    for pdl in (True, False):
        for *_, y, _ in prods:
            y.zero_()
        run(pdl)
        torch.cuda.synchronize()
        # bit patterns compared (8 random layers without norms overflow to inf / NaN, and NaN != NaN)
        bad = [(i, meta[i]["kind"], int((y.view(torch.int16) != r.view(torch.int16)).sum()))
               for i, ((*_, y, _), r) in enumerate(zip(prods, ref))
               if not torch.equal(y.view(torch.int16), r.view(torch.int16))]
        check["pdl" if pdl else "no pdl"] = dict(identical=not bad, first_differences=bad[:5])
        G.log(f"timed chain ({'PDL' if pdl else 'no PDL'}) == the engine's kernels: {not bad}"
              + (f"; first (product, kind, elements): {bad[:5]}" if bad else ""))
    assert all(c["identical"] for c in check.values()), f"the timed kernel's outputs differ from the engine's: {check}"
    if args.carveout != -1:  # (every kernel is compiled by now)
        G.log(f"shared-memory carveout {args.carveout} % on {G.set_carveout(args.carveout)} kernels")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ms = G.bench_ms(graph.replay, inner=10, outer=3)
    graph.replay()
    torch.cuda.synchronize()
    t = [b.cpu().double() for b in bufs]
    # cycles per ns from the blocks' own start -> end in both clocks
    ratio = torch.cat([(b[:, 7] - b[:, 4]) / (b[:, 3] - b[:, 0]).clamp_min(1) for b in t]).median().item()
    rows_out = []
    for p in range(1, len(t)):
        b, prev_end = t[p], t[p - 1][:, 3].max().item()
        end = b[:, 3]
        per_sm = torch.bincount(b[:, 8].long(), minlength=sms).float()
        rows_out.append(dict(
            kind=meta[p]["kind"], floor_us=meta[p]["bytes"] / bw * 1e6,
            duration_us=(end.max().item() - prev_end) / 1e3,
            first_start_us=(b[:, 0].min().item() - prev_end) / 1e3,
            release_us=(b[:, 1].min().item() - prev_end) / 1e3,
            wait_spread_us=(b[:, 1].max() - b[:, 1].min()).item() / 1e3,
            convert_us=((b[:, 6] - b[:, 5]).median().item()) / ratio / 1e3,
            dots_us=((b[:, 7] - b[:, 6]).median().item()) / ratio / 1e3,
            tail_us=(end.max() - end.median()).item() / 1e3,
            blocks_per_sm_max=per_sm.max().item(), blocks_per_sm_mean=per_sm.mean().item()))
    agg = {}
    for r in rows_out:
        a = agg.setdefault(r["kind"], {k: [] for k in r if k != "kind"})
        for k, v in r.items():
            if k != "kind":
                a[k].append(v)
    summary = {kind: {k: sum(v) / len(v) for k, v in a.items()} | dict(n=len(a["duration_us"]))
               for kind, a in agg.items()}
    wbytes = chain_bytes(prods)
    res = dict(device=name, sms=sms, copy_bw_bytes_per_s=bw, layers=args.layers, chain_ms=ms, carveout=args.carveout,
               floor_ms=wbytes / bw * 1e3, cycles_per_ns=ratio, check=check, configs=meta, products=rows_out,
               by_kind=summary)
    print(f"\n{name}: {len(prods)} chained int4 products, {ms:.3f} ms ({100 * wbytes / bw * 1e3 / ms:.1f} % of the "
          f"{wbytes / bw * 1e3:.3f} ms floor); clock {ratio:.2f} cycles/ns; means per product kind, us")
    cols = ["floor_us", "duration_us", "first_start_us", "release_us", "wait_spread_us", "convert_us", "dots_us",
            "tail_us", "blocks_per_sm_max", "blocks_per_sm_mean"]
    print("| kind | n | " + " | ".join(cols) + " |\n| --- | --- |" + " --- |" * len(cols))
    for kind, v in summary.items():
        print(f"| {kind} | {v['n']} | " + " | ".join(f"{v[c]:.2f}" for c in cols) + " |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    names = list(summary)
    left = [0.0] * len(names)
    for part, color in (("release_us", "tab:gray"), ("convert_us", "tab:orange"), ("dots_us", "tab:blue"),
                        ("tail_us", "tab:red")):
        vals = [max(summary[n][part], 0.0) for n in names]
        ax.barh(names, vals, left=left, color=color, label=part[:-3])
        left = [a + b for a, b in zip(left, vals)]
    ax.scatter([summary[n]["floor_us"] for n in names], names, color="k", marker="|", s=300, label="floor")
    ax.scatter([summary[n]["duration_us"] for n in names], names, color="k", marker="x", label="duration")
    ax.set_xlabel("us per product (means)")
    ax.set_title(f"1-row int4 products in a chain, block timestamps ({name})")
    ax.legend(fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
