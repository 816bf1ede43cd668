"""Is the int4 decode product (q4v, #12) slowed by converting its activations? Each program of `_q4v_kernel`
converts the whole bf16 activation row into the pre-scaled f16 pairs of its PTX block and sums its groups, so a
qkv product (1536 programs of 4 rows) converts the row 1536 times. This times, at the Qwen3-8B shapes and 1 row,
the engine's kernel (its committed configuration) against the same kernel fed pairs and group sums made once
beforehand (`x_pairs_f16`; XPRE), over a small configuration grid, inside CUDA graphs over enough weight copies
that L2 holds none. The one-off conversion is not timed: it stands for a producer that writes pairs. Also dumps
the PTX / SASS instruction mix of both kernels. Prints a table, writes JSON (+ the asm as text files).

    python benchmarks/q4v_xprep_gpu.py --out benchmarks/results/q4v_xprep_h200.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

import torch
import triton

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu as G  # noqa: E402
from quant_decode_gpu import SHAPES, graph_us  # noqa: E402
from forerun.kernels.quant_gemm import (_q4v_kernel, dequantize_int4, q4v_linear, quantize_int4,  # noqa: E402
                                        repack_int4_w32, x_pairs_f16)
from forerun.models import quant_cuda  # noqa: E402


def launch(x, pairs, q32, s, z, glu, cfg):
    return q4v_linear(x, q32, s, z, glu=glu, block_n=cfg["block_n"], block_k=cfg["block_k"],
                      num_warps=cfg["num_warps"], x_pairs=pairs)


def compiled(x, pairs, q32, s, z, cfg):
    """The compiled `_q4v_kernel` of a 1-row product without SwiGLU (launched directly, as q4v_linear does, for
    the CompiledKernel it returns: its PTX and machine code)."""
    n, k = q32.shape[0], x.shape[1]
    y = torch.empty(1, n, dtype=torch.bfloat16, device=x.device)
    xin, xs = pairs if pairs is not None else (x, x)
    return _q4v_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        xin, q32, s, z, y, n, k, n, n, xs, K=k, M=1, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], GLU=False,
        GROUP=32, PDL=False, XPRE=pairs is not None, num_warps=cfg["num_warps"], num_stages=2)


def mix(asm: str, sass: bool) -> dict:
    """Instruction counts by opcode (PTX: the first token of each instruction line; SASS: the opcode column)."""
    c: collections.Counter = collections.Counter()
    for line in asm.splitlines():
        if sass:
            m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?P\d\s+)?([A-Z][A-Z0-9_.]+)", line)
        else:
            m = re.match(r"\s+(@%p\d+\s+)?([a-z][a-z0-9_.]+)", line)
        if m:
            c[m.group(2).split(".")[0]] += 1
    return dict(c.most_common())


def dump(ck, path: str) -> dict:
    text = {"ttgir": ck.asm.get("ttgir", ""), "ptx": ck.asm.get("ptx", "")}
    sass = ""
    try:
        from triton.tools.disasm import get_sass

        sass = get_sass(ck.asm["cubin"])
    except Exception as e:  # no cuobjdump
        sass = f"(no sass: {e!r})"
    with open(path, "w") as f:
        for key in ("ttgir", "ptx"):
            f.write(f"==== {key}\n{text[key]}\n")
        f.write(f"==== sass\n{sass}\n")
    return dict(regs=getattr(ck, "n_regs", None), spills=getattr(ck, "n_spills", None),
                ptx_mix=mix(text["ptx"], False), sass_mix=mix(sass, True) if sass.startswith("\n") or "/*0" in sass
                else {}, sass_lines=sass.count("\n"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4v_xprep.json")
    args = ap.parse_args()
    outdir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(outdir, exist_ok=True)
    bw = G.copy_bandwidth(2.0)
    name = torch.cuda.get_device_name()
    table = json.loads(quant_cuda.CONFIGS.read_text()).get(name, {})
    rows, asm = [], {}
    grid = [dict(block_n=bn, block_k=4096, num_warps=nw) for bn in (2, 4, 8, 16) for nw in (2, 4, 8)]
    for shape, (n, k, glu) in SHAPES.items():
        nw_ = 2 * n if glu else n
        w = torch.randn(nw_, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, s, z = quantize_int4(w)
        q32 = repack_int4_w32(qw)
        wd = dequantize_int4(qw, s, z)
        del w, qw
        qbytes = q32.numel() * 4 + s.numel() * 2 + z.numel() * 2
        copies = max(2, min(24, int(3e8 // qbytes) + 1))
        Q = [(q32.clone(), s.clone(), z.clone()) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        xp, xs = x_pairs_f16(x)
        ref = x.float() @ wd.t()
        if glu:
            ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
        floor = (qbytes + k * 2 + n * 2) / bw * 1e6
        key = quant_cuda.config_key(1, n, k, glu)
        base_cfg = {kk: table[key][kk] for kk in ("block_n", "block_k", "num_warps")}
        y0 = launch(x, None, q32, s, z, glu, base_cfg)
        err0 = ((y0.float() - ref).abs().max() / ref.abs().max()).item()
        base_us = graph_us([lambda c=c: launch(x, None, *c, glu, base_cfg) for c in Q])
        best = None
        for cfg in grid:
            if k % cfg["block_k"]:
                continue
            y = launch(x, (xp, xs), q32, s, z, glu, cfg)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            same = ((y.float() - y0.float()).abs().max() / ref.abs().max()).item()
            if err > 2e-2:
                G.log(f"{shape} {cfg}: rel err {err:.2e}: refused")
                continue
            us = graph_us([lambda c=c, cfg=cfg: launch(x, (xp, xs), *c, glu, cfg) for c in Q])
            if best is None or us < best["us"]:
                best = dict(cfg, us=us, rel_err=err, vs_engine=same)
        row = dict(shape=shape, n=n, k=k, glu=glu, floor_us=floor, engine_cfg=base_cfg, engine_us=base_us,
                   engine_of_floor=floor / base_us, engine_rel_err=err0,
                   pre=best, pre_of_floor=floor / best["us"])
        rows.append(row)
        G.log(f"{shape:8s}: engine {base_us:6.2f} us ({100 * floor / base_us:5.1f} %), pre-converted "
              f"{best['us']:6.2f} us ({100 * floor / best['us']:5.1f} %) {best['block_n']}x{best['num_warps']}w, "
              f"err {best['rel_err']:.1e}, vs engine {best['vs_engine']:.1e}")
        if shape == "qkv":
            for label, cfg, pairs in (("engine", base_cfg, None), ("pre", best, (xp, xs))):
                asm[label] = dump(compiled(x, pairs, q32, s, z, cfg), os.path.join(outdir, f"q4v_asm_{label}.txt"))
        del Q, q32, s, z, wd
        torch.cuda.empty_cache()
    # the whole step's products at 1 row (once per layer x 36 + head), from the rows above
    per_layer = ("qkv", "o", "gate_up", "down")
    tot = {kk: 36 * sum(r[kk] for r in rows if r["shape"] in per_layer) + sum(r[kk] for r in rows
                                                                              if r["shape"] == "head")
           for kk in ("engine_us", "floor_us")}
    tot["pre_us"] = 36 * sum(r["pre"]["us"] for r in rows if r["shape"] in per_layer) + \
        sum(r["pre"]["us"] for r in rows if r["shape"] == "head")
    res = dict(device=name, torch=torch.__version__, triton=triton.__version__, copy_bw_bytes_per_s=bw, rows=rows,
               step_products=tot, asm=asm)
    print("\n| product (1 row) | floor | engine | pre-converted activations |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['floor_us']:.1f} us | {r['engine_us']:.1f} ({100 * r['engine_of_floor']:.0f} %) "
              f"| {r['pre']['us']:.1f} ({100 * r['pre_of_floor']:.0f} %) |")
    print(f"| 36 layers + head | {tot['floor_us'] / 1e3:.3f} ms | {tot['engine_us'] / 1e3:.3f} "
          f"({100 * tot['floor_us'] / tot['engine_us']:.0f} %) | {tot['pre_us'] / 1e3:.3f} "
          f"({100 * tot['floor_us'] / tot['pre_us']:.0f} %) |")
    for kk, v in asm.items():
        print(f"{kk}: regs {v['regs']} spills {v['spills']}; ptx {sum(v['ptx_mix'].values())} "
              f"{list(v['ptx_mix'].items())[:14]}; sass {sum(v['sass_mix'].values())} {list(v['sass_mix'].items())[:14]}")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
