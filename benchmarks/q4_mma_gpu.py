#!/usr/bin/env python
"""The int4 tensor-core product for 2-32 rows (kernels/q4_mma.py, #12) against the kernels the tuned table names
otherwise, on the H200: each Qwen3-8B product (qkv, o, gate/up with the SwiGLU, down, the head) at 2-32 rows,
timed in CUDA graphs over enough weight copies that nothing comes from L2, against its floor (int4 bytes / copy
bandwidth); then whole forward steps of the random 8B-shape model (decode 1 x 1, verification 1 x 5 / 4 x 5 /
1 x 16 / 2 x 16) with the table as it is and with the tensor-core kernel where it won, beside bf16. Prints tables,
writes JSON (+ PNG); `--write` puts the winners into forerun/kernels/q4_configs.json (the old entry kept as
`triton_<key>`, which serves while the kernel is off: FORERUN_Q4_MMA=0 turns it off, see kernels/q4_mma.py).
Products of more than 16 rows: the tensor-core kernel in one call against the table's kernels in 16-row calls.

    python benchmarks/q4_mma_gpu.py --out benchmarks/results/q4_mma_h200.json [--write]
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
from forerun.kernels import q4_mma  # noqa: E402
from forerun.models import quant_cuda  # noqa: E402
from forerun.models.quant_cuda import CudaQ4Linear, config_key, q4_product, tuned  # noqa: E402
from forerun.runtime.cuda_graph import GraphRunner  # noqa: E402

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate/up": (12288, 4096, True),
          "down": (4096, 12288, False),  # name -> (outputs (per half with SwiGLU), K, SwiGLU)
          "head": (151936, 4096, False)}  # (added in session 32; its 2-16-row entries name this kernel since
                                          # session 33)
ROWS = (2, 4, 8, 16, 20, 32)  # (more than 16: the other kernels take them as 16-row calls)
MMA = [(w, 4, lane, staged) for staged in (False, True) for lane in (True, False) for w in (4, 8)]
# (warps, depth, lane-ordered scales, activations staged through shared memory) tried: the lane-ordered scales
# (session 33) won everywhere but down at 2-4 rows (q4_mma_loads_h200.json); staging not measured yet
STEPS = ((1, 1), (1, 5), (4, 5), (1, 16), (2, 16))


def products(bw: float, l2: int) -> dict:
    out = {}
    for name, (n, k, glu) in SHAPES.items():
        rows_w = 2 * n if glu else n
        one = CudaQ4Linear.from_float(torch.randn(rows_w, k, device=G.DEV, dtype=torch.bfloat16) * 0.02)
        nbytes = one.weight_bytes
        copies = max(2, min(64, -(-4 * l2 // nbytes)))
        mats = [SimpleNamespace(qw32=one.qw32, scale=one.scale, zero=one.zero)]
        mats += [SimpleNamespace(qw32=one.qw32.clone(), scale=one.scale.clone(), zero=one.zero.clone())
                 for _ in range(copies - 1)]
        for c in mats:  # (the tensor-core kernel's copy of the scales, as CudaQ4Linear holds it where it runs)
            c.lane_scales = q4_mma.packed_scales(c.scale, c.zero)
        floor_us = nbytes / bw * 1e6  # (as the decode floors: bytes / copy bandwidth)
        for m in ROWS:
            x = torch.randn(m, k, device=G.DEV, dtype=torch.bfloat16)
            table = tuned(min(m, 16), n, k, glu)
            rest = tuned(m - 16, n, k, glu) if m > 16 else None
            ref = x.float() @ one.dequantized().float().t()
            if glu:
                ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]

            def run(cfg):
                return lambda: [q4_product(x, c.qw32, c.scale, c.zero, glu, cfg, c.lane_scales) for c in mats]

            def run_table():  # (rows beyond 16 as a second call, as CudaQ4Linear made them)
                if rest is None:
                    return [q4_product(x, c.qw32, c.scale, c.zero, glu, table) for c in mats]
                return [(q4_product(x[:16], c.qw32, c.scale, c.zero, glu, table),
                         q4_product(x[16:], c.qw32, c.scale, c.zero, glu, rest)) for c in mats]

            row = dict(rows=m, n=n, k=k, glu=glu, floor_us=floor_us, table=table,
                       table_us=bench_graph(run_table) * 1e3 / copies, mma={})
            for w, d, lane, staged in MMA:
                if k % (128 * w) or (staged and not q4_mma.staged_fits(w, -(-m // 8), glu)):
                    continue
                cfg = dict(kernel="m", block_n=16, block_k=k, use_dot=True, num_warps=w, num_stages=d,
                           lane_scales=lane, x_staged=staged)
                got = q4_product(x, one.qw32, one.scale, one.zero, glu, cfg, mats[0].lane_scales).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                name_ = f"{w}x{d}{'' if lane else ' unpacked'}{' staged' if staged else ''}"
                row["mma"][name_] = dict(us=bench_graph(run(cfg)) * 1e3 / copies, rel_err=err, cfg=cfg)
            best = min(row["mma"].values(), key=lambda r: r["us"])
            row["best_mma"], row["speedup"] = best, row["table_us"] / best["us"]
            out[config_key(m, n, k, glu)] = row
            G.log(f"{name:8s} m={m:2d}: table {table['kernel']} {row['table_us']:7.1f} us, mma {best['us']:7.1f} us "
                  f"({row['speedup']:.2f}x; floor {floor_us:.1f} us, err {best['rel_err']:.1e})")
        mats = one = None  # (freed before the next shape)
        torch.cuda.empty_cache()
    return out


def steps(model, label: str, res: dict, ctx0: int = 512, shapes=STEPS, inner: int = 20, outer: int = 5) -> None:
    """Forward steps (batch x tokens in shapes) replayed from CUDA graphs, ms into res["BxT"][label]."""
    side = G.make_side(model, max(b for b, _ in shapes), ctx0 + 32)
    for b, q in shapes:
        ids = torch.zeros(b, q, dtype=torch.int64, device=G.DEV)
        ctx = torch.full((b,), ctx0, dtype=torch.int64, device=G.DEV)
        side.graphs = GraphRunner(side.runner, batch_sizes=[b], max_q_len=q)
        ms = G.bench_ms(lambda: side.graphs.run_uniform(ids, ctx, q), inner=inner, outer=outer)
        res.setdefault(f"{b}x{q}", {})[label] = ms
        G.log(f"{label:24s} {b:2d} x {q:2d}: {ms:.3f} ms")
        del side.graphs
        torch.cuda.empty_cache()


def main() -> int:
    global ROWS, STEPS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_mma.json")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke run)")
    ap.add_argument("--write", action="store_true", help="write the winners into q4_configs.json")
    ap.add_argument("--rows", default=None, help="comma list of row counts (default: %s; 1 compares the tensor-core "
                    "kernel with the 1-row CUDA kernel)" % ",".join(map(str, ROWS)))
    ap.add_argument("--steps", default=None, help="comma list of BxT steps (default: %s)"
                    % ",".join(f"{b}x{t}" for b, t in STEPS))
    ap.add_argument("--shapes", default=None, help="comma list of products (default: all)")
    args = ap.parse_args()
    if args.rows:
        ROWS = tuple(int(r) for r in args.rows.split(","))
    if args.steps:
        STEPS = tuple(tuple(int(v) for v in s.split("x")) for s in args.steps.split(","))
    if args.shapes:
        for name in [n for n in SHAPES if n not in args.shapes.split(",")]:
            del SHAPES[name]
    from quant_decode_gpu import quantize_as_engine

    name = torch.cuda.get_device_name()
    os.environ["FORERUN_Q4_MMA"] = "0"  # the baselines: the table's other kernels (its "m" entries fall back)
    bw = G.copy_bandwidth(2.0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    res = dict(device=name, torch=torch.__version__, copy_bw_bytes_per_s=bw, products=products(bw, l2), steps={})
    winners = {key: r["best_mma"]["cfg"] for key, r in res["products"].items()
               if r["speedup"] > 1.0 and r["best_mma"]["rel_err"] < 1e-2 and r["rows"] <= 16}
    model = G.build_model(G.QWEN3_8B, args.layers, seed=1)
    model.ops = G.FusedLayerOps()
    steps(model, "bf16", res["steps"], shapes=STEPS)
    os.environ["FORERUN_Q4_MMA"] = "1"  # (so that CudaQ4Linear builds the tensor-core kernel's packed scales)
    quantize_as_engine(model)
    os.environ["FORERUN_Q4_MMA"] = "0"
    steps(model, "int4 table", res["steps"], shapes=STEPS)
    base = json.loads(quant_cuda.CONFIGS.read_text()).get(name, {})
    table = dict(base)
    for key, cfg in winners.items():
        table[key] = dict(cfg, us=res["products"][key]["best_mma"]["us"], rel_err=res["products"][key]["best_mma"]["rel_err"])
    quant_cuda.set_configs(name, table)
    os.environ["FORERUN_Q4_MMA"] = "1"
    steps(model, "int4 mma", res["steps"], shapes=STEPS)
    os.environ["FORERUN_Q4_MMA"] = "0"
    quant_cuda.set_configs(name, base)
    res["winners"] = sorted(winners)
    print("\n| product | rows | floor us | table kernel | table us | tensor-core us | speedup |\n| --- | --- | --- | --- | --- | --- | --- |")
    for key, r in res["products"].items():
        print(f"| {key} | {r['rows']} | {r['floor_us']:.1f} | {r['table']['kernel']} | {r['table_us']:.1f} | "
              f"{r['best_mma']['us']:.1f} | {r['speedup']:.2f} |")
    print("\n| step (batch x tokens) | bf16 ms | int4, table ms | int4, tensor-core ms | int4 table / mma |")
    print("| --- | --- | --- | --- | --- |")
    for key, r in res["steps"].items():
        print(f"| {key} | {r['bf16']:.3f} | {r['int4 table']:.3f} | {r['int4 mma']:.3f} | "
              f"{r['int4 table'] / r['int4 mma']:.2f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.splitext(args.out)[0] + ".png")
    if args.write and winners:
        entries = {key: table[key] for key in winners}
        for key in winners:  # the entry it replaces serves while the kernel is off
            if key in base and base[key].get("kernel") != "m" and "triton_" + key not in base:
                entries["triton_" + key] = base[key]
        quant_cuda.save_configs(name, entries)
        print(f"wrote {len(winners)} entries into {quant_cuda.CONFIGS}")
    return 0


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    keys = list(res["steps"])
    for i, label in enumerate(("bf16", "int4 table", "int4 mma")):
        ax.bar([j + 0.27 * (i - 1) for j in range(len(keys))], [res["steps"][k][label] for k in keys], 0.27,
               label=label)
    ax.set_xticks(range(len(keys)), keys)
    ax.set_xlabel("batch x tokens per step")
    ax.set_ylabel("forward step (ms)")
    ax.set_title(f"int4 verification steps, tensor-core kernel, {res['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
