"""The int4 product's AMX path (cpu_q4.c, q4_gemm_amx) against its VNNI path on a CPU with AMX: the same bits,
how much time. Prints tables, writes JSON and a PNG plot.

    python benchmarks/amx_q4_cpu.py [--model qwen2.5-coder-1.5b-instruct] [--threads 2] [--repeats 5]
        [--rows 1,4,8,12,16,24,32,48,64,128,384] [--model-rows 16,29,64,128,384 | --model-rows ""]
        [--out benchmarks/results/amx_q4_cpu.json]

1. The product alone at the model's four decoder shapes (qkv, o, gate_up, down; random codes in the packed layout:
   the cost does not depend on the values), M activation rows, the two paths taking turns (best of --repeats).
2. The real model (GGUF int4, the default load): one forward of M new tokens after a 64-token prefix (a prefill
   chunk, or a verify tree of M nodes), logits of the last row (prefill) or of every row (verify), the paths taking
   turns; the logits compared bit for bit. (--model-rows "": part 1 alone, at the 1.5B's shapes, no model file.)

The switch point is cpu_q4.amx_min_rows (24 by default since session 45's kernel, the crossover measured on a 2-core
Xeon; 32 in session 43, where the tiles lost at 16-24 rows on a 16-core Xeon; 16 before).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def kernel_rows(shapes: dict, rows: list[int], threads: int, repeats: int) -> list[dict]:
    from forerun.kernels import cpu_q4

    out = []
    for name, (n, k) in shapes.items():
        g = torch.Generator().manual_seed(n + k)
        packed = cpu_q4.pack_weights(torch.randint(0, 16, (n, k), generator=g),
                                     torch.rand(n, k // 32, generator=g) * 1e-2, -torch.rand(n, k // 32, generator=g) * 5e-2)
        for m in rows:
            x = torch.randn(m, k, generator=g)
            res = {}
            for _ in range(2):  # taking turns: each path measured twice, best kept
                for path, switch in (("vnni", 0), ("amx", 1)):
                    cpu_q4.amx_min_rows(switch)
                    t = best_ms(lambda: cpu_q4.q4_matmul(x, packed, n, threads), repeats)
                    res[path] = min(res.get(path, t), t)
            cpu_q4.amx_min_rows(0)
            a = cpu_q4.q4_matmul(x, packed, n, threads)
            cpu_q4.amx_min_rows(1)
            same = torch.equal(a, cpu_q4.q4_matmul(x, packed, n, threads))
            row = {"shape": name, "n": n, "k": k, "rows": m, "vnni_ms": round(res["vnni"], 3),
                   "amx_ms": round(res["amx"], 3), "speedup": round(res["vnni"] / res["amx"], 3), "bit_identical": same}
            print(f"{name:8s} {n:6d} x {k:5d}  M={m:4d}  VNNI {res['vnni']:8.3f} ms  AMX {res['amx']:8.3f} ms  "
                  f"x{row['speedup']:.2f}  {'same bits' if same else 'DIFFERENT'}", flush=True)
            out.append(row)
    return out


def model_rows(model_name: str, rows: list[int], threads: int, repeats: int) -> tuple[list[dict], dict]:
    from forerun.config import CacheConfig
    from forerun.kernels import cpu_q4
    from forerun.models.registry import load_model
    from forerun.runtime.runner import Chunk, ModelRunner

    model, tok, _ = load_model(model_name, quantize="auto", progress=False)
    cfg = model.config
    shapes = {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size),
              "o": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
              "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size)}
    runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=64), "cpu", torch.float32)
    prefix = tok.encode("def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n" * 6)[:64]
    runner.kv.add_sequence(0)
    out = []
    with torch.inference_mode():
        runner.forward([Chunk(0, prefix, logits="last")])
        for m in rows:
            new = [(100 + 37 * i) % 150000 for i in range(m)]
            for logits in ("last", "all"):
                res, got = {}, {}
                for _ in range(2):
                    for path, switch in (("vnni", 0), ("amx", 1)):
                        cpu_q4.amx_min_rows(switch)

                        def fwd():
                            y = runner.forward([Chunk(0, new, logits=logits)])
                            runner.kv.truncate(0, len(prefix))
                            return y

                        t = best_ms(fwd, repeats)
                        res[path] = min(res.get(path, t), t)
                        got[path] = fwd()[0].logits
                same = torch.equal(got["vnni"], got["amx"])
                row = {"rows": m, "logits": logits, "vnni_ms": round(res["vnni"], 2), "amx_ms": round(res["amx"], 2),
                       "speedup": round(res["vnni"] / res["amx"], 3), "bit_identical": same}
                print(f"model M={m:4d} logits={logits:4s}  VNNI {res['vnni']:8.2f} ms  AMX {res['amx']:8.2f} ms  "
                      f"x{row['speedup']:.2f}  {'same logits' if same else 'DIFFERENT LOGITS'}", flush=True)
                out.append(row)
    return out, shapes


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["shape"] for r in res["kernel"]):
        pts = [r for r in res["kernel"] if r["shape"] == name]
        ax[0].plot([r["rows"] for r in pts], [r["speedup"] for r in pts], marker="o", label=f"{name} {pts[0]['n']}x{pts[0]['k']}")
    for logits in ("last", "all") if res["model"] else ():
        pts = [r for r in res["model"] if r["logits"] == logits]
        ax[1].plot([r["rows"] for r in pts], [r["speedup"] for r in pts], marker="o", label=f"logits={logits}")
    for a, title in zip(ax, ("product alone", f"{res['meta']['model']} forward of M new tokens")):
        a.axhline(1.0, color="grey", lw=0.8)
        a.set_xscale("log", base=2)
        a.set_xlabel("activation rows M")
        a.set_ylabel("VNNI time / AMX time")
        a.set_title(title)
        if a.get_lines():
            a.legend(fontsize=8)
    fig.suptitle(f"int4 product, AMX path vs VNNI path ({res['meta']['threads']} threads; same bits)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default="1,4,8,12,16,24,32,48,64,128,384")
    ap.add_argument("--model-rows", default="16,29,64,128,384")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/amx_q4_cpu.json"))
    a = ap.parse_args()
    from forerun.kernels import cbuild, cpu_q4

    if not cpu_q4.amx_ready():
        print("amx_q4_cpu.py: this machine has no AMX path (needs the avx512amx build and Linux's permission for "
              "tile data)", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    default_switch = cpu_q4.amx_min_rows()
    if a.model_rows:
        model, shapes = model_rows(a.model, [int(r) for r in a.model_rows.split(",")], a.threads, a.repeats)
    else:  # --model-rows "": the products alone, at the 1.5B's shapes (no model file needed)
        model, shapes = [], {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
    kernel = kernel_rows(shapes, [int(r) for r in a.rows.split(",")], a.threads, a.repeats)
    cpu_q4.amx_min_rows(default_switch)
    cpu = cbuild.cpu_name()
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "model": a.model, "threads": a.threads, "repeats": a.repeats, "cpu": cpu,
                    "c_kernels_isa": cbuild.isa(), "amx_min_rows_default": default_switch,
                    "loadavg_after": os.getloadavg()},
           "kernel": kernel, "model": model}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    plot(res, a.out.replace(".json", ".png"))
    print(f"wrote {a.out}")
    return 0 if all(r["bit_identical"] for r in kernel + model) else 1


if __name__ == "__main__":
    sys.exit(main())
