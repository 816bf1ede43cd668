"""Re-time every committed quantized-product configuration (forerun/kernels/q4_configs.json, this card's
entries: int4 and int8, 1..16 rows, the Qwen3-8B shapes) after a kernel change: each product checked against
x @ dequantized(W)^T and timed inside CUDA graphs over enough weight copies that L2 holds none, beside the time
committed with it (another run: clocks differ) and, with --against FILE, beside the same configuration run by an
earlier copy of forerun/kernels/quant_gemm.py in the same run (the A/B that counts). Prints a table, writes JSON.

    git show REV:forerun/kernels/quant_gemm.py > .carry/old_quant_gemm.py
    python benchmarks/quant_configs_check_gpu.py --against .carry/old_quant_gemm.py --out ...json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu as G  # noqa: E402
from quant_decode_gpu import SHAPES, graph_us  # noqa: E402
from forerun.kernels.quant_gemm import dequantize_int4, pack_int8_w32, quantize_int4, repack_int4_w32  # noqa: E402
from forerun.models import quant_cuda  # noqa: E402
from forerun.models.quant_cuda import config_key, q4_product, q8_product, quantize_int8_groups  # noqa: E402


def load_module(path: str):
    """An earlier quant_gemm.py as forerun.kernels._against (its relative imports resolve in forerun.kernels)."""
    spec = importlib.util.spec_from_file_location("forerun.kernels._against", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def product_with(mod, bits: int):
    """q4_product / q8_product, the kernels taken from module `mod` (None: the current ones)."""
    if mod is None:
        return q4_product if bits == 4 else q8_product
    kernels = {"v": mod.q4v_linear, "r": mod.q4r_linear, "t": mod.q4t_linear, "w": mod.q4w_linear,
               "w2": mod.q4w2_linear}

    def run(x, *weights_glu_cfg):
        *weights, glu, cfg = weights_glu_cfg
        cfg = dict(cfg)
        while x.shape[-1] % cfg["block_k"]:
            cfg["block_k"] //= 2
        kind = cfg.pop("kernel")
        if bits == 8:
            cfg.pop("use_dot", None)
            return mod.q8v_linear(x, *weights, glu=glu, **cfg)
        return kernels[kind](x, *weights, glu=glu, **cfg)
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/quant_configs_check.json")
    ap.add_argument("--against", default=None, help="an earlier quant_gemm.py to time beside the current one")
    ap.add_argument("--kernels", default="r,q8v", help="only configurations of these kernels ('all': every one)")
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    table = json.loads(quant_cuda.CONFIGS.read_text()).get(name, {})
    old = load_module(args.against) if args.against else None
    want = None if args.kernels == "all" else set(args.kernels.split(","))
    bw = G.copy_bandwidth(2.0)
    rows = []
    for shape, (n, k, glu) in SHAPES.items():
        nw = 2 * n if glu else n
        w = torch.randn(nw, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for bits in (4, 8):
            keys = [(m, config_key(m, n, k, glu, bits)) for m in (1, 2, 4, 8, 16)]
            keys = [(m, key) for m, key in keys if key in table and (want is None or table[key]["kernel"] in want)]
            if not keys:
                continue
            if bits == 4:
                qw, s, z = quantize_int4(w)
                weights = (repack_int4_w32(qw), s, z)
                wd = dequantize_int4(qw, s, z)
            else:
                q, s = quantize_int8_groups(w, torch.bfloat16)
                weights = (pack_int8_w32(q), s)
                wd = (q.float().reshape(nw, k // 32, 32) * s.float()[..., None]).reshape(nw, k)
            qbytes = sum(t.numel() * t.element_size() for t in weights)
            copies = [tuple(t.clone() for t in weights) for _ in range(max(2, min(24, int(3e8 // qbytes) + 1)))]
            for m, key in keys:
                cfg = {kk: v for kk, v in table[key].items()  # the kernel's arguments (not us / rel_err / notes)
                       if kk in ("kernel", "block_n", "block_k", "use_dot", "num_warps", "num_stages")}
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ wd.t()
                if glu:
                    ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
                row = dict(key=key, shape=shape, bits=bits, m=m, kernel=cfg["kernel"], committed_us=table[key].get("us"),
                           floor_us=(qbytes + x.numel() * 2 + m * n * 2) / bw * 1e6)
                for label, mod in (("now", None), ("against", old)) if old else (("now", None),):
                    run = product_with(mod, bits)
                    y = run(x, *weights, glu, cfg)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    assert err < 2e-2, (key, label, err)
                    row[f"{label}_us"] = graph_us([lambda c=c: run(x, *c, glu, cfg) for c in copies])
                    row[f"{label}_rel_err"] = err
                rows.append(row)
                G.log(f"{key:28s} {cfg['kernel']:4s} now {row['now_us']:7.1f} us"
                      + (f", against {row['against_us']:7.1f} ({row['now_us'] / row['against_us']:.3f}x)" if old
                         else "") + (f", committed {table[key]['us']:7.1f}" if "us" in table[key] else
                                     ", chosen inside the step (no time alone)"))
            del copies, weights, wd
            torch.cuda.empty_cache()
        del w
    print("\n| config | kernel | now | " + ("same run, earlier kernel | now / earlier | " if old else "")
          + "committed (earlier run) |\n| --- | --- | --- | " + ("--- | --- | " if old else "") + "--- |")
    for r in rows:
        mid = f"{r['against_us']:.1f} us | {r['now_us'] / r['against_us']:.3f} | " if old else ""
        committed = "-" if r["committed_us"] is None else f"{r['committed_us']:.1f} us"
        print(f"| {r['key']} | {r['kernel']} | {r['now_us']:.1f} us | {mid}{committed} |")
    with open(args.out, "w") as f:
        json.dump(dict(device=name, torch=torch.__version__, against=args.against, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
