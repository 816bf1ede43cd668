"""Do int4 products run faster when their weights were requested into L2 while the card idled? (#12)

Between the matrix products of an int4 decode step the card runs short kernels that read little (RoPE, attention,
norms: ~0.3 ms of a 2.1 ms step on the H100, q4_step_budget.py), and the memory idles meanwhile. This measures,
per Qwen3-8B product shape at 1 row with the card's tuned kernel (CUDA graphs over weight copies larger than L2):

* cold: the product alone, its weights in HBM; hot: the same copy again and again (in L2 where it fits);
* window: an idle kernel of about `--idle-us` (torch.cuda._sleep), then the product, against the same with a
  prefetch kernel launched before the idle one that requests the product's first `--cap-mb` MB into L2, as 4 KB
  bulk prefetches (cp.async.bulk.prefetch.L2) or one prefetch per 128-byte line (prefetch.global.L2). "extra" is
  the sequence's time less the idle kernel's alone: what the product costs after the window.

    python benchmarks/q4_l2_gpu.py --out benchmarks/results/q4_l2_h100.json

Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu as G  # noqa: E402
from quant_decode_gpu import SHAPES, graph_us  # noqa: E402
from forerun.kernels import q4_cuda  # noqa: E402
from forerun.kernels.quant_gemm import quantize_int4, repack_int4_w32  # noqa: E402
from forerun.models import quant_cuda  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_l2.json")
    ap.add_argument("--idle-us", type=float, default=8.0)
    ap.add_argument("--cap-mb", default="4,8,16")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = G.copy_bandwidth(2.0)
    # the idle kernel: cycles for about idle_us
    cyc = 20000
    sleep_us = graph_us([lambda: torch.cuda._sleep(cyc)] * 8)
    cyc = int(cyc * args.idle_us / sleep_us)
    sleep_us = graph_us([lambda: torch.cuda._sleep(cyc)] * 8)
    G.log(f"idle kernel: {cyc} cycles = {sleep_us:.2f} us")
    caps = [int(c) for c in args.cap_mb.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        n, k, glu = SHAPES[shape]
        nw = 2 * n if glu else n
        w = torch.randn(nw, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, s, z = quantize_int4(w)
        q32 = repack_int4_w32(qw)
        del w, qw
        qbytes = q32.numel() * 4 + s.numel() * 2 + z.numel() * 2
        copies = max(2, min(24, int(3e8 // qbytes) + 1))
        Q = [(q32.clone(), s.clone(), z.clone()) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cfg = quant_cuda.tuned(1, n, k, glu)
        prod = lambda c: quant_cuda.q4_product(x, *c, glu, cfg)  # noqa: E731
        floor = qbytes / bw * 1e6
        row = dict(shape=shape, n=n, k=k, glu=glu, mb=qbytes / 2 ** 20, cfg=cfg, floor_us=floor,
                   cold_us=graph_us([lambda c=c: prod(c) for c in Q]),
                   hot_us=graph_us([lambda q0=Q[0]: prod(q0)] * copies))
        base = graph_us([lambda c=c: (torch.cuda._sleep(cyc), prod(c)) for c in Q]) - sleep_us
        row["window_none_us"] = base
        for cap in caps:
            plans = [q4_cuda.prefetch_plan(quant_cuda._head_ranges(types.SimpleNamespace(
                qw32=c[0], scale=c[1], zero=c[2], out_features=nw, in_features=k), glu, cap << 20), sms) for c in Q]
            for lines in (False, True):
                us = graph_us([lambda c=c, p=p: (q4_cuda.l2_prefetch(p, sms, lines), torch.cuda._sleep(cyc), prod(c))
                               for c, p in zip(Q, plans)]) - sleep_us
                row[f"window_{'lines' if lines else 'bulk'}_{cap}mb_us"] = us
        rows.append(row)
        G.log(f"{shape:8s} {row['mb']:.1f} MB: cold {row['cold_us']:.2f} us ({100 * floor / row['cold_us']:.0f} %), "
              f"hot {row['hot_us']:.2f}, after idle {base:.2f}; "
              + ", ".join(f"{kk[7:-3]} {v:.2f}" for kk, v in row.items() if kk.startswith("window_") and "none" not in kk))
        del Q, q32, s, z
        torch.cuda.empty_cache()
    res = dict(device=torch.cuda.get_device_name(), copy_bw_bytes_per_s=bw, idle_us=sleep_us, sms=sms, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
