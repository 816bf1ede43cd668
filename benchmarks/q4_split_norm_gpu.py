"""The add + RMSNorm split across two int4 products (#12, FusedLayerOps.split_norms) against the norm as its own kernel.

Per Qwen3-8B product that follows a norm (qkv, gate/up with the SwiGLU, the head; 1 row, the card's tuned CUDA C++
configuration), inside CUDA graphs over weight copies larger than L2, under PDL:

* plain: `q4c_linear` on an already normalised row (the product alone);
* split: `q4c_split_norm_linear` (the row normalised in every block's prologue from the partial sums of squares);
* chain, norm apart: the product before the norm (o or down, `q4c_linear`), `add_rmsnorm`, this product;
* chain, split: the product before with the add in its epilogue (`q4c_add_linear`), this product split.

    python benchmarks/q4_split_norm_gpu.py --out benchmarks/results/q4_split_norm_h200.json

Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu as G  # noqa: E402
from quant_decode_gpu import graph_us  # noqa: E402
from forerun.kernels.fused_norm import add_rmsnorm  # noqa: E402
from forerun.kernels.q4_cuda import q4c_add_linear, q4c_linear, q4c_split_norm_linear  # noqa: E402
from forerun.models import quant_cuda  # noqa: E402
from forerun.models.quant_cuda import CudaQ4Linear  # noqa: E402

# product after the norm -> (its outputs (per half with SwiGLU), SwiGLU, the product before the norm (N, K))
SHAPES = {"qkv": (6144, False, (4096, 12288)), "gate_up": (12288, True, (4096, 4096)),
          "head": (151936, False, (4096, 12288))}
H = 4096


def cfg_of(n: int, k: int, glu: bool) -> dict:
    c = quant_cuda.tuned(1, n, k, glu)
    if c["kernel"] != "c":
        raise SystemExit(f"{n} x {k}: the table names kernel {c['kernel']!r} here, not the CUDA C++ one")
    return dict(rows=c["block_n"], warps=c["num_warps"], depth=c["num_stages"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_split_norm.json")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    nw = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
    rows = []
    for name in args.shapes.split(","):
        n, glu, (pn, pk) = SHAPES[name]
        after = CudaQ4Linear.from_float(torch.randn(2 * n if glu else n, H, device="cuda", dtype=torch.bfloat16) * .02)
        before = CudaQ4Linear.from_float(torch.randn(pn, pk, device="cuda", dtype=torch.bfloat16) * 0.02)
        copies = max(2, min(16, -(-3 * l2 // (after.weight_bytes + before.weight_bytes))))
        A = [(after.qw32.clone(), after.scale.clone(), after.zero.clone()) for _ in range(copies)]
        B = [(before.qw32.clone(), before.scale.clone(), before.zero.clone()) for _ in range(copies)]
        ca, cb = cfg_of(n, H, glu), cfg_of(pn, pk, False)
        xb = torch.randn(1, pk, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
        s, parts = q4c_add_linear(xb, res, *B[0], **cb)
        h, _ = add_rmsnorm(s, None, nw, 1e-6, pdl=True)
        row = dict(product=name, n=n, glu=glu, after_cfg=ca, before_cfg=cb, copies=copies)
        row["plain_us"] = graph_us([lambda a=a: q4c_linear(h, *a, glu=glu, pdl=True, **ca) for a in A])
        row["split_us"] = graph_us([lambda a=a: q4c_split_norm_linear(s, parts, nw, 1e-6, *a, glu=glu, pdl=True, **ca)
                                    for a in A])
        row["norm_alone_us"] = graph_us([lambda: add_rmsnorm(s, res, nw, 1e-6, pdl=True)] * copies)

        def apart(a, b):
            y = q4c_linear(xb, *b, pdl=True, **cb)
            hh, _ = add_rmsnorm(y, res, nw, 1e-6, pdl=True)
            return q4c_linear(hh, *a, glu=glu, pdl=True, **ca)

        def split(a, b):
            ss, pp = q4c_add_linear(xb, res, *b, pdl=True, **cb)
            return q4c_split_norm_linear(ss, pp, nw, 1e-6, *a, glu=glu, pdl=True, **ca)

        row["chain_apart_us"] = graph_us([lambda a=a, b=b: apart(a, b) for a, b in zip(A, B)])
        row["chain_split_us"] = graph_us([lambda a=a, b=b: split(a, b) for a, b in zip(A, B)])
        ref, got = apart(A[0], B[0]).float(), split(A[0], B[0]).float()
        row["rel_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
        rows.append(row)
        G.log(f"{name:8s}: plain {row['plain_us']:7.2f} us, split {row['split_us']:7.2f}, norm alone "
              f"{row['norm_alone_us']:.2f}; chain apart {row['chain_apart_us']:7.2f}, "
              f"split {row['chain_split_us']:7.2f}"
              f" (err {row['rel_err']:.1e})")
        del A, B, after, before
        torch.cuda.empty_cache()
    res_ = dict(device=torch.cuda.get_device_name(), rows=rows)
    print("\n| product after the norm | plain us | split us | chain: norm apart us | chain: split us |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['product']} | {r['plain_us']:.2f} | {r['split_us']:.2f} | {r['chain_apart_us']:.2f} | "
              f"{r['chain_split_us']:.2f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res_, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
