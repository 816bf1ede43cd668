#!/usr/bin/env python
"""The 1-row int4 products' configurations re-chosen inside the decode step (#12).

`forerun/kernels/q4_configs.json` was tuned product by product, each timed alone in a CUDA graph. Inside the
decode step every kernel is launched early (PDL) and fetches its first `depth` groups of weights per lane before
it waits on the kernel before, so the best (rows per warp, warps, depth) there can differ. This times the random
Qwen3-8B-shape int4 decode step (batch 1, 512 cached tokens, graph replays) with one product's configuration
changed at a time, the tuned table between each candidate (the card's clocks drift), then every product's best
together against the table, interleaved. Prints a table, writes JSON (+ PNG) and, with --write, the winners into
this card's entry of q4_configs.json (only those that beat the table in the final comparison).

    python benchmarks/q4_step_configs_gpu.py --out benchmarks/results/q4_step_configs_h200.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu as G  # noqa: E402
from forerun.models import quant_cuda  # noqa: E402
from forerun.runtime.cuda_graph import GraphRunner  # noqa: E402

# product key -> candidate (rows per warp, warps, depth) besides the table's
CANDIDATES = {
    "m1_n6144_k4096": [(2, 16, 3), (2, 16, 4), (1, 16, 4), (2, 8, 4)],  # qkv
    "m1_n4096_k4096": [(2, 16, 4), (1, 8, 4), (2, 8, 4), (1, 16, 2)],  # o (and a 4096-row head)
    "m1_n12288_k4096_glu": [(1, 16, 3), (1, 16, 4), (2, 16, 2), (1, 8, 4)],  # gate/up + SwiGLU
    "m1_n4096_k12288": [(1, 16, 6), (1, 16, 8), (1, 16, 12), (2, 16, 4)],  # down
    "m1_n151936_k4096": [(2, 8, 4), (2, 16, 2), (4, 8, 2)],  # head
}
# --extra: blocks of rows that are not powers of two (3 rows a warp, 12 warps a block), e.g. qkv at 3 x 16 makes 128
# blocks (at most one an SM) where 2 x 16 makes 192 (60 SMs read two blocks' weights, 72 one)
EXTRA_CANDIDATES = {  # (those spilling or at 128 registers left out: nvcc -Xptxas -v)
    "m1_n6144_k4096": [(3, 16, 2), (3, 16, 3), (2, 12, 2), (2, 12, 3)],
    "m1_n4096_k4096": [(3, 16, 4), (2, 12, 4), (1, 12, 4)],
    "m1_n12288_k4096_glu": [(2, 12, 2), (1, 12, 2)],
    "m1_n4096_k12288": [(1, 12, 4), (1, 12, 6), (2, 12, 4)],
    "m1_n151936_k4096": [(1, 12, 4)],
}


def with_config(table: dict, key: str, rows: int, warps: int, depth: int) -> dict:
    t = copy.deepcopy(table)
    t[key] = dict(t[key], block_n=rows, num_warps=warps, num_stages=depth)
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_step_configs.json")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke run)")
    ap.add_argument("--final-repeats", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="write the winners into q4_configs.json")
    ap.add_argument("--extra", action="store_true", help="try EXTRA_CANDIDATES (not powers of two) instead")
    args = ap.parse_args()
    from quant_decode_gpu import int4_8b_model

    name = torch.cuda.get_device_name()
    base = json.loads(quant_cuda.CONFIGS.read_text()).get(name, {})
    if not all(base.get(k, {}).get("kernel") == "c" for k in CANDIDATES):
        print(f"{name}: the table's 1-row products are not all the CUDA C++ kernel; nothing to re-choose")
        return 1
    bw = G.copy_bandwidth(2.0)
    model, floor = int4_8b_model(args.layers, bw)
    side = G.make_side(model, 1, 512 + 64)
    ids = torch.zeros(1, 1, dtype=torch.int64, device=G.DEV)
    ctx = torch.full((1,), 512, dtype=torch.int64, device=G.DEV)

    ref = []

    def step_ms(table: dict) -> tuple[float, float]:
        """The step's time with these configurations, and its logits' max relative difference from the table's. A
        1-row product's arithmetic order does not depend on rows, warps or depth, so the logits are equal bit for
        bit, except where the norm is split across the products (the H100): there the number of blocks of the
        product before a norm is the number of partial sums of squares, added in order, so 1 / rms may differ in
        its last bits."""
        quant_cuda.set_configs(name, table)
        side.graphs = GraphRunner(side.runner, batch_sizes=[1], max_q_len=1)
        logits = side.graphs.run_uniform(ids, ctx, 1).float()
        if not ref:
            ref.append(logits)
        rel = ((logits - ref[0]).abs().max() / ref[0].abs().max()).item()
        if not rel <= (2e-2 if side.runner.model.ops.split_norms else 0.0):
            raise AssertionError(f"these configurations change the step's logits: max rel diff {rel:.2e}")
        ms = G.bench_ms(lambda: side.graphs.run_uniform(ids, ctx, 1), inner=20, outer=5)
        del side.graphs
        return ms, rel

    res = dict(device=name, torch=torch.__version__, floor_ms=floor, ctx=512, products={})
    best = {}
    for key, cands in (EXTRA_CANDIDATES if args.extra else CANDIDATES).items():
        cur = base[key]
        rows = []
        for rwd in [(cur["block_n"], cur["num_warps"], cur["num_stages"])] + cands:
            t_table = step_ms(base)[0]
            t, rel = step_ms(with_config(base, key, *rwd))
            rows.append(dict(rows=rwd[0], warps=rwd[1], depth=rwd[2], ms=t, table_ms=t_table, ratio=t / t_table,
                             logits_rel_diff=rel))
            G.log(f"{key} rows {rwd[0]} warps {rwd[1]} depth {rwd[2]}: {t:.4f} ms "
                  f"(table {t_table:.4f}: {t / t_table:.3f})")
        res["products"][key] = rows
        win = min(rows[1:], key=lambda r: r["ratio"])
        if win["ratio"] < min(1.0, rows[0]["ratio"]) - 0.003:
            best[key] = (win["rows"], win["warps"], win["depth"])
    chosen = base
    for key, rwd in best.items():
        chosen = with_config(chosen, key, *rwd)
    final = {"table": [], "chosen": []}
    for _ in range(args.final_repeats):
        final["table"].append(step_ms(base)[0])
        final["chosen"].append(step_ms(chosen)[0])
    quant_cuda.set_configs(name, base)
    res["chosen"] = {k: dict(rows=r, warps=w, depth=d) for k, (r, w, d) in best.items()}
    res["final"] = dict(table_ms=min(final["table"]), chosen_ms=min(final["chosen"]), runs=final,
                        table_of_floor=floor / min(final["table"]), chosen_of_floor=floor / min(final["chosen"]))
    print(f"\nint4 decode step, batch 1, 512 cached tokens; floor {floor:.3f} ms")
    print("| product | rows x warps x depth | step ms | / table |\n| --- | --- | --- | --- |")
    for key, rows in res["products"].items():
        for r in rows:
            print(f"| {key} | {r['rows']} x {r['warps']} x {r['depth']} | {r['ms']:.4f} | {r['ratio']:.3f} |")
    f = res["final"]
    print(f"table {f['table_ms']:.4f} ms ({100 * f['table_of_floor']:.1f} % of the floor), chosen {best}: "
          f"{f['chosen_ms']:.4f} ms ({100 * f['chosen_of_floor']:.1f} %)")
    if args.write and best and f["chosen_ms"] < f["table_ms"]:
        entries = {}
        for key, (r, w, d) in best.items():  # (its time alone and error were the old configuration's)
            entry = {f: v for f, v in base[key].items() if f not in ("us", "rel_err")}
            entries[key] = dict(entry, block_n=r, num_warps=w, num_stages=d,
                                step_tuned="benchmarks/results/" + os.path.basename(args.out))  # (where it is committed)
        quant_cuda.save_configs(name, entries)
        print(f"wrote {sorted(best)} into {quant_cuda.CONFIGS}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    plot(res, os.path.splitext(args.out)[0] + ".png")
    return 0


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, ratios = [], []
    for key, rows in res["products"].items():
        for r in rows:
            names.append(f"{key} {r['rows']}x{r['warps']}x{r['depth']}")
            ratios.append(r["ratio"])
    fig, ax = plt.subplots(figsize=(9, 0.25 * len(names) + 1.5))
    ax.barh(names, ratios, color=["tab:green" if x < 1 else "tab:grey" for x in ratios])
    ax.axvline(1.0, color="k", lw=1)
    ax.set_xlim(min(ratios) - 0.01, max(ratios) + 0.01)
    ax.set_xlabel("int4 decode step with this product's configuration / with the table's")
    ax.set_title(f"1-row int4 products re-chosen inside the step, {res['device']}")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
