"""The 1-row int4 kernel with int8 activations and dp4a products against its f16 pairs (issue 12, session 64).

kernels/q4_cuda.py's decode kernel turns the activation row into pre-scaled f16 pairs and multiplies each word of 8
codes by them with packed-f16 instructions (~17 a word); with DP4A (q4_cuda.INT8_ACTIVATIONS, FORERUN_Q4_DP4A=1)
it rounds the row to int8 with one scale per group of 32 (as llama.cpp's CUDA decode does with its q8_1
activations) and takes a word in two masks, a shift and two dp4a (exact int32 sums), the group's scale and offset
once per 32 codes. Two questions, on the random 8B-shape weights (36 layers + the head):

  * accuracy: each product shape against x @ W^T in float32 (W = codes * scale + offset, exact), with N(0, 1)
    activations and with one outlier 30x the others in every group of 32 (where int8 rounding of the others is
    coarsest); the f16 path's error beside it;
  * speed: the 145 products chained as in a forward (q4_persistent_gpu.py's chain, one launch per product, PDL, the
    card's tuned configurations), f16 pairs and int8 interleaved, CUDA graphs, best of the runs.

Prints tables, writes JSON + PNG.

    python benchmarks/q4_dp4a_gpu.py --out benchmarks/results/q4_dp4a_h200.json
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu as G  # noqa: E402
from forerun.kernels import q4_cuda  # noqa: E402
from forerun.kernels.quant_gemm import unpack_int4_w32  # noqa: E402
from forerun.models import quant_cuda  # noqa: E402
from q4_persistent_gpu import H, I, QKV, V, build_chain, c_config, card, chain_bytes, engine_chain, finish, \
    make_weights, time_graphs  # noqa: E402

SHAPES = {"qkv": (QKV, H, False), "o": (H, H, False), "gate/up + SwiGLU": (I, H, True), "down": (H, I, False),
          "head": (V, H, False)}


def with_int8(on: bool, fn):
    """fn run with the 1-row kernel's activations int8 (on) or f16 pairs; the switch put back after."""
    def run():
        was = q4_cuda.INT8_ACTIVATIONS[0]
        q4_cuda.INT8_ACTIVATIONS[0] = on
        try:
            return fn()
        finally:
            q4_cuda.INT8_ACTIVATIONS[0] = was
    return run


def accuracy(table: dict) -> dict:
    """Max |y - ref| / max |ref| per product shape, activation kind and path."""
    torch.manual_seed(0)
    out = {}
    for name, (n, k, glu) in SHAPES.items():
        qw, s, z = make_weights(2 * n if glu else n, k)
        rows = qw.shape[0]  # the reference's weights exactly: codes * scale + offset in float32
        wd = (unpack_int4_w32(qw).float().reshape(rows, k // 32, 32) * s.float()[..., None]
              + z.float()[..., None]).reshape(rows, k)
        cfg = c_config(table, n, k, glu)
        x = torch.randn(1, k, device="cuda")
        xo = x.clone().reshape(-1, 32)
        xo[:, 7] = 30.0
        for kind, xa in (("N(0, 1)", x), ("an outlier 30x in every group of 32", xo.reshape(1, k))):
            xb = xa.to(torch.bfloat16)
            ref = xb.float() @ wd.t()
            if glu:
                ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
            row = {}
            for path, on in (("f16 pairs", False), ("int8 + dp4a", True)):
                y = with_int8(on, lambda: q4_cuda.q4c_linear(xb, qw, s, z, glu=glu, **cfg))()
                row[path] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            out[f"{name}, {kind}"] = row
            G.log(f"{name:18s} {kind:38s} f16 {row['f16 pairs']:.2e}  int8 {row['int8 + dp4a']:.2e}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_dp4a.json")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if (dev := card()) is None:
        return 1
    name, sms, bw, table = dev
    quant_cuda.set_configs(name, table)
    acc = accuracy(table)
    h, prods = build_chain(args.layers)
    chain = engine_chain(h, prods, table)  # (random unnormalised weights: its values overflow; only times count)
    floor = chain_bytes(prods) / bw * 1e3
    variants = {"one kernel per product, f16 pairs (the engine before session 66 on the H100)": with_int8(False, chain),
                "one kernel per product, int8 activations + dp4a": with_int8(True, chain)}
    runs = time_graphs(variants, args.repeats, floor)
    res = dict(device=name, torch=torch.__version__, sms=sms, copy_bw_bytes_per_s=bw, layers=args.layers,
               weight_bytes=chain_bytes(prods), floor_ms=floor,
               accuracy={k: {p: round(e, 6) for p, e in v.items()} for k, v in acc.items()})
    print("\n| product, activations | f16 pairs | int8 + dp4a |\n| --- | --- | --- |")
    for k, v in acc.items():
        print(f"| {k} | {v['f16 pairs']:.2e} | {v['int8 + dp4a']:.2e} |")
    finish(res, runs, args.out, f"{args.layers} layers + head of int4 1-row products, chained ({name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
