"""A persistent int4 decode kernel whose weight stream never waits for the activations (issue 12, session 51).

Session 23's persistent kernel (`q4_persistent_gpu.py`) ran the 145 chained 1-row products of the 8B-shape step in
one kernel with a grid barrier between products, and lost to one kernel per product with PDL (1.646 against
1.383 ms): at a barrier every warp stopped requesting weights, and only the first groups of its next rows could be
loaded into registers before it. The published decode megakernels keep the weight stream apart from the
dependency waits: weights do not depend on the activations, so they are copied into shared memory as far ahead as
there is room, and only the arithmetic waits. This benchmark measures that on the same chain:

  * every warp of a resident block (one block per SM) is its own copier and consumer, with a private ring of
    NSLOT "units" in shared memory; a unit is 128 groups of 32 codes of one output row (2048 bytes) with their
    128 scales and 128 offsets (256 bytes each): a row of a K = 4096 product, the gate or the up row of a SwiGLU
    output, a third of a K = 12288 (down) row. `cp.async` (16 bytes a lane) fills a slot, one commit group per
    unit; `cp.async.wait_group NSLOT-1` before the arithmetic of the oldest, and the slot is refilled with the
    warp's next unit as soon as it is read, whichever product that unit belongs to. So the copies run NSLOT units
    (SW x NSLOT x 2.5 KB per SM, up to ~200 KB) ahead of the arithmetic, across the grid barriers;
  * output rows are dealt to warps round-robin, the start rotated per product so that every warp's total over the
    chain differs by at most one row (DYN: claimed at run time instead, from 8 atomic counters per product, when a
    warp refills a slot; each slot records the (product, row) it holds for the arithmetic);
  * a grid barrier between products (an atomic counter, as session 23); after it each block converts the input row
    into pre-scaled f16 pairs in shared memory as q4_cuda.py does (XREG: and each lane then keeps its 4 groups of
    pairs in registers for the K = 4096 products); the per-warp arithmetic is q4_cuda.py's (its helpers reused),
    in the same order, so outputs equal the per-product kernels' bit for bit.

Knock-outs (wrong numbers, true times): KO=1 no grid barrier, KO=2 no arithmetic (copies and barriers only), KO=3
copies only, KO=4 the grid barriers alone. Then, for each knock-out configuration, timestamps per barrier and
block (%globaltimer, thread 0 at arrival and at release): how far apart the blocks arrive, and how long after the
last arrival each sees the count. Against the engine's kernels (q4_cuda.py, tuned table, PDL, one launch per
product), interleaved, CUDA graph replays. Prints a table, writes JSON + PNG.

    python benchmarks/q4_stream_gpu.py --out benchmarks/results/q4_stream_h200.json
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu as G  # noqa: E402
from forerun.kernels import nvrtc, q4_cuda  # noqa: E402
from q4_persistent_gpu import (KIND, build_chain, card, chain_bytes, engine_chain, finish, occupancy,  # noqa: E402
                               time_graphs)

UNIT_BYTES = 2560  # 128 groups: codes 2048 B, scales 256 B, offsets 256 B
NCLAIM = 8  # DYN: row counters per product
X_BYTES = 4 * 384 * 16 + 384 * 4  # the input row's f16 pairs and group sums, K up to 12288
_HELPERS = q4_cuda._SRC[: q4_cuda._SRC.index('extern "C"')]
_STREAM = r"""
#define SW {SW}        // warps per block, each its own copier and consumer
#define NSLOT {NSLOT}  // units in flight per warp
#define XREG {XREG}    // K = 4096 products: a lane's activation pairs in registers
#define KO {KO}        // knock-out: 1 no grid barrier, 2 no arithmetic, 3 copies only, 4 grid barriers only
#define TMA {TMA}      // 1: a unit is 3 bulk copies (the TMA unit, completion on an mbarrier per slot), 0: cp.async
#define DYN {DYN}      // 1: rows claimed at run time (NCLAIM atomic counters per product), 0: dealt round-robin
#define NCLAIM {NCLAIM}  // DYN: counter j hands out rows j, j + NCLAIM, ... (addresses 128 bytes apart)
#define UU 160         // uint4 per unit: 128 of codes, 16 of scales, 16 of offsets

struct SProd {{ const uint4* qw; const unsigned short* S; const unsigned short* Z; const uint4* x; unsigned short* y;
               long long meta; long long off; }};  // meta: n_out | kind << 32 (0: K 4096, 1: SwiGLU, 2: K 12288)

__device__ __forceinline__ int n_of(const SProd* P, int p) {{ return (int)(__ldg(&P[p].meta) & 0xffffffff); }}
__device__ __forceinline__ int kind_of(const SProd* P, int p) {{ return (int)(__ldg(&P[p].meta) >> 32); }}
__device__ __forceinline__ int units_of(int kind) {{ return kind == 0 ? 1 : (kind == 1 ? 2 : 3); }}
// warp gw takes rows n with (n + off_p) % tw == gw
__device__ __forceinline__ int first_row(const SProd* P, int p, int gw, int tw) {{
    const int off = (int)__ldg(&P[p].off);
    return ((gw - off) % tw + tw) % tw;
}}

struct Cur {{ int p, n, u; }};  // the next unit to copy: product, output row, unit of the row

#if DYN
// the next row of product p from this warp's counter (lane 0 asks, every lane gets it)
__device__ __forceinline__ int claim(unsigned int* claims, int p, int gw, int lane) {{
    const int j = gw % NCLAIM;
    int i = 0;
    if (lane == 0) i = (int)atomicAdd(claims + ((long)p * NCLAIM + j) * 32, 1u);
    return j + NCLAIM * __shfl_sync(0xffffffffu, i, 0);
}}
#define FIRST(p) claim(claims, (p), gw, lane)
#define NEXT(c) claim(claims, (c).p, gw, lane)
#else
#define FIRST(p) first_row(P, (p), gw, tw)
#define NEXT(c) ((c).n + tw)
#endif

__device__ __forceinline__ void settle(Cur& c, const SProd* P, int num, int gw, int tw, unsigned int* claims,
                                       int lane) {{
    while (c.p < num && c.n >= n_of(P, c.p)) {{
        if (++c.p < num) c.n = FIRST(c.p);
    }}
}}

__device__ __forceinline__ void advance(Cur& c, const SProd* P, int num, int gw, int tw, unsigned int* claims,
                                        int lane) {{
    if (c.p >= num) return;
    if (++c.u < units_of(kind_of(P, c.p))) return;
    c.u = 0;
    c.n = NEXT(c);
    settle(c, P, num, gw, tw, claims, lane);
}}

__device__ __forceinline__ void cp16(const void* dst, const void* src) {{
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
}}

__device__ __forceinline__ unsigned int sptr(const void* p) {{ return (unsigned int)__cvta_generic_to_shared(p); }}

__device__ __forceinline__ void bulk(const void* dst, const void* src, unsigned int bytes, unsigned long long* bar) {{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(sptr(dst)), "l"(src), "r"(bytes), "r"(sptr(bar)) : "memory");
}}

__device__ __forceinline__ void wait_parity(unsigned long long* bar, unsigned int parity) {{
    unsigned int ok = 0;
    while (!ok) {{
        asm volatile("{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }}"
                     : "=r"(ok) : "r"(sptr(bar)), "r"(parity) : "memory");
    }}
}}

// copy unit c into the slot (nothing once the chain is done); cp.async: one commit group either way
__device__ __forceinline__ void issue(const Cur& c, const SProd* P, int num, uint4* slot, unsigned long long* bar,
                                      int2* meta, int lane) {{
    if (lane == 0) *meta = make_int2(c.p < num ? c.p : num, c.n);  // what the slot will hold, for the consumer
    if (c.p < num) {{
        const int kind = kind_of(P, c.p), n_out = n_of(P, c.p);
        const long G = kind == 2 ? 384 : 128;
        const long row = (kind == 1 && c.u == 1) ? (long)c.n + n_out : (long)c.n;
        const long g0 = row * G + (kind == 2 ? 128 * c.u : 0);
        const uint4* qw = (const uint4*)__ldg((const long long*)&P[c.p].qw) + g0;
#if TMA
        if (lane == 0) {{
            const unsigned short* S = (const unsigned short*)__ldg((const long long*)&P[c.p].S) + g0;
            const unsigned short* Z = (const unsigned short*)__ldg((const long long*)&P[c.p].Z) + g0;
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // (the slot was just read)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                         :: "r"(sptr(bar)), "r"(2560) : "memory");
            bulk(slot, qw, 2048, bar);
            bulk(slot + 128, S, 256, bar);
            bulk(slot + 144, Z, 256, bar);
        }}
#else
        #pragma unroll
        for (int i = 0; i < 4; i++) cp16(slot + lane + 32 * i, qw + lane + 32 * i);
        const unsigned short* sz = (const unsigned short*)__ldg((const long long*)(lane < 16 ? (const void*)&P[c.p].S
                                                                                            : (const void*)&P[c.p].Z));
        cp16(slot + 128 + lane, (const uint4*)(sz + g0) + (lane & 15));
#endif
    }}
#if !TMA
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}}

__device__ __forceinline__ unsigned int ld_acquire(const unsigned int* p) {{
    unsigned int v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}}

__device__ __forceinline__ unsigned long long now_ns() {{
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}}

// ts (diagnostics, may be null): per barrier and block, the time thread 0 arrived and the time it saw the count
__device__ __forceinline__ void grid_sync(unsigned int* counter, unsigned int target, unsigned long long* ts) {{
    __syncthreads();
    if (threadIdx.x == 0) {{
        if (ts) ts[2 * blockIdx.x] = now_ns();
        __threadfence();
        atomicAdd(counter, 1u);
        long spins = 0;
        while (ld_acquire(counter) < target) {{
            if (++spins > (1L << 24)) __trap();  // a block that never arrives: fail instead of hanging
        }}
        if (ts) ts[2 * blockIdx.x + 1] = now_ns();
    }}
    __syncthreads();
}}

// the dot product of one unit's 4 groups per lane with the row's pairs, accumulated in q4_cuda.py's order
__device__ __forceinline__ float unit_dot(const uint4* slot, const uint4 (&xr)[4][4], const float (&xs)[4],
                                          int lane, float acc) {{
    const unsigned short* S = (const unsigned short*)(slot + 128);
    const unsigned short* Z = (const unsigned short*)(slot + 144);
    #pragma unroll
    for (int j = 0; j < 4; j++) {{
        const int g = lane + 32 * j;
        const uint4 w = slot[g];
        const float d = (h2sum(word_dot(w.x, xr[j][0], 0u)) + h2sum(word_dot(w.y, xr[j][1], 0u)))
                      + (h2sum(word_dot(w.z, xr[j][2], 0u)) + h2sum(word_dot(w.w, xr[j][3], 0u)));
        acc = fmaf(d, 16.0f * bf2f(S[g]), fmaf(bf2f(Z[g]), xs[j], acc));
    }}
    return acc;
}}

__device__ __forceinline__ void load_x(const uint4* xq, const float* gsum, int G, int gb, int lane,
                                       uint4 (&xr)[4][4], float (&xs)[4]) {{
    #pragma unroll
    for (int j = 0; j < 4; j++) {{
        const int g = gb + lane + 32 * j;
        #pragma unroll
        for (int c = 0; c < 4; c++) xr[j][c] = xq[c * G + g];
        xs[j] = gsum[g];
    }}
}}

extern "C" __global__ void __launch_bounds__(SW * 32, 1)
q4_stream(const SProd* __restrict__ P, int num, unsigned int* counter, unsigned long long* ts, unsigned int* claims)
{{
    extern __shared__ uint4 smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tw = gridDim.x * SW, gw = blockIdx.x * SW + warp;
    uint4* ring = smem + warp * (NSLOT * UU);
    uint4* xq = smem + SW * NSLOT * UU;  // [4][G]: pairs of word c of group g at xq[c * G + g]
    float* gsum = (float*)(xq + 4 * 384);
    unsigned long long* bars = (unsigned long long*)(gsum + 384) + warp * NSLOT;  // TMA: one per slot
    int2* smeta = (int2*)((unsigned long long*)(gsum + 384) + SW * NSLOT) + warp * NSLOT;  // (product, row) per slot
#if TMA
    if (lane == 0) {{
        #pragma unroll
        for (int s = 0; s < NSLOT; s++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sptr(bars + s)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }}
    __syncwarp();
#endif
    Cur cc = {{0, FIRST(0), 0}};
    settle(cc, P, num, gw, tw, claims, lane);
#if KO == 4
    for (int p = 1; p < num; p++) grid_sync(counter, (unsigned int)p * gridDim.x, ts ? ts + 2L * p * gridDim.x : ts);
    return;
#endif
    #pragma unroll
    for (int s = 0; s < NSLOT; s++) {{
        issue(cc, P, num, ring + s * UU, bars + s, smeta + s, lane);
        advance(cc, P, num, gw, tw, claims, lane);
    }}
    int slot = 0;
    unsigned int phase = 0;
    for (int p = 0; p < num; p++) {{
#if KO != 1 && KO != 3
        if (p > 0) grid_sync(counter, (unsigned int)p * gridDim.x, ts ? ts + 2L * p * gridDim.x : ts);
#endif
        const int kind = kind_of(P, p), n_out = n_of(P, p);
        const int G = kind == 2 ? 384 : 128;
        unsigned short* y = (unsigned short*)__ldg((const long long*)&P[p].y);
#if KO < 2
        const uint4* x = (const uint4*)__ldg((const long long*)&P[p].x);
        for (int i = threadIdx.x; i < 4 * G; i += SW * 32) {{  // G is a multiple of 32 / 4: whole warps
            const uint4 v = __ldcg(x + i);  // from L2: written by other SMs since the barrier
            float a0 = bf2f(v.x & 0xFFFF), a1 = bf2f(v.x >> 16), a2 = bf2f(v.y & 0xFFFF), a3 = bf2f(v.y >> 16);
            float a4 = bf2f(v.z & 0xFFFF), a5 = bf2f(v.z >> 16), a6 = bf2f(v.w & 0xFFFF), a7 = bf2f(v.w >> 16);
            store_word(xq, gsum, G, i, true, a0, a1, a2, a3, a4, a5, a6, a7);
        }}
        __syncthreads();
#endif
        uint4 xr[4][4];
        float xs[4];
#if XREG && KO < 2
        if (kind != 2) load_x(xq, gsum, G, 0, lane, xr, xs);
#endif
        while (true) {{  // the rows of product p in this warp's ring, in order
            __syncwarp();
            const int2 m = smeta[slot];
            if (m.x != p) break;
            const int n = m.y;
            float acc = 0.0f, acc2 = 0.0f;
            const int nu = units_of(kind);
            for (int u = 0; u < nu; u++) {{
#if TMA
                wait_parity(bars + slot, phase);
#else
                asm volatile("cp.async.wait_group %0;" :: "n"(NSLOT - 1) : "memory");
                __syncwarp();
#endif
#if KO < 2
                const uint4* su = ring + slot * UU;
                if (!XREG || kind == 2) load_x(xq, gsum, G, kind == 2 ? 128 * u : 0, lane, xr, xs);
                if (kind == 1 && u == 1) acc2 = unit_dot(su, xr, xs, lane, acc2);
                else acc = unit_dot(su, xr, xs, lane, acc);
#endif
                __syncwarp();
                issue(cc, P, num, ring + slot * UU, bars + slot, smeta + slot, lane);
                advance(cc, P, num, gw, tw, claims, lane);
                if (++slot == NSLOT) {{
                    slot = 0;
                    phase ^= 1u;
                }}
            }}
#if KO < 2
            acc = warp_sum(acc);
            if (kind == 1) {{
                acc2 = warp_sum(acc2);
                acc = acc / (1.0f + __expf(-acc)) * acc2;
            }}
            if (lane == 0) {{
                unsigned short b;
                asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(acc));
                y[n] = b;
            }}
#else
            if (lane == 0 && n < 0) y[n] = 0;  // (keeps the loop)
#endif
        }}
    }}
#if !TMA
    asm volatile("cp.async.wait_group 0;" ::: "memory");
#endif
}}
"""


def stream_source(sw: int, nslot: int, xreg: bool, ko: int = 0, tma: bool = False, dyn: bool = False) -> str:
    # K / R / WARPS / ... of the helpers' macros are unused here; set to valid values
    return (_HELPERS.format(K=4096, R=1, WARPS=sw, DEPTH=2, GLU=0, PDL=0, NORM=0, SPLIT=0, NP=1, ADD=0, DP4A=0)
            + _STREAM.format(SW=sw, NSLOT=nslot, XREG=int(xreg), KO=ko, TMA=int(tma), DYN=int(dyn), NCLAIM=NCLAIM))


def smem_bytes(sw: int, nslot: int) -> int:
    return sw * nslot * (UNIT_BYTES + 16) + X_BYTES  # + an mbarrier and a (product, row) per slot


def descriptors(prods, tw: int) -> torch.Tensor:
    """One SProd per product: pointers, n_out | kind << 32, and the rotation of its rows over the tw warps."""
    rows, off = [], 0
    for qw, s, z, x, y, glu in prods:
        n_out = y.shape[1]
        rows.append([qw.data_ptr(), s.data_ptr(), z.data_ptr(), x.data_ptr(), y.data_ptr(),
                     n_out | (KIND[(x.shape[1], glu)] << 32), off])
        off = (off + n_out) % tw
    return torch.tensor(rows, dtype=torch.int64, device="cuda")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_stream.json")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default="16x5x1x0x0,16x2x1x0x0,16x5x1x1x0,16x2x1x1x0,16x5x1x1x1,16x3x1x1x1",
                    help="warps x slots x XREG x TMA x DYN (rows claimed at run time), comma-separated")
    ap.add_argument("--knockouts", default="16x5x1x1x0,16x5x1x1x1", help="configs also run with KO = 1, 2, 3, 4")
    args = ap.parse_args()
    if (dev := card()) is None:
        return 1
    name, sms, bw, table = dev
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")

    def stream(prods, sw, nslot, xreg, tma, dyn=0, ko=0, ts=None):
        kern = nvrtc.kernel(stream_source(sw, nslot, xreg, ko, tma, dyn), "q4_stream")
        smem = smem_bytes(sw, nslot)
        kern.set_shared_memory_config(smem)
        occ = occupancy(kern, 32 * sw, smem)
        if occ < 1:
            raise RuntimeError(f"{sw} warps x {nslot} slots do not fit on an SM ({smem} B of shared memory)")
        desc = descriptors(prods, sms * sw)
        claims = torch.zeros(len(prods) * NCLAIM * 32, dtype=torch.int32, device="cuda")  # DYN, 128 B apart

        def run():
            counter.zero_()
            if dyn:
                claims.zero_()
            nvrtc.launch(kern, sms, 32 * sw, smem, [desc, len(prods), counter,
                                                    ctypes.c_void_p(0) if ts is None else ts, claims], False)
        return run

    parsed = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",") if c]
    kos = [tuple(int(v) for v in c.split("x")) for c in args.knockouts.split(",") if c]

    # correctness: one layer + the head, every stream config against the engine's per-product kernels
    h1, p1 = build_chain(1)
    engine_chain(h1, p1, table, write=True)()
    torch.cuda.synchronize()
    ref = [y.float().clone() for *_, y, _ in p1]
    checks = {}
    for sw, nslot, xreg, tma, dyn in parsed:
        for *_, y, _ in p1:
            y.zero_()
        stream(p1, sw, nslot, xreg, tma, dyn)()
        torch.cuda.synchronize()
        errs = [((y.float() - r).abs().max() / r.abs().max().clamp_min(1e-6)).item() for (*_, y, _), r in zip(p1, ref)]
        same = all(torch.equal(y.float(), r) for (*_, y, _), r in zip(p1, ref))
        checks[f"{sw}x{nslot}x{xreg}x{tma}x{dyn}"] = dict(rel_errs=errs, bit_identical=same)
        G.log(f"check {sw} warps x {nslot} slots, xreg {xreg}, tma {tma}, dyn {dyn}: bit-identical {same}, rel errs "
              f"{['%.1e' % e for e in errs]}")
        assert max(errs) < 2e-2, errs
    del p1

    h, prods = build_chain(args.layers)
    wbytes = chain_bytes(prods)
    floor = wbytes / bw * 1e3
    variants = {"CUDA C++, one kernel per product, PDL (engine)": engine_chain(h, prods, table)}
    for sw, nslot, xreg, tma, dyn in parsed:
        variants[f"stream, {sw} warps x {nslot} slots{', x in registers' if xreg else ''}, "
                 f"{'TMA' if tma else 'cp.async'}{', rows claimed' if dyn else ''}"] = \
            stream(prods, sw, nslot, xreg, tma, dyn)
    for sw, nslot, xreg, tma, dyn in kos:
        for ko, what in ((1, "no grid barrier"), (2, "no arithmetic"), (3, "copies only"), (4, "grid barriers only")):
            if ko == 4 and dyn:
                continue  # (the same barriers)
            variants[f"stream {sw}x{nslot}x{xreg}x{tma}x{dyn}, {what} (knock-out)"] = \
                stream(prods, sw, nslot, xreg, tma, dyn, ko)
    runs = time_graphs(variants, args.repeats, floor)
    # where a barrier's time goes: per barrier and block, when thread 0 arrived and when it saw the full count
    # (%globaltimer); spread = last arrival - first, lag = a block's release - the last arrival
    timing = {}
    ts = torch.zeros(len(prods), sms, 2, dtype=torch.int64, device="cuda")
    for sw, nslot, xreg, tma, dyn in kos:
        for ko, what in ((0, "full"), (2, "no arithmetic"), (4, "grid barriers only")):
            if ko == 4 and dyn:
                continue
            run = stream(prods, sw, nslot, xreg, tma, dyn, ko, ts=ts)
            for _ in range(3):
                ts.zero_()
                run()
            torch.cuda.synchronize()
            t = ts[1:].double()  # [barriers, blocks, 2] ns
            arrive, release = t[..., 0], t[..., 1]
            last = arrive.max(dim=1).values
            spread = (last - arrive.min(dim=1).values) / 1e3
            lag = (release - last[:, None]) / 1e3
            gap = (last[1:] - release.max(dim=1).values[:-1]) / 1e3  # last release -> next last arrival
            lasts = torch.bincount(arrive.argmax(dim=1), minlength=sms)
            timing[f"{sw}x{nslot}x{xreg}x{tma}x{dyn} {what}"] = dict(
                spread_us_median=spread.median().item(), spread_us_mean=spread.mean().item(),
                lag_us_median=lag.median().item(), lag_us_max_median=lag.max(dim=1).values.median().item(),
                product_us_mean=gap.mean().item(), most_often_last_block_share=lasts.max().item() / lasts.sum().item())
            G.log(f"barriers, {sw}x{nslot}x{xreg}x{tma}x{dyn} {what}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in timing[f"{sw}x{nslot}x{xreg}x{tma}x{dyn} {what}"].items()))
    res = dict(device=name, torch=torch.__version__, sms=sms, copy_bw_bytes_per_s=bw, layers=args.layers,
               products=len(prods), weight_bytes=wbytes, floor_ms=floor, checks=checks, barrier_timing=timing)
    finish(res, runs, args.out, f"{len(prods)} chained int4 decode products (8B shape, 1 row), {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
