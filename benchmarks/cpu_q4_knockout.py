"""Where the CPU int4 product's time goes at several activation rows, by knock-out (issue 12, session 49).

A copy of forerun/kernels/cpu_q4.c is built several times, each with one piece of the 512-bit VNNI inner loop
(`group_rows`) replaced by a cheaper stand-in: the float epilogue (`fold_dots`: convert the int32 dot products,
scale, offset), three of every four activation loads, the `vpdpbusd` dot products (an and + add instead), or all
three. The stand-ins give wrong numbers on purpose: only the times mean anything. All builds run interleaved in one process on
the same packed random weights (copies rotate so that no call finds its weights in cache), median ms per product.
Needs an AVX-512 VNNI CPU (the AVX2 build has another inner loop). Prints a table, writes JSON.

    python benchmarks/cpu_q4_knockout.py [--rows 1,4,8] [--shapes 1536x8960,17920x1536] [--threads 2]
                                         [--out benchmarks/results/cpu_q4_knockout.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_q4_ab import random_packs  # noqa: E402

# (text in fold_dots / group_rows, its knock-out form under #ifdef): the float epilogue, the activation loads, the dot products
EPILOGUE = ('''    const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
    acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(sw, xs), acc);
    return _mm512_fmadd_ps(ow, is, acc);''',
            '''#ifdef KO_EPI
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(acc), _mm512_add_epi32(d0, d1)));
#else
{orig}
#endif''')
DOTS = ('''                const int8_t *xa = xq + i * astride + c * 512;
                __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], _mm512_loadu_si512(xa));
                __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], _mm512_loadu_si512(xa + 64));
                for (int j = 1; j < 4; j++) {
                    d0 = _mm512_dpbusd_epi32(d0, lo[j], _mm512_loadu_si512(xa + 128 * j));
                    d1 = _mm512_dpbusd_epi32(d1, hi[j], _mm512_loadu_si512(xa + 128 * j + 64));
                }''',
        '''                const int8_t *xa = xq + i * astride + c * 512;
#ifdef KO_ACT
                const __m512i xa0 = _mm512_loadu_si512(xa), xa1 = _mm512_loadu_si512(xa + 64);
#define XL(o) ((o) & 64 ? xa1 : xa0)
#else
#define XL(o) _mm512_loadu_si512(xa + (o))
#endif
#ifdef KO_DP
#define DP(a, b, c) _mm512_add_epi32(a, _mm512_and_si512(b, c))
#else
#define DP(a, b, c) _mm512_dpbusd_epi32(a, b, c)
#endif
                __m512i d0 = DP(_mm512_setzero_si512(), lo[0], XL(0));
                __m512i d1 = DP(_mm512_setzero_si512(), hi[0], XL(64));
                for (int j = 1; j < 4; j++) {
                    d0 = DP(d0, lo[j], XL(128 * j));
                    d1 = DP(d1, hi[j], XL(128 * j + 64));
                }''')
VARIANTS = {"kernel": [], "no float epilogue": ["-DKO_EPI"], "1/4 of the activation loads": ["-DKO_ACT"],
            "no vpdpbusd": ["-DKO_DP"], "none of the three": ["-DKO_EPI", "-DKO_ACT", "-DKO_DP"]}


def knockout_source() -> str:
    src = (REPO / "forerun" / "kernels" / "cpu_q4.c").read_text()
    for orig, new in (EPILOGUE, DOTS):
        if src.count(orig) != 1:
            raise SystemExit("cpu_q4_knockout: group_rows changed; update this script's anchors")
        src = src.replace(orig, new.replace("{orig}", orig), 1)
    return src


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--shapes", default="1536x8960,17920x1536", help="N x K, comma list (1.5B down, gate/up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mb", type=float, default=100.0, help="weight megabytes per shape (copies rotate)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cpu_q4_knockout.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from forerun.kernels import cbuild, cpu_q4

    if cbuild.isa() not in ("avx512", "avx512amx"):
        print(f"cpu_q4_knockout: needs the AVX-512 VNNI build (this CPU builds {cbuild.isa()})", file=sys.stderr)
        return 2
    src = Path(tempfile.mkdtemp(prefix="cpu_q4_ko_")) / "cpu_q4.c"
    src.write_text(knockout_source())
    libs = {v: cbuild.library_for(src, cbuild.isa(), flags, cpu_q4._declare) for v, flags in VARIANTS.items()}
    if not all(libs.values()):
        print("cpu_q4_knockout: a build failed", file=sys.stderr)
        return 1
    names, results = list(libs), []
    print(f"{'N x K':>12} {'rows':>5} " + " ".join(f"{v[:14]:>14}" for v in names))
    for shape in a.shapes.split(","):
        n, k = (int(x) for x in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        packs = random_packs(n, k, a.mb, g)
        copies = len(packs)
        for m in (int(x) for x in a.rows.split(",")):
            xq, xs, isum = cpu_q4.quantize_activations_c(torch.randn(m, k, generator=g))
            y = torch.empty(m, n)
            times: dict[str, list[float]] = {v: [] for v in names}
            for it in range(4 * copies):  # the builds take turns going first; each call on another copy
                order = names[it % len(names):] + names[:it % len(names)]
                for j, v in enumerate(order):
                    pk = packs[(len(names) * it + j) % copies]
                    t = time.perf_counter()
                    libs[v].q4_gemm(pk.data_ptr(), n, k, xq.data_ptr(), xs.data_ptr(), isum.data_ptr(), m,
                                    y.data_ptr(), a.threads)
                    times[v].append(time.perf_counter() - t)
            med = {v: round(statistics.median(t) * 1e3, 4) for v, t in times.items()}
            results.append({"n": n, "k": k, "rows": m, "ms": med})
            print(f"{shape:>12} {m:>5} " + " ".join(f"{med[v]:>14.3f}" for v in names), flush=True)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "threads": a.threads, "isa": cbuild.isa(),
            "note": "knock-out builds give wrong numbers on purpose: times only"}
    Path(a.out).write_text(json.dumps({"meta": meta, "variants": {v: f for v, f in VARIANTS.items()},
                                       "results": results}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
