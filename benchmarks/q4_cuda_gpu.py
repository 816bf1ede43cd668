"""The CUDA C++ int4 decode kernel (kernels/q4_cuda.py, NVRTC) against the engine's Triton kernel (#12).

1. Products: at the Qwen3-8B shapes and 1 row, the committed Triton configuration (q4_configs.json) against a
   grid of the CUDA kernel's configurations (rows per warp, warps, groups in flight), inside CUDA graphs over
   enough weight copies that L2 holds none; each result checked against x @ dequantized(W)^T (2e-2 of its
   largest entry) and against the Triton kernel's. With --write-configs the 1-row entries where the CUDA kernel
   won are written to forerun/kernels/q4_configs.json as kernel "c" (the Triton winner kept as "triton_<key>",
   what a machine without NVRTC uses).
2. --step: the random 8B-shape int4 model's batch-1 decode forward from a CUDA graph (512 cached tokens, as
   q4_step_budget.py), the engine with Triton 1-row products against the engine with the CUDA kernel, and the
   same with every operation between the products knocked out ("products only"); interleaved, best of runs.

    python benchmarks/q4_cuda_gpu.py --step --write-configs --out benchmarks/results/q4_cuda_h200.json

Prints tables, writes JSON (+ PNG of the step).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu as G  # noqa: E402
from quant_decode_gpu import SHAPES, graph_us  # noqa: E402
from forerun.kernels import nvrtc, q4_cuda  # noqa: E402
from forerun.kernels.quant_gemm import dequantize_int4, quantize_int4, repack_int4_w32  # noqa: E402
from forerun.models import quant_cuda  # noqa: E402

def grid(rows=(1, 2, 4), warps=(4, 8, 16), depths=(2, 4, 6)) -> list[dict]:
    return [dict(rows=r, warps=w, depth=d) for r in rows for w in warps for d in depths]


# the default grid; --rows / --warps widen it (e.g. 3 rows a warp: 48 rows a block of 16 warps, so the qkv
# product's 6144 rows make 128 blocks, at most one per SM of a 132-SM card, where 2 x 16 gives 60 SMs two blocks)
GRID = grid()
# --model 0.6b: the Qwen3-0.6B shape's products (the int4 draft's; its head is tied to the embedding and stays
# bf16). The table has no 1-row entries for them, so they run the Triton default ("v") until tuned here.
SHAPES_06B = {"qkv": (4096, 1024, False), "o": (1024, 2048, False), "gate_up": (3072, 1024, True),
              "down": (1024, 3072, False)}


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def products(bw: float, table: dict, quick: bool, shapes: dict = SHAPES, configs: list[dict] = GRID
             ) -> tuple[list[dict], dict]:
    rows, new = [], {}
    for shape, (n, k, glu) in shapes.items():
        nw = 2 * n if glu else n
        w = torch.randn(nw, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, s, z = quantize_int4(w)
        q32 = repack_int4_w32(qw)
        wd = dequantize_int4(qw, s, z)
        del w, qw
        qbytes = q32.numel() * 4 + s.numel() * 2 + z.numel() * 2
        copies = max(2, min(24, int(3e8 // qbytes) + 1))
        Q = [(q32.clone(), s.clone(), z.clone()) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ wd.t()
        if glu:
            ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
        floor = (qbytes + k * 2 + n * 2) / bw * 1e6
        key = quant_cuda.config_key(1, n, k, glu)
        base = table.get("triton_" + key, table.get(key)) or quant_cuda.default_config(1)  # (untuned: the default)
        base = {kk: base[kk] for kk in ("kernel", "block_n", "block_k", "use_dot", "num_warps", "num_stages")}
        y0 = quant_cuda.q4_product(x, q32, s, z, glu, base)
        base_us = graph_us([lambda c=c: quant_cuda.q4_product(x, *c, glu, base) for c in Q])
        best, tried = None, []
        for cfg in (configs[:3] if quick else configs):
            t0 = time.perf_counter()
            try:
                y = q4_cuda.q4c_linear(x, q32, s, z, glu=glu, **cfg)
            except Exception as e:
                G.log(f"{shape} {cfg}: {type(e).__name__}: {str(e)[:300]}")
                continue
            compile_s = time.perf_counter() - t0
            err, vs = rel(y, ref), rel(y, y0.float())
            if err > 2e-2:
                G.log(f"{shape} {cfg}: rel err {err:.2e}: refused")
                continue
            us = graph_us([lambda c=c, cfg=cfg: q4_cuda.q4c_linear(x, *c, glu=glu, **cfg) for c in Q])
            tried.append(dict(cfg, us=us, rel_err=err, vs_triton=vs, compile_s=compile_s))
            if best is None or us < best["us"]:
                best = tried[-1]
        row = dict(shape=shape, n=n, k=k, glu=glu, floor_us=floor, triton_cfg=base, triton_us=base_us,
                   triton_of_floor=floor / base_us, triton_rel_err=rel(y0, ref), cuda=best,
                   cuda_of_floor=floor / best["us"], tried=tried)
        rows.append(row)
        G.log(f"{shape:8s}: triton {base_us:7.2f} us ({100 * floor / base_us:5.1f} %), cuda {best['us']:7.2f} us "
              f"({100 * floor / best['us']:5.1f} %) rows {best['rows']} warps {best['warps']} depth {best['depth']}, "
              f"err {best['rel_err']:.1e}, vs triton {best['vs_triton']:.1e}")
        if best["us"] < base_us:
            new[key] = dict(kernel="c", block_n=best["rows"], block_k=k, use_dot=False, num_warps=best["warps"],
                            num_stages=best["depth"], us=best["us"], rel_err=best["rel_err"])
            new["triton_" + key] = {**base, "us": base_us}
        del Q, q32, s, z, wd
        torch.cuda.empty_cache()
    return rows, new


def step(bw: float, layers: int | None, repeats: int, name: str, triton: dict, cuda_all: dict, cuda_won: dict
         ) -> dict:
    from forerun.models.quant_cuda import quantize_model_cuda
    from forerun.runtime.cuda_graph import GraphRunner
    from q4_step_budget import install
    from quant_decode_gpu import model_bytes

    ctx0 = 512
    model = G.build_model(G.QWEN3_8B, layers, seed=1)
    model.ops = G.FusedLayerOps()
    quantize_model_cuda(model)
    model.ops.pdl_norms = True
    torch.cuda.empty_cache()
    floor = model_bytes(model) / bw * 1e3
    side = G.make_side(model, 1, ctx0 + 64)
    originals = {nm: getattr(model.ops, nm) for nm in ("add_rmsnorm", "qkv_to_cache")}
    ids = torch.zeros(1, 1, dtype=torch.int64, device=G.DEV)
    ctx = torch.full((1,), ctx0, dtype=torch.int64, device=G.DEV)
    variants = {"engine, Triton products": ((), "0", triton), "engine, CUDA 1-row products": ((), "1", cuda_all),
                "engine, CUDA where it won alone": ((), "1", cuda_won),
                # a card without a table: each product's default, the CUDA kernel's (quant_cuda.default_c_config)
                # where NVRTC runs, Triton's where it does not
                "engine, no table: CUDA defaults": ((), "1", {}), "engine, no table: Triton defaults": ((), "0", {}),
                "products only, Triton": (("norm", "rope", "attn"), "0", triton),
                "products only, CUDA": (("norm", "rope", "attn"), "1", cuda_all)}
    runs: dict[str, list[float]] = {nm: [] for nm in variants}
    logits = {}
    breakdown = {}
    for rep in range(repeats):
        for nm, (knocked, on, table) in variants.items():
            os.environ["FORERUN_Q4_CUDA"] = on
            quant_cuda.set_configs(name, table)
            install(model, knocked, None, originals)
            side.graphs = GraphRunner(side.runner, batch_sizes=[1], max_q_len=1)
            fn = lambda: side.graphs.run_uniform(ids, ctx, 1)  # noqa: E731
            runs[nm].append(G.bench_ms(fn, inner=20, outer=5))
            if rep == 0 and not knocked:
                out = fn()
                logits[nm] = (out[0] if isinstance(out, tuple) else out).float().clone()
                breakdown[nm] = G.kernel_breakdown(fn)
            G.log(f"[{rep}] {nm:30s} {runs[nm][-1]:.4f} ms")
            del side.graphs
    os.environ["FORERUN_Q4_CUDA"] = "1"
    quant_cuda.set_configs(name, cuda_won)
    install(model, (), None, originals)
    res = dict(floor_ms=floor, weight_bytes=model_bytes(model), ctx=ctx0, layers=model.config.num_layers,
               variants={nm: dict(ms=min(t), runs=t, of_floor=floor / min(t)) for nm, t in runs.items()},
               kernels=breakdown)
    if len(logits) >= 2:
        a, b = logits["engine, Triton products"], logits["engine, CUDA 1-row products"]
        res["logits_rel_diff"] = ((a - b).abs().max() / a.abs().max()).item()
        res["argmax_equal"] = bool(torch.equal(a.argmax(-1), b.argmax(-1)))
    return res


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    ax = axes[0]
    shapes = [r["shape"] for r in res["products"]]
    xs = range(len(shapes))
    ax.bar([i - 0.2 for i in xs], [100 * r["triton_of_floor"] for r in res["products"]], 0.4, label="Triton (engine)")
    ax.bar([i + 0.2 for i in xs], [100 * r["cuda_of_floor"] for r in res["products"]], 0.4, label="CUDA C++ (NVRTC)")
    ax.set_xticks(list(xs), shapes)
    ax.set_ylabel("% of the product's weight-streaming floor")
    ax.set_title("int4 products, 1 row, Qwen3-8B shapes")
    ax.legend(fontsize=8)
    if "step" in res:
        ax = axes[1]
        names = list(res["step"]["variants"])
        ax.barh(names, [res["step"]["variants"][nm]["ms"] for nm in names])
        ax.axvline(res["step"]["floor_ms"], color="k", ls="--", label="floor")
        ax.axvline(res["step"]["floor_ms"] / 0.75, color="tab:red", ls=":", label="75 % of the floor")
        ax.set_xlabel("decode forward, batch 1 (ms)")
        ax.invert_yaxis()
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_cuda.json")
    ap.add_argument("--step", action="store_true", help="also the decode step A/B")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers in the step (a smoke run)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="three configurations per shape")
    ap.add_argument("--write-configs", action="store_true")
    ap.add_argument("--rows", default="1,2,4", help="rows a warp to try (comma list)")
    ap.add_argument("--warps", default="4,8,16", help="warps a block to try (comma list)")
    ap.add_argument("--shapes", default=None, help="only these products (comma list of qkv, o, gate_up, down, head)")
    ap.add_argument("--model", choices=("8b", "0.6b"), default="8b",
                    help="whose products: the Qwen3-8B shape's (default) or the 0.6B draft's (no --step)")
    args = ap.parse_args()
    if args.model == "0.6b" and args.step:
        ap.error("--step runs the 8B-shape model; drop it with --model 0.6b")
    if not q4_cuda.available():
        print(f"the CUDA kernel cannot run here: {nvrtc.why_not()}")
        return 1
    name = torch.cuda.get_device_name()
    bw = G.copy_bandwidth(2.0)
    table = json.loads(quant_cuda.CONFIGS.read_text()).get(name, {})
    shapes = SHAPES if args.model == "8b" else SHAPES_06B
    if args.shapes:
        unknown = set(args.shapes.split(",")) - set(shapes)
        if unknown:
            ap.error(f"--shapes: unknown {sorted(unknown)}; choose from {sorted(shapes)}")
        shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")}
    configs = grid(tuple(int(v) for v in args.rows.split(",")), tuple(int(v) for v in args.warps.split(",")))
    prod, new = products(bw, table, args.quick, shapes, configs)
    res = dict(device=name, torch=torch.__version__, cuda=torch.version.cuda, copy_bw_bytes_per_s=bw, products=prod,
               new_configs=new)
    print("\n| product (1 row) | floor | Triton (engine) | CUDA C++ | config (rows x warps, depth) |\n"
          "| --- | --- | --- | --- | --- |")
    for r in prod:
        c = r["cuda"]
        print(f"| {r['shape']} | {r['floor_us']:.1f} us | {r['triton_us']:.1f} ({100 * r['triton_of_floor']:.0f} %) "
              f"| {c['us']:.1f} ({100 * r['cuda_of_floor']:.0f} %) | {c['rows']} x {c['warps']}, {c['depth']} |")
    per_layer, layers = ("qkv", "o", "gate_up", "down"), 36 if args.model == "8b" else 28
    if set(shapes) == set(SHAPES if args.model == "8b" else SHAPES_06B):  # (--shapes: no step total)
        tot = {kk: layers * sum(f(r) for r in prod if r["shape"] in per_layer)
               + sum(f(r) for r in prod if r["shape"] == "head")
               for kk, f in (("floor_us", lambda r: r["floor_us"]), ("triton_us", lambda r: r["triton_us"]),
                             ("cuda_us", lambda r: min(r["cuda"]["us"], r["triton_us"])))}
        res["step_products"] = tot
        what = f"{layers} layers" + (" + head" if args.model == "8b" else "")
        print(f"| {what} | {tot['floor_us'] / 1e3:.3f} ms | {tot['triton_us'] / 1e3:.3f} "
              f"({100 * tot['floor_us'] / tot['triton_us']:.0f} %) | {tot['cuda_us'] / 1e3:.3f} "
              f"({100 * tot['floor_us'] / tot['cuda_us']:.0f} %) (the faster per product) | |")
    if args.write_configs and new:
        quant_cuda.save_configs(name, new)
        G.log(f"wrote {len(new) // 2} CUDA entries to {quant_cuda.CONFIGS}")
    if args.step:
        cuda_all = dict(table)
        for r in prod:
            c = r["cuda"]
            cuda_all[quant_cuda.config_key(1, r["n"], r["k"], r["glu"])] = dict(
                kernel="c", block_n=c["rows"], block_k=r["k"], use_dot=False, num_warps=c["warps"],
                num_stages=c["depth"])
        res["step"] = step(bw, args.layers, args.repeats, name, table, cuda_all, {**table, **new})
        s = res["step"]
        print(f"\nint4 decode forward, batch 1, {s['ctx']} cached tokens, {s['layers']} layers; floor "
              f"{s['floor_ms']:.3f} ms; logits rel diff {s.get('logits_rel_diff', float('nan')):.1e}, "
              f"argmax equal {s.get('argmax_equal')}")
        print("| variant | ms | % of floor |\n| --- | --- | --- |")
        for nm, v in s["variants"].items():
            print(f"| {nm} | {v['ms']:.3f} | {100 * v['of_floor']:.1f} % |")
        for nm, b in s["kernels"].items():
            cats = ", ".join(f"{c} {v['us']:.0f} us x{v['count']:.0f}" for c, v in b["categories"].items())
            print(f"kernels ({nm}): {b['total_us']:.0f} us: {cats}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
