"""What the int4 product's pieces cost on a CPU with AMX: tile instructions, the bit-exact float work per group, and
a bf16 alternative's weight conversion. Prints a table, writes JSON and a PNG plot.

    python benchmarks/amx_tile_ops.py [--out benchmarks/results/amx_tile_ops.json]

Why (docs/performance.md, session 45): cpu_q4.c's AMX path gives every output the VNNI kernel's bits, so each
group of 32 weights needs its own int32 tile product (K = 32: half a tile's depth), a tile store, and per activation
row a convert and two multiply-adds with that group's scales. This times each piece alone, one thread, data in L1
(thread CPU time, best of 5, so a busy machine skews it little), and for comparison the VNNI instruction, the bf16
tile product (TDPBF16PS, K = 32 bf16 pairs) and the conversion a bf16 recipe would do per weight for every token
(4-bit code -> bf16 of scale * code + offset): the cost that recipe adds to a one-row decode.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

C_SRC = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static double now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int8_t A[64][1024] __attribute__((aligned(64)));
static uint8_t B[64][1024] __attribute__((aligned(64)));
static int32_t C[8][256] __attribute__((aligned(64)));
static float xs[64][16] __attribute__((aligned(64))), is[64][16] __attribute__((aligned(64)));
static uint8_t codes[64][256] __attribute__((aligned(64)));
static uint16_t bfo[64][512] __attribute__((aligned(64)));
#define N 100000
#define TIME(name, per, ...) do { double best = 1e9; for (int tr = 0; tr < 5; tr++) { double t0 = now(); \
    for (int i = 0; i < N; i++) { __VA_ARGS__ } double d = (now() - t0) / N * 1e9; if (d < best) best = d; } \
    printf("%s\t%.3f\t%d\n", name, best, per); } while (0)
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) { printf("no-amx\n"); return 2; }
    cfg_t c; memset(&c, 0, sizeof c); c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = t >= 6 ? 8 : 16; c.colsb[t] = (t == 4 || t == 5) ? 32 : 64; }
    _tile_loadconfig(&c);
    for (int i = 0; i < 64; i++) for (int j = 0; j < 16; j++) { xs[i][j] = 0.01f * (j + 1); is[i][j] = 0.5f; }
    for (int i = 0; i < 64; i++) for (int j = 0; j < 256; j++) codes[i][j] = (uint8_t)(i * 7 + j);
    // name \t ns per iteration \t multiply-adds per iteration (0: not a product)
    TIME("int8 tile product, K=32 (TDPBSUD)", 8192, _tile_dpbsud(0, 4, 6););
    TIME("tile store of a 16x16 int32 result", 0, _tile_stored(0, C[i & 7], 64););
    TIME("one group for 16 rows x 16 outputs: load A, B, zero, product, store", 8192,
         _tile_loadd(4, A[i & 63], 32); _tile_loadd(6, B[i & 63], 64); _tile_zero(0); _tile_dpbsud(0, 4, 6);
         _tile_stored(0, C[0], 64););
    {   // the VNNI kernel's float work on one group's 16 x 16 dot products (q4_gemm_amx's per-group loop)
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        const __m512 s = _mm512_set1_ps(0.5f), o = _mm512_set1_ps(-0.25f);
        TIME("floats of one group, 16 rows (cvt, mul, 2 fma a row)", 0,
             const int32_t *cb = C[i & 7]; const float *x = xs[i & 63], *u = is[i & 63];
             for (int r = 0; r < 16; r++) {
                 const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * r));
                 acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(x[r])), acc[r]);
                 acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(u[r]), acc[r]);
             });
        float sink = 0; for (int r = 0; r < 16; r++) sink += _mm512_reduce_add_ps(acc[r]);
        if (sink == 1234.5f) printf("#\n");
    }
    {   // VNNI: 8 independent chains of vpdpbusd (64 multiply-adds each)
        __m512i d[8]; for (int r = 0; r < 8; r++) d[r] = _mm512_set1_epi32(r);
        const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
        TIME("8 x vpdpbusd (AVX512-VNNI)", 512, for (int r = 0; r < 8; r++) d[r] = _mm512_dpbusd_epi32(d[r], a, b);
             __asm__ volatile("" : "+v"(d[0]), "+v"(d[1]), "+v"(d[2]), "+v"(d[3]), "+v"(d[4]), "+v"(d[5]), "+v"(d[6]), "+v"(d[7])););
        int sink = 0; for (int r = 0; r < 8; r++) sink += _mm512_reduce_add_epi32(d[r]);
        if (sink == 12345) printf("#\n");
    }
#ifdef __AMX_BF16__
    c.colsb[4] = 64;  // A: 16 rows x 32 bf16; B: 16 rows (pairs) x 16 outputs x 2 bf16
    c.rows[6] = 16;
    _tile_loadconfig(&c);
    TIME("bf16 tile product, K=32 (TDPBF16PS)", 8192, _tile_dpbf16ps(0, 4, 6););
#endif
#ifdef __AVX512BF16__
    {   // 512 weights (one group x 16 outputs) from 4-bit codes to bf16 of scale * code + offset, tile (pair) order
        const __m512 s = _mm512_set1_ps(0.01f), o = _mm512_set1_ps(-0.08f);
        const __m512i low = _mm512_set1_epi32(15);
        TIME("4-bit -> bf16 (scale * code + offset), 512 weights", 0,
             const uint8_t *p = codes[i & 63]; uint16_t *q = bfo[i & 63];
             for (int r = 0; r < 16; r++) {
                 const __m512i d = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(p + 16 * r)));
                 const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(d, low)), s, o);
                 const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4)), s, o);
                 _mm512_store_si512(q + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(_mm512_unpackhi_ps(lo, hi), _mm512_unpacklo_ps(lo, hi)));
             });
    }
#endif
    _tile_release();
    return 0;
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/amx_tile_ops.json"))
    a = ap.parse_args()
    from forerun.kernels import cbuild

    if shutil.which("gcc") is None or not cbuild.cpu_ok(("amx_tile", "amx_int8", "avx512_vnni")):
        print("amx_tile_ops.py: needs gcc and a CPU with AMX-INT8 and AVX512-VNNI", file=sys.stderr)
        return 2
    flags = ["-O2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile", "-mamx-int8"]
    if cbuild.cpu_ok(("amx_bf16",)):
        flags.append("-mamx-bf16")
    if cbuild.cpu_ok(("avx512_bf16",)):
        flags.append("-mavx512bf16")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "ops.c", Path(tmp) / "ops"
        src.write_text(C_SRC)
        subprocess.run(["gcc", *flags, str(src), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe)], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"amx_tile_ops.py: {out.stdout.strip() or out.stderr.strip()} (Linux refused the tile registers?)",
              file=sys.stderr)
        return 2
    rows = []
    for line in out.stdout.splitlines():
        name, ns, macs = line.split("\t")
        ns, macs = float(ns), int(macs)
        rows.append({"op": name, "ns": ns, "macs": macs, "macs_per_ns": round(macs / ns, 1) if macs else None})
    print(f"{'operation (one thread, data in L1)':72s} {'ns':>8s} {'MAC/ns':>8s}")
    for r in rows:
        print(f"{r['op']:72s} {r['ns']:8.2f} {r['macs_per_ns'] or '':>8}")
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "cpu": cbuild.cpu_name(), "flags": flags, "clock": "CLOCK_THREAD_CPUTIME_ID, best of 5"},
           "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.barh([r["op"] for r in rows][::-1], [r["ns"] for r in rows][::-1], color="tab:blue")
    ax.set_xlabel("ns per operation (one thread)")
    ax.set_title(f"int4 product pieces on {res['meta']['cpu']}", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(a.out.replace(".json", ".png"), dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
