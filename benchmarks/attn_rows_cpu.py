"""The CPU attention kernel alone (cpu_layer.c `attn_rows`): the scalar loop, one row at a time
(`attn_rows_blocked(0)`), against items of up to 16 rows sharing each tile of keys and values (session 43), in every
build of cpu_layer.c this CPU runs (AVX2, and AVX-512 where present: the AVX2 build stands in for AVX2-only CPUs).
Causal prefill rows ending at --keys keys (1 row: one decode step over them), the two modes taking turns, best of 2.
Prints a table, writes JSON and a PNG plot.

    python benchmarks/attn_rows_cpu.py [--threads 2] [--keys 2048] [--rows 1,512,2048]
        [--out benchmarks/results/attn_rows_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HEADS = {"Qwen2.5-1.5B (12 / 2 x 128)": (12, 2, 128), "Qwen2.5-0.5B (14 / 2 x 64)": (14, 2, 64)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keys", type=int, default=2048)
    ap.add_argument("--rows", default="1,512,2048")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/attn_rows_cpu.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from forerun.kernels import cbuild, cpu_layer

    src = Path(cpu_layer.__file__).with_name("cpu_layer.c")
    builds = [isa for isa in ("avx2", "avx512", "avx512amx") if cbuild.cpu_ok(cbuild.ISAS[isa][1])][:1]
    if cbuild.isa() and cbuild.isa() not in builds:
        builds.append(cbuild.isa())
    res = []
    print("| build | heads | rows | scalar ms | items of rows ms | speedup |\n| --- | --- | --- | --- | --- | --- |")
    for isa in builds:
        lib = cbuild.library_for(src, isa, ["-ffp-contract=off"], cpu_layer._declare)
        g = torch.Generator().manual_seed(0)
        for name, (hq, hkv, d) in HEADS.items():
            for t in [int(r) for r in a.rows.split(",")]:
                s = a.keys
                kf, vf = torch.randn(s, hkv, d, generator=g), torch.randn(s, hkv, d, generator=g)
                q = torch.randn(t, hq, d, generator=g) * d ** -0.5
                lens = torch.tensor([s - t + i + 1 for i in range(t)], dtype=torch.int64)
                off, keys = torch.zeros(t, dtype=torch.int64), torch.arange(s, dtype=torch.int64)
                out, best = torch.empty_like(q), {}

                def run():
                    lib.attn_rows(q.data_ptr(), kf.data_ptr(), vf.data_ptr(), keys.data_ptr(), off.data_ptr(),
                                  lens.data_ptr(), out.data_ptr(), t, hq, hkv, d, s)
                for _ in range(2):
                    for mode in (0, 1):
                        lib.attn_rows_blocked(mode)
                        run()
                        t0 = time.perf_counter()
                        run()
                        run()
                        best[mode] = min(best.get(mode, 9e9), (time.perf_counter() - t0) / 2)
                lib.attn_rows_blocked(1)
                row = {"build": isa, "heads": name, "rows": t, "keys_last_row": s,
                       "scalar_ms": round(best[0] * 1e3, 2), "items_ms": round(best[1] * 1e3, 2),
                       "speedup": round(best[0] / best[1], 2)}
                res.append(row)
                print(f"| {isa} | {name} | {t} | {row['scalar_ms']} | {row['items_ms']} | {row['speedup']}x |",
                      flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"threads": a.threads, "keys": a.keys, "rows": res}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['build']}\n{r['heads'].split(' ')[0]}\n{r['rows']} rows" for r in res]
    ax.bar(range(len(res)), [r["speedup"] for r in res], color="tab:green")
    ax.set_xticks(range(len(res)), labels, fontsize=6)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("scalar time / items time")
    ax.set_title(f"CPU attention, {a.threads} threads, rows ending at {a.keys} keys", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.splitext(a.out)[0] + ".png", dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
