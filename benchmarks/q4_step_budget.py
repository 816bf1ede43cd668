"""Where an int4 decode step goes (#12), by knock-out: the random Qwen3-8B-shape model quantized to int4 on the GPU
(CudaQ4Linear), one batch-1 decode forward replayed from a CUDA graph (512 cached tokens), with the operations
between the matrix products replaced, one kind at a time, by stand-ins that launch nothing. The step time a
variant saves is the most that fusing that operation away could save; "products only" is the step that is left
when every one of them is gone. Also: attention with fewer KV splits, and decode attention in the one-launch CUDA
kernel (attention/cuda_decode.py, an experiment) instead of the Triton split + merge kernels.
A variant fuses each add + RMSNorm into the int4 product after it (FusedLayerOps.fuse_norms, off in the engine:
measured slower); one splits it across the products around it (FusedLayerOps.split_norms: on by default on the H100,
off on the H200, where it measured slower), one does so with the split's products 4 groups deep (measured slower),
one only moves the adds into the epilogues of the products before them (an experiment), two run the 1-row products
with their whole weight slice copied into shared memory before the PDL wait (q4_smem_prefetch_gpu.py, norm kernels
apart), two as one grid per product whose warps claim their rows from a counter (q4_claim_gpu.py, norm kernels
apart), six with every kernel's preferred shared-memory carveout set to one value (gpu.set_carveout; every
value measured slower than the driver's own choices, session 55), the Triton decode attention in other shapes, and
the decode attention fused with its RoPE into one kernel whose KV splits merge in a thread-block cluster
(attention/fused_decode.py; session 56), and the 1-row kernel loading the activation row one word at a time as it
did before session 58, and (session 64) with the row rounded to int8 for dp4a products (q4_cuda.INT8_ACTIVATIONS).
Variants run interleaved (the card's clocks drift); best of the runs. Prints a table, writes JSON (+ PNG).

    python benchmarks/q4_step_budget.py --out benchmarks/results/q4_step_budget_h200.json

The stand-ins give wrong numbers on purpose: only the times mean anything.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu as G  # noqa: E402
from forerun.attention import cuda_decode, fused_decode  # noqa: E402
from forerun.attention.triton_backend import TritonPagedAttention  # noqa: E402
from forerun.kernels import q4_cuda  # noqa: E402
from forerun.models import quant_cuda  # noqa: E402
from forerun.runtime.cuda_graph import GraphRunner  # noqa: E402

SPLIT_PRODUCT = quant_cuda.q4c_split_norm_linear
FUSED_WARPS, FUSED_SPLITS, FUSED_DEFAULT = fused_decode.WARPS, fused_decode.MAX_SPLITS, fused_decode.enabled()
C_KERNEL = quant_cuda.KERNELS["c"]
# "wordwise": the 1-row kernel as before session 58, each of a thread's words of the activation row loaded just
# before it is converted (after the previous word's shuffles and shared stores: one L2 trip a word in a row on the
# critical path; the add + RMSNorm prologue, off in the engine, keeps its preloads)
ENGINE_SRC = q4_cuda._SRC
WORDWISE_SRC = ENGINE_SRC.replace(
    "const uint4 v = vr[t];",
    "const uint4 v = NORM || SPLIT ? vr[t] : i < 4 * G_ ? __ldca(x + i) : make_uint4(0u, 0u, 0u, 0u);")
assert WORDWISE_SRC != ENGINE_SRC

# variant -> (operations knocked out, attention KV splits (None: the backend's own choice)[, decode attention in
# the one-launch CUDA kernel (an experiment, off in the engine) instead of the Triton split + merge kernels])
VARIANTS = {
    "engine": ((), None),
    "engine, add+norm fused into the products": (("fused",), None),
    "engine, norms split across the products around them": (("split",), None),
    "engine, norms split, their products 4 groups deep": (("split", "deep"), None),
    "engine, norm kernels (norms not split)": (("apart",), None),
    "engine, adds in the epilogues, norms apart": (("addonly",), None),
    "engine, norm kernels, products' slices in shared memory (2x16)": (("apart", "smem2x16"), None),
    "engine, norm kernels, products' slices in shared memory (1x16)": (("apart", "smem1x16"), None),
    "engine, norm kernels, products as one grid each, rows claimed (1 block an SM)": (("apart", "claims1"), None),
    "engine, norm kernels, products as one grid each, rows claimed (2 blocks an SM)": (("apart", "claims2"), None),
    "engine, CUDA C++ decode attention (4 warps)": ((), None, (4, 0)),
    "engine, CUDA C++ decode attention (8 warps)": ((), None, (8, 0)),
    "attention 1 split": ((), 1),
    "attention 4 splits": ((), 4),
    "no add+norm": (("norm",), None),
    "no qk-norm/rope/cache write": (("rope",), None),
    "no attention": (("attn",), None),
    "products only": (("norm", "rope", "attn"), None),
    # "carveNN": every kernel's preferred shared-memory carveout set to NN % (gpu.set_carveout), one L1 / shared
    # split for the whole step, so no kernel's blocks wait for an SM to drain before the split can change
    "engine, every kernel's shared-memory carveout at 100 %": (("carve100",), None),
    "engine, every kernel's shared-memory carveout at 50 %": (("carve50",), None),
    "engine, every kernel's shared-memory carveout at 0 %": (("carve0",), None),
    "products only, carveout 0 %": (("norm", "rope", "attn", "carve0"), None),
    "no attention, carveout 100 %": (("attn", "carve100"), None),
    "products only, carveout 100 %": (("norm", "rope", "attn", "carve100"), None),
    # the Triton decode attention's own shape: "bnNN" keys a tile (engine 64), "awN" warps (engine 4), "msNN" the
    # most KV splits (engine 16). At 512 cached tokens the engine's 16 splits of 64-key tiles leave 8 splits with no
    # tile: 64 programs work, each on one tile fetched before its PDL wait; smaller tiles spread the same keys over
    # more programs with less each (session 56)
    "attention tiles of 32 keys": (("bn32",), None),
    "attention tiles of 32 keys, 2 warps": (("bn32", "aw2"), None),
    "attention tiles of 16 keys, 32 splits": (("bn16", "ms32"), None),
    "attention tiles of 16 keys, 32 splits, 2 warps": (("bn16", "ms32", "aw2"), None),
    "attention 2 warps": (("aw2",), None),
    "attention 8 warps": (("aw8",), None),
    # a decode step's Q/K norm + RoPE + cache write + split attention + merge as one kernel (attention/
    # fused_decode.py, session 56; the engine's default only where FORERUN_FUSED_ATTENTION=1): "fusedattn" switches
    # it on, "unfused" runs the three kernels (as every knock-out of RoPE or attention and every attention-shape
    # variant does); "fwN" / "fsN": the fused kernel's warps a block (2) / most KV splits, i.e. blocks a cluster (8);
    # "late": its PDL trigger at its end (the o product launched then) instead of at its start
    "engine, activation row loaded word by word (the 1-row kernel before session 58)": (("wordwise",), None),
    # "dp4a": the 1-row products take the activation row as int8 (a scale per group of 32) with dp4a products
    # instead of f16 pairs (q4_cuda.INT8_ACTIVATIONS, FORERUN_Q4_DP4A; session 64)
    "engine, int8 activations, dp4a products": (("dp4a",), None),
    "products only, int8 activations, dp4a products": (("norm", "rope", "attn", "dp4a"), None),
    # "f16": the f16 pairs forced, for cards where dp4a is the default (q4_cuda.DP4A_CARDS: the H100, session 66)
    "engine, f16 pairs (no dp4a)": (("f16",), None),
    "products only, f16 pairs (no dp4a)": (("norm", "rope", "attn", "f16"), None),
    "engine, attention unfused (RoPE, split, merge kernels)": (("unfused",), None),
    "engine, fused attention (one kernel a layer)": (("fusedattn",), None),
    "engine, fused attention with 4 warps": (("fusedattn", "fw4"), None),
    "engine, fused attention with at most 4 splits": (("fusedattn", "fs4"), None),
    "engine, fused attention with 8 warps": (("fusedattn", "fw8"), None),
    "engine, fused attention with 16 splits (non-portable clusters)": (("fusedattn", "fs16"), None),
    "engine, fused attention with 16 splits, 4 warps": (("fusedattn", "fs16", "fw4"), None),
    "engine, fused attention with 16 splits, 8 warps": (("fusedattn", "fs16", "fw8"), None),
    "engine, fused attention, the o product launched at its end": (("fusedattn", "late"), None),
}


def install(model, knocked: tuple[str, ...], splits: int | None, originals: dict,
            cuda_attention: tuple[int, int] | None = None) -> None:
    """Put back the real operations, then replace the knocked-out ones by stand-ins that launch no kernel.
    cuda_attention: (warps, PDL trigger position) of the one-launch CUDA decode attention, or None (Triton)."""
    ops = model.ops
    for name, fn in originals.items():
        setattr(ops, name, fn)
    shape = {w[:2]: int(w[2:]) for w in knocked if w[:2] in ("bn", "aw", "ms") and w[2:].isdigit()}
    model.backend = TritonPagedAttention(block_n=shape.get("bn", 64), num_warps=shape.get("aw", 4),
                                         max_splits=shape.get("ms", 16), num_splits=splits,
                                         cuda_decode=cuda_attention is not None)
    if shape or {"unfused", "rope", "attn"} & set(knocked):
        model.backend.fuses_decode = False
    fused_decode.set_enabled(FUSED_DEFAULT or "fusedattn" in knocked)
    fused = {w[:2]: int(w[2:]) for w in knocked if w[:2] in ("fw", "fs") and w[2:].isdigit()}
    fused_decode.WARPS = fused.get("fw", FUSED_WARPS)
    fused_decode.MAX_SPLITS = fused.get("fs", FUSED_SPLITS)
    fused_decode.EARLY_TRIGGER = "late" not in knocked
    if cuda_attention is not None:
        cuda_decode.WARPS, cuda_decode.TRIGGER = cuda_attention
    src = WORDWISE_SRC if "wordwise" in knocked else ENGINE_SRC
    if q4_cuda._SRC != src:  # (each variant captures its own graph: the kernels are fetched again then)
        q4_cuda._SRC = src
        q4_cuda._kernel_on.cache_clear()
    # None: the engine's own choice (by card, q4_cuda.int8_activations)
    q4_cuda.INT8_ACTIVATIONS[0] = True if "dp4a" in knocked else False if "f16" in knocked else None
    bufs: dict = {}
    carve = [w for w in knocked if w.startswith("carve")]
    n_set = G.set_carveout(int(carve[0][5:]) if carve else -1)
    if carve:
        G.log(f"shared-memory carveout {carve[0][5:]} % on {n_set} kernels")
    ops.fuse_norms = "fused" in knocked
    default = ops.__dict__.setdefault("_split_default", ops.split_norms)  # (the card's default: the engine's)
    ops.split_norms = True if {"split", "addonly"} & set(knocked) else False if {
        "apart", "fused", "norm"} & set(knocked) else default
    ops.__dict__.pop("_partials", None)
    # "smemRxW": the 1-row products copy their whole weight slice into shared memory before the PDL wait
    # (q4_smem_prefetch_gpu.py's kernel at R rows a warp x W warps a block), so they stream it during the kernel
    # before them (attention, a norm) instead of DEPTH groups a lane
    smem = [w for w in knocked if w.startswith("smem")]
    # "claimsN": the 1-row products (not the head) as q4_claim_gpu.py's kernel: one grid of N blocks an SM per
    # product, the warps claiming rows from a counter as they go, the row converted once a block
    claims = [w for w in knocked if w.startswith("claims")]
    if claims:
        from q4_claim_gpu import claim_linear
        quant_cuda.KERNELS["c"] = claim_linear(int(claims[0][6:]), engine=C_KERNEL)
    elif smem:
        from q4_smem_prefetch_gpu import smem_linear
        quant_cuda.KERNELS["c"] = smem_linear(*(int(v) for v in smem[0][4:].split("x")))
    else:
        quant_cuda.KERNELS["c"] = C_KERNEL
    # "deep": the products that take the partial sums keep 4 groups of weights in flight per lane (the whole row
    # of a K = 4096 product) instead of their tuned depth, to cover the prologue's wait for the partials
    quant_cuda.q4c_split_norm_linear = SPLIT_PRODUCT if "deep" not in knocked else (
        lambda *a, depth=None, **k: SPLIT_PRODUCT(*a, depth=max(depth or 0, 4), **k))
    if "addonly" in knocked:  # the adds in the epilogues, but no product takes the partial sums: norms apart
        ops._partials = lambda x, residual: None
    if "norm" in knocked:
        ops.add_rmsnorm = lambda x, residual, norm: (x, x if residual is None else residual)
        ops.norm_linear = lambda x, residual, norm, layer, out_dtype=None: (
            ops.linear(x, layer, out_dtype), x if residual is None else residual)
        ops.norm_mlp = lambda x, residual, norm, mlp: (ops.mlp(x, mlp), x if residual is None else residual)
    if "rope" in knocked:
        def qkv_to_cache(qkv, positions, rope, q_norm, k_norm, layer, meta, kv, num_heads, num_kv_heads, head_dim):
            shape = (qkv.shape[0], num_heads, head_dim)
            if shape not in bufs:
                bufs[shape] = torch.zeros(shape, dtype=qkv.dtype, device=qkv.device)
            return bufs[shape]
        ops.qkv_to_cache = qkv_to_cache
    if "attn" in knocked:
        model.backend.forward = lambda q, k, v, meta, scale, window=None: q


def build_step(layers: int | None, ctx0: int = 512):
    """The random 8B-shape int4 model at batch 1 with ctx0 cached tokens: (ctx0, copy bandwidth, model, floor ms,
    its Side, the ops install() swaps, a function replaying the step from side.graphs, which the caller sets)."""
    from quant_decode_gpu import int4_8b_model

    bw = G.copy_bandwidth(2.0)
    model, floor = int4_8b_model(layers, bw)
    side = G.make_side(model, 1, ctx0 + 64)
    originals = {n: getattr(model.ops, n) for n in ("add_rmsnorm", "qkv_to_cache", "norm_linear", "norm_mlp")}
    ids = torch.zeros(1, 1, dtype=torch.int64, device=G.DEV)
    ctx = torch.full((1,), ctx0, dtype=torch.int64, device=G.DEV)
    return ctx0, bw, model, floor, side, originals, lambda: side.graphs.run_uniform(ids, ctx, 1)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["variants"])
    ms = [res["variants"][n]["ms"] for n in names]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(names, ms, color="tab:blue")
    ax.axvline(res["floor_ms"], color="k", ls="--", label=f"weight-streaming floor {res['floor_ms']:.3f} ms")
    ax.axvline(res["floor_ms"] / 0.75, color="tab:red", ls=":", label="75 % of the floor")
    ax.set_xlabel("decode forward, batch 1 (ms)")
    ax.set_title("int4 8B-shape decode step: what each operation costs (knock-out)")
    ax.legend(loc="lower right", fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_step_budget.json")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke run)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default=None,
                    help="comma list of words: only the variants whose name holds one ('engine' always runs)")
    args = ap.parse_args()
    if args.variants:
        words = args.variants.split(",")
        for name in [n for n in VARIANTS if n != "engine" and not any(w in n for w in words)]:
            del VARIANTS[name]
    from quant_decode_gpu import model_bytes

    ctx0, bw, model, floor, side, originals, step = build_step(args.layers)
    runs: dict[str, list[float]] = {n: [] for n in VARIANTS}
    breakdown = {}
    for rep in range(args.repeats):
        for name, (knocked, splits, *cuda_attention) in VARIANTS.items():
            install(model, knocked, splits, originals, *cuda_attention)
            side.graphs = GraphRunner(side.runner, batch_sizes=[1], max_q_len=1)
            fn = step
            runs[name].append(G.bench_ms(fn, inner=20, outer=5))
            if rep == 0 and (name in ("engine", "products only") or cuda_attention):
                breakdown[name] = G.kernel_breakdown(fn)
            G.log(f"[{rep}] {name:28s} {runs[name][-1]:.4f} ms")
            del side.graphs
    install(model, (), None, originals)
    base = min(runs["engine"])
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, ctx=ctx0, copy_bw_bytes_per_s=bw,
               weight_bytes=model_bytes(model), floor_ms=floor, layers=model.config.num_layers,
               variants={n: dict(ms=min(t), runs=t, saves_ms=base - min(t), of_floor=floor / min(t))
                         for n, t in runs.items()},
               kernels=breakdown)
    print(f"\nint4 decode forward, batch 1, {ctx0} cached tokens; floor {floor:.3f} ms "
          f"({res['weight_bytes'] / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s); 75 % of it: {floor / 0.75:.3f} ms")
    print("| variant | ms | saves | % of floor |\n| --- | --- | --- | --- |")
    for n, v in res["variants"].items():
        print(f"| {n} | {v['ms']:.3f} | {v['saves_ms']:+.3f} | {100 * v['of_floor']:.1f} % |")
    for n, b in breakdown.items():
        cats = ", ".join(f"{c} {v['us']:.0f} us x{v['count']:.0f}" for c, v in b["categories"].items())
        print(f"kernels ({n}): {b['total_us']:.0f} us: {cats}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
