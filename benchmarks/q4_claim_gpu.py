"""The 1-row int4 product as one persistent grid per product whose warps claim their rows as they go (issue 12,
session 53).

Session 52's block timestamps (q4_block_timing_h100_s52.json) put the chain's loss in the products' hand-overs and
tails: gate/up + SwiGLU runs 768 blocks, 5.8 an SM in waves, and every block converts the activation row again
before its dot products (0.6 us); down converts a 12288-wide row in each of its 256 blocks (1.7 us). Session 51's
persistent kernel for the whole chain (q4_stream_gpu.py) lost at its software grid barriers, and its rows claimed
at run time were claimed a ring (2-5 rows) ahead of their arithmetic, so the balance came too early.

This kernel keeps one launch per product (PDL's hardware hand-over between products) and changes how a product's
rows meet the SMs: a grid of BLOCKS_PER_SM x SMs blocks (never more than the rows need), each converting the row
once; a warp takes its first chunk of CH rows from its place in the grid, then claims the next chunks one at a time
from a counter in global memory (a claim is issued when the warp enters a chunk and answered when it reaches the
chunk's last row, where that row's last DEPTH groups refill the ring with the next chunk's first), so the warps of
all SMs finish within about one chunk of each other whatever share of the bandwidth each SM gets. The last warp to
finish resets the counter (a second counter counts the warps done), so CUDA graph replays need no memset. With one
block an SM, the next product's blocks fit beside it from the start and request their first weights while this
one streams. Per row the arithmetic is the engine's (q4_cuda.py): same lanes, same order, same epilogue, so
outputs are bit-identical (checked, also after the timed replays). "static" variants deal the chunks round-robin
instead (no counter): the knock-out that says what the claims buy.

Session 53 on the H100: the first build claimed with an integer atomicAdd, which ptxas aggregates across the warp
and whose answer it shuffles right after the atomic (the warp waits the round trip at every claim): 2.40-2.85 ms
for the chain against the engine's 1.79 (round-robin 1.84-1.90; q4_claim_*_h100_s53_intatomic.json). Claims are
now float adds, which ptxas leaves alone (see `claim` in the source): measured at 2.56-3.48 ms, worse, and the
round-robin variants of this build 2.00-2.13 (q4_claim_f32_h100_s53.json). Dropped; kept as the record.

One row a unit, 16 warps a block, 4 groups in flight per lane (2 per row for SwiGLU): at 64 registers (two blocks an
SM) the table's 2-row, 4-deep configurations spill (nvcc). The head keeps the engine's kernel. Prints a table,
writes JSON + PNG.

    python benchmarks/q4_claim_gpu.py --out benchmarks/results/q4_claim_h200.json
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu as G  # noqa: E402
from forerun.kernels import nvrtc, q4_cuda  # noqa: E402
from q4_persistent_gpu import V, build_chain, c_config, card, chain_bytes, engine_chain, finish, time_graphs  # noqa: E402

_HELPERS = q4_cuda._SRC[: q4_cuda._SRC.index('extern "C"')]
_CLAIM = r"""
#define KK {KK}
#define GG (KK / 32)
#define NJJ ((GG + 31) / 32)   // groups a lane takes per row
#define RW {RW}                // rows a unit (a warp's rows at a time)
#define NWARP {NWARP}
#define DEP {DEP}              // groups in flight per lane and row; divides NJJ (the ring wraps onto the next unit)
#define SGLU {SGLU}
#define DYN {DYN}              // 1: chunks claimed from ctr[0]; 0: dealt round-robin
#define CH {CH}                // units a chunk (a claim)
#define MINB {MINB}            // blocks an SM the registers must leave room for (this one and the next product's)
#define NWR (SGLU ? 2 * RW : RW)
#define TT ((4 * GG + NWARP * 32 - 1) / (NWARP * 32))

// the weight rows of unit u (RW output rows; SGLU: then their up rows), as offsets in groups; rows past n_out read
// row 0 (not stored)
__device__ __forceinline__ void unit_rows(int* ro, int u, int n_out, int glu_off) {{
    #pragma unroll
    for (int r = 0; r < NWR; r++) {{
        int n = u * RW + (r % RW);
        n = n < n_out ? n : 0;
        ro[r] = (r < RW ? n : n + glu_off) * GG;  // (< 2^31 for every product here: checked in Python)
    }}
}}

// one claim: the counter (a float: whole numbers are exact up to 2^24) plus 1, its old value returned as a float
// and converted only where it is used, a chunk later. Why not atomicAdd on an unsigned int: ptxas aggregates
// integer atomics across the warp, and its aggregated form broadcasts the answer with a shuffle right after the
// atomic, which stalls the warp for the whole round trip at every claim (the SASS; the first H100 run, 2.5 ms
// against 1.8); a float add it leaves alone (its order would change sums).
__device__ __forceinline__ float claim(unsigned int* p) {{
    float r;
    asm volatile("atom.global.add.f32 %0, [%1], 0f3F800000;" : "=f"(r) : "l"(p));
    return r;
}}

extern "C" __global__ void __launch_bounds__(NWARP * 32, MINB)
q4d_gemv(const uint4* __restrict__ x, const uint4* __restrict__ qw, const unsigned short* __restrict__ S,
         const unsigned short* __restrict__ Z, unsigned short* __restrict__ y, int n_out, int glu_off,
         unsigned int* __restrict__ ctr)
{{
    extern __shared__ uint4 smem[];
    uint4* xq = smem;
    float* gsum = (float*)(smem + 4 * GG);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_units = (n_out + RW - 1) / RW, nwarps = gridDim.x * NWARP;
    // chunks of CH consecutive units: the first the warp's place in the grid, the next ones claimed (or dealt)
    int cur = (blockIdx.x * NWARP + warp) * CH, cend = min(cur + CH, n_units), nxt = n_units, nend = n_units;
    int ro[NWR], rn[NWR];
    unit_rows(ro, cur, n_out, glu_off);
    uint4 wbuf[DEP][NWR];
    unsigned short sbuf[DEP][NWR], zbuf[DEP][NWR];
    if (cur < n_units) {{
        #pragma unroll
        for (int j = 0; j < DEP; j++) {{
            const int g = lane + 32 * j;
            if (g < GG) {{
                #pragma unroll
                for (int r = 0; r < NWR; r++) {{
                    wbuf[j][r] = __ldg(qw + ro[r] + g);
                    sbuf[j][r] = __ldg(S + ro[r] + g);
                    zbuf[j][r] = __ldg(Z + ro[r] + g);
                }}
            }}
        }}
    }}
#if DYN
    float cl = 0.0f;  // lane 0: the claim in flight (the chunk after the current one is nwarps + cl)
    if (lane == 0 && cur < n_units) cl = claim(ctr);
#endif
    // nxt, nend <- the unit after cur and the end of its chunk: cur + 1 within the chunk, else the claimed chunk's
    // first unit (answering the claim in flight, a chunk old, and issuing the next one)
#if DYN
#define ADVANCE() do {{ if (cur + 1 < cend) {{ nxt = cur + 1; nend = cend; }} else {{ \
        nxt = (nwarps + (int)__shfl_sync(0xffffffffu, cl, 0)) * CH; nend = min(nxt + CH, n_units); \
        if (lane == 0 && nxt < n_units) cl = claim(ctr); }} }} while (0)
#else
#define ADVANCE() do {{ if (cur + 1 < cend) {{ nxt = cur + 1; nend = cend; }} else {{ \
        nxt = (cur / CH + nwarps) * CH; nend = min(nxt + CH, n_units); }} }} while (0)
#endif
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int t = 0; t < TT; t++) {{  // the row, once a block (as q4_cuda's plain kernel)
        const int i = t * NWARP * 32 + threadIdx.x;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (i < 4 * GG) v = __ldca(x + i);
        float a0 = bf2f(v.x & 0xFFFF), a1 = bf2f(v.x >> 16), a2 = bf2f(v.y & 0xFFFF), a3 = bf2f(v.y >> 16);
        float a4 = bf2f(v.z & 0xFFFF), a5 = bf2f(v.z >> 16), a6 = bf2f(v.w & 0xFFFF), a7 = bf2f(v.w >> 16);
        store_word(xq, gsum, GG, i, i < 4 * GG, a0, a1, a2, a3, a4, a5, a6, a7);
    }}
    __syncthreads();
    if (cur < n_units) ADVANCE();
    while (cur < n_units) {{
        const bool more = nxt < n_units;
        unit_rows(rn, nxt, n_out, glu_off);
        float acc[NWR];
        #pragma unroll
        for (int r = 0; r < NWR; r++) acc[r] = 0.0f;
        #pragma unroll
        for (int j = 0; j < NJJ; j++) {{
            const int slot = j % DEP;
            const int g = lane + 32 * j;
            uint4 w[NWR];
            unsigned short sc[NWR], zc[NWR];
            #pragma unroll
            for (int r = 0; r < NWR; r++) {{ w[r] = wbuf[slot][r]; sc[r] = sbuf[slot][r]; zc[r] = zbuf[slot][r]; }}
            if (j + DEP < NJJ) {{  // this unit's group DEP ahead
                const int gn = g + 32 * DEP;
                if (gn < GG) {{
                    #pragma unroll
                    for (int r = 0; r < NWR; r++) {{
                        wbuf[slot][r] = __ldg(qw + ro[r] + gn);
                        sbuf[slot][r] = __ldg(S + ro[r] + gn);
                        zbuf[slot][r] = __ldg(Z + ro[r] + gn);
                    }}
                }}
            }} else {{  // the next unit's first groups
                const int gn = lane + 32 * (j + DEP - NJJ);
                if (more && gn < GG) {{
                    #pragma unroll
                    for (int r = 0; r < NWR; r++) {{
                        wbuf[slot][r] = __ldg(qw + rn[r] + gn);
                        sbuf[slot][r] = __ldg(S + rn[r] + gn);
                        zbuf[slot][r] = __ldg(Z + rn[r] + gn);
                    }}
                }}
            }}
            if (g < GG) {{
                const uint4 x0 = xq[g], x1 = xq[GG + g], x2 = xq[2 * GG + g], x3 = xq[3 * GG + g];
                const float xs = gsum[g];
                #pragma unroll
                for (int r = 0; r < NWR; r++) {{
                    const float d = (h2sum(word_dot(w[r].x, x0, 0u)) + h2sum(word_dot(w[r].y, x1, 0u)))
                                  + (h2sum(word_dot(w[r].z, x2, 0u)) + h2sum(word_dot(w[r].w, x3, 0u)));
                    acc[r] = fmaf(d, 16.0f * bf2f(sc[r]), fmaf(bf2f(zc[r]), xs, acc[r]));
                }}
            }}
        }}
        #pragma unroll
        for (int r = 0; r < NWR; r++) acc[r] = warp_sum(acc[r]);
        #pragma unroll
        for (int r = 0; r < RW; r++) {{
            const int n = cur * RW + r;
            if (lane == r && n < n_out) {{
                float v = acc[r];
#if SGLU
                v = v / (1.0f + __expf(-v)) * acc[RW + r];
#endif
                unsigned short b;
                asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
                y[n] = b;
            }}
        }}
        cur = nxt;
        cend = nend;
        #pragma unroll
        for (int r = 0; r < NWR; r++) ro[r] = rn[r];
        if (more) ADVANCE();
    }}
#if DYN
    // every claim of this warp has been answered: count it done; the last warp resets both counters
    if (lane == 0) {{
        __threadfence();
        if (atomicAdd(ctr + 1, 1u) == (unsigned int)(nwarps - 1)) {{
            atomicExch(ctr, 0u);
            atomicExch(ctr + 1, 0u);
        }}
    }}
#endif
}}
"""


def claim_source(k: int, rows: int, warps: int, depth: int, glu: bool, dyn: bool, minb: int = 2, ch: int = 1) -> str:
    # the helpers' own macros are unused here; set to valid values
    return (_HELPERS.format(K=k, R=1, WARPS=warps, DEPTH=2, GLU=0, PDL=1, NORM=0, SPLIT=0, NP=1, ADD=0, DP4A=0)
            + _CLAIM.format(KK=k, RW=rows, NWARP=warps, DEP=depth, SGLU=int(glu), DYN=int(dyn),
                             MINB=minb, CH=ch))


def ring_depth(k: int, depth: int) -> int:
    """The largest depth <= `depth` that divides the groups a lane takes per row."""
    nj = -(-(k // 32) // 32)
    return max(d for d in range(1, min(depth, nj) + 1) if nj % d == 0)


_COUNTERS: dict[int, torch.Tensor] = {}  # claim_linear's counters, per weight (data pointer)


def claim_linear(blocks_per_sm: int = 1, dyn: bool = True, head_rows: int = 100_000, engine=None, ch: int = 1):
    """A stand-in for quant_cuda.KERNELS["c"] (the engine's 1-row kernel under the Triton configuration names) that
    runs this kernel instead (q4_step_budget.py's "claims" variants): 1 row a unit, 16 warps, 4 groups in flight a
    lane; one pair of counters per weight (allocated on its first call, the warm-up before a graph capture);
    products of more than head_rows rows (the head) keep the engine's kernel (`engine`, default quant_cuda._q4c)."""
    from forerun.models import quant_cuda
    engine = engine or quant_cuda._q4c
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def q4d(x, qw32, scale, zero, glu, block_n, block_k, use_dot, num_warps, num_stages):
        n_out = qw32.shape[0] // 2 if glu else qw32.shape[0]
        if n_out > head_rows:
            return engine(x, qw32, scale, zero, glu, block_n, block_k, use_dot, num_warps, num_stages)
        k = x.shape[1]
        assert qw32.shape[0] * (k // 32) < 2 ** 31, "the kernel's row offsets are int32"
        d = ring_depth(k, 2 if glu else 4)
        ctr = _COUNTERS.get(qw32.data_ptr())
        if ctr is None:  # (in a graph capture this would be a memset node resetting it every replay)
            assert not torch.cuda.is_current_stream_capturing(), "claim_linear's first call must come before capture"
            ctr = _COUNTERS[qw32.data_ptr()] = torch.zeros(2, dtype=torch.int32, device=x.device)
        y = torch.empty(1, n_out, dtype=x.dtype, device=x.device)
        nvrtc.launch(nvrtc.kernel(claim_source(k, 1, 16, d, glu, dyn, ch=ch), "q4d_gemv"),
                     min(sms * blocks_per_sm, -(-n_out // 16)), 512, q4_cuda.smem_bytes(k),
                     [q4_cuda._aligned(x), qw32, scale, zero, y, n_out, n_out, ctr], True)
        return y
    return q4d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_claim.json")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blocks-per-sm", default="1,2", help="comma list: grids of that many blocks an SM")
    ap.add_argument("--chunks", default="1", help="comma list: units a claim (a chunk of consecutive rows)")
    ap.add_argument("--static", action="store_true", help="also the round-robin (no counter) variants")
    args = ap.parse_args()
    if (dev := card()) is None:
        return 1
    name, sms, bw, table = dev
    per_sm = [int(v) for v in args.blocks_per_sm.split(",") if v]
    chunks = [int(v) for v in args.chunks.split(",") if v]
    modes = [(b, True, c) for b in per_sm for c in chunks] + ([(b, False, c) for b in per_sm for c in chunks]
                                                              if args.static else [])

    def claim_chain(prods, bps: int, dyn: bool, ch: int, write: bool = False):
        """The chain with this kernel, each product writing the buffer the next one reads, one pair of counters per
        product: 1 row a unit, 16 warps, 4 groups of weights in flight per lane (2 per row with SwiGLU) -- what
        fits 64 registers without spilling (nvcc), so that two blocks fit an SM. The head keeps the engine's
        kernel (~70 blocks an SM already; its 152k rows would be 150k claims on one counter), as in the engine's
        chain (write: its output copied into the head's buffer, for the check)."""
        ctr = torch.zeros(len(prods), 2, dtype=torch.int32, device="cuda")
        launches, used = [], set()
        for i, (qw, s, z, x, y, glu) in enumerate(prods):
            n, k = y.shape[1], x.shape[1]
            if n == V:
                def head(x=x, qw=qw, s=s, z=z, y=y, c=c_config(table, n, k, glu)):
                    out = q4_cuda.q4c_linear(x, qw, s, z, **c)
                    if write:
                        y.copy_(out)
                launches.append(head)
                continue
            assert qw.shape[0] * (k // 32) < 2 ** 31, "the kernel's row offsets are int32"
            r, w, d = 1, 16, ring_depth(k, 2 if glu else 4)
            kern = nvrtc.kernel(claim_source(k, r, w, d, glu, dyn, ch=ch), "q4d_gemv")
            grid = min(sms * bps, -(-(-(-n // r)) // w))
            args_ = [x, qw, s, z, y, n, n, ctr[i]]
            launches.append(lambda kern=kern, grid=grid, w=w, k=k, a=args_:
                            nvrtc.launch(kern, grid, 32 * w, q4_cuda.smem_bytes(k), a, True))
            used.add(f"n{n} k{k}{' glu' if glu else ''}: {r}x{w} depth {d}, {grid} blocks")

        def run():
            for launch in launches:
                launch()
        return run, sorted(used), ctr

    def label(bps: int, dyn: bool, ch: int) -> str:
        return (f"one grid a product, {bps} block(s) an SM, {ch} row(s) a chunk, chunks "
                f"{'claimed' if dyn else 'dealt round-robin'}")

    def bits(t: torch.Tensor) -> torch.Tensor:  # random layers without norms overflow: compare bit patterns
        return t.view(torch.int16)

    # correctness: one layer + the head, bit for bit against the engine's kernels, twice (the counters reset)
    h1, p1 = build_chain(1)
    engine_chain(h1, p1, table, write=True)()
    torch.cuda.synchronize()
    ref = [bits(y).clone() for *_, y, _ in p1]
    checks = {}
    for bps, dyn, ch in modes:
        run, _, ctr = claim_chain(p1, bps, dyn, ch, write=True)
        same = []
        for _ in range(2):
            for *_, y, _ in p1:
                y.zero_()
            run()
            torch.cuda.synchronize()
            same.append([torch.equal(bits(y), r) for (*_, y, _), r in zip(p1, ref)])
        checks[label(bps, dyn, ch)] = dict(same=same, counters_after=ctr.tolist())
        G.log(f"check {label(bps, dyn, ch)}: bit-identical per product {same}, counters after {ctr.tolist()}")
        assert all(all(s) for s in same) and not ctr.any(), (same, ctr.tolist())
    del p1

    h, prods = build_chain(args.layers)
    wbytes = chain_bytes(prods)
    floor = wbytes / bw * 1e3
    variants = {"engine's kernels (one block per row slice, tuned), PDL": engine_chain(h, prods, table)}
    configs, counters = {}, {}
    for bps, dyn, ch in modes:
        run, used, ctr = claim_chain(prods, bps, dyn, ch)
        variants[label(bps, dyn, ch)] = run
        configs[label(bps, dyn, ch)] = used
        counters[label(bps, dyn, ch)] = ctr
    runs = time_graphs(variants, args.repeats, floor)
    # after the replays: the counters back at zero, the last layer's output the engine's, bit for bit
    engine_chain(h, prods, table, write=True)()
    torch.cuda.synchronize()
    last = prods[-2][4]
    ref_last = bits(last).clone()
    after = {}
    for key, ctr in counters.items():
        last.zero_()
        variants[key]()
        torch.cuda.synchronize()
        after[key] = dict(counters_zero=not ctr.any(), last_layer_same=torch.equal(bits(last), ref_last))
        G.log(f"after the replays, {key}: {after[key]}")
    res = dict(device=name, torch=torch.__version__, sms=sms, copy_bw_bytes_per_s=bw, layers=args.layers,
               products=len(prods), weight_bytes=wbytes, floor_ms=floor, checks=checks, after_replays=after,
               configs_used=configs)
    finish(res, runs, args.out, f"{len(prods)} chained int4 decode products (8B shape, 1 row), {name}")
    assert all(v["counters_zero"] and v["last_layer_same"] for v in after.values()), after
    return 0


if __name__ == "__main__":
    sys.exit(main())
