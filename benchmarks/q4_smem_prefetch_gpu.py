"""The 1-row int4 product with its whole weight slice copied into shared memory before the PDL wait (issue 12,
session 51; measured in session 52 on the H100 and ruled out: the 145-product chain 2.008-2.224 ms against the
engine's 1.788, the step 2.389-2.685 against 2.107, q4_smem_prefetch_h100_s52.json, docs/quantization.md).

The engine's kernel (kernels/q4_cuda.py) requests DEPTH groups of weights per lane into registers before
`griddepcontrol.wait`; more depth costs registers and residency (4 groups deep made the split norm's products 20 %
slower, q4_step_budget_split_deep_h100_s51.json). The persistent kernel of q4_stream_gpu.py showed the copies
themselves can stream at 103-106 % of the copy floor through shared memory, but lost at its software barriers.
This kernel keeps PDL's hardware hand-over and the block scheduler and changes one thing: each block copies ALL
its rows' codes, scales and offsets into shared memory with `cp.async` as soon as it starts (before the wait), so a
block that becomes resident while the product before it drains keeps the memory busy with everything it will
need, not DEPTH groups, and after the wait only converts the activation row and does the arithmetic from shared
memory (the same per-lane order as q4_cuda.py: outputs bit-identical, checked).

Variants: rows a warp (R) x warps a block (W) for each product; the engine's kernels (tuned table) in the same
chain run beside them, interleaved, CUDA graph replays. Prints a table, writes JSON + PNG.

    python benchmarks/q4_smem_prefetch_gpu.py --out benchmarks/results/q4_smem_prefetch_h200.json
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
from q4_persistent_gpu import build_chain, card, chain_bytes, engine_chain, finish, time_graphs  # noqa: E402

_HELPERS = q4_cuda._SRC[: q4_cuda._SRC.index('extern "C"')]
_SMEM = r"""
#define KK {KK}               // K
#define GG (KK / 32)          // groups a row
#define RW {RW}               // rows a warp
#define NWARP {NWARP}         // warps a block
#define SGLU {SGLU}           // SwiGLU: gate rows, then their up rows GLU_OFF further
#define RB (RW * NWARP)       // output rows a block
#define NR (SGLU ? 2 * RB : RB)  // weight rows a block copies
#define NJJ ((GG + 31) / 32)

__device__ __forceinline__ void cp16(void* dst, const void* src) {{
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
}}

// weight row r of the block (r < RB: output rows, r >= RB: their up rows) -> its row in W (row 0 past n_out)
__device__ __forceinline__ long wrow(int r, int row0, int n_out, int glu_off) {{
    int n = row0 + (r % RB);
    n = n < n_out ? n : 0;
    return r < RB ? (long)n : (long)n + glu_off;
}}

extern "C" __global__ void __launch_bounds__(NWARP * 32)
q4s_gemv(const uint4* __restrict__ x, const uint4* __restrict__ qw, const unsigned short* __restrict__ S,
         const unsigned short* __restrict__ Z, unsigned short* __restrict__ y, int n_out, int glu_off)
{{
    extern __shared__ uint4 smem[];
    uint4* wq = smem;                                      // [NR][GG] codes
    unsigned short* ws = (unsigned short*)(wq + NR * GG);  // [NR][GG] scales, then [NR][GG] offsets
    unsigned short* wz = ws + NR * GG;
    uint4* xq = (uint4*)(wz + NR * GG);                    // [4][GG] activation pairs (16-byte aligned: GG % 8 == 0)
    float* gsum = (float*)(xq + 4 * GG);                   // [GG]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = blockIdx.x * RB;
    // the block's whole weight slice, before the wait: codes GG uint4 a row, scales and offsets GG / 8 each
    for (int i = threadIdx.x; i < NR * GG; i += NWARP * 32) {{
        const int r = i / GG, g = i - r * GG;
        cp16(wq + i, qw + wrow(r, row0, n_out, glu_off) * GG + g);
    }}
    for (int i = threadIdx.x; i < NR * (GG / 8); i += NWARP * 32) {{
        const int r = i / (GG / 8), c = i - r * (GG / 8);
        const long off = wrow(r, row0, n_out, glu_off) * GG;
        cp16(ws + 8 * i, (const uint4*)(S + off) + c);
        cp16(wz + 8 * i, (const uint4*)(Z + off) + c);
    }}
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int i = threadIdx.x; i < 4 * GG; i += NWARP * 32) {{  // 4 GG is a multiple of 32: whole warps (shuffles)
        const uint4 v = __ldca(x + i);  // written by the kernel before: a coherent load after the wait
        float a0 = bf2f(v.x & 0xFFFF), a1 = bf2f(v.x >> 16), a2 = bf2f(v.y & 0xFFFF), a3 = bf2f(v.y >> 16);
        float a4 = bf2f(v.z & 0xFFFF), a5 = bf2f(v.z >> 16), a6 = bf2f(v.w & 0xFFFF), a7 = bf2f(v.w >> 16);
        store_word(xq, gsum, GG, i, true, a0, a1, a2, a3, a4, a5, a6, a7);
    }}
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    const int nw = SGLU ? 2 * RW : RW;
    float acc[2 * RW];
    #pragma unroll
    for (int r = 0; r < 2 * RW; r++) acc[r] = 0.0f;
    #pragma unroll
    for (int j = 0; j < NJJ; j++) {{
        const int g = lane + 32 * j;
        if (g < GG) {{
            const uint4 x0 = xq[g], x1 = xq[GG + g], x2 = xq[2 * GG + g], x3 = xq[3 * GG + g];
            const float xs = gsum[g];
            #pragma unroll
            for (int r = 0; r < nw; r++) {{
                const int lr = r < RW ? warp * RW + r : RB + warp * RW + (r - RW);  // the block's weight row
                const uint4 w = wq[lr * GG + g];
                const float d = (h2sum(word_dot(w.x, x0, 0u)) + h2sum(word_dot(w.y, x1, 0u)))
                              + (h2sum(word_dot(w.z, x2, 0u)) + h2sum(word_dot(w.w, x3, 0u)));
                acc[r] = fmaf(d, 16.0f * bf2f(ws[lr * GG + g]), fmaf(bf2f(wz[lr * GG + g]), xs, acc[r]));
            }}
        }}
    }}
    #pragma unroll
    for (int r = 0; r < nw; r++) acc[r] = warp_sum(acc[r]);
    #pragma unroll
    for (int r = 0; r < RW; r++) {{
        const int n = row0 + warp * RW + r;
        if (lane == r && n < n_out) {{
            float v = acc[r];
            if (SGLU) v = v / (1.0f + __expf(-v)) * acc[RW + r];
            unsigned short b;
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
            y[n] = b;
        }}
    }}
}}
"""


def smem_source(k: int, rows: int, warps: int, glu: bool) -> str:
    # the helpers' own macros are unused here; set to valid values
    return (_HELPERS.format(K=k, R=1, WARPS=warps, DEPTH=2, GLU=0, PDL=1, NORM=0, SPLIT=0, NP=1, ADD=0, DP4A=0)
            + _SMEM.format(KK=k, RW=rows, NWARP=warps, SGLU=int(glu)))


def smem_bytes(k: int, rows: int, warps: int, glu: bool) -> int:
    g = k // 32
    return (2 if glu else 1) * rows * warps * g * (16 + 2 + 2) + 4 * g * 16 + 4 * g


def fit(k: int, rows: int, warps: int, glu: bool, max_smem: int) -> tuple[int, int]:
    """rows x warps, halved (rows first, then warps) until the block's slice fits max_smem bytes."""
    while smem_bytes(k, rows, warps, glu) > max_smem and (rows > 1 or warps > 1):
        rows, warps = (rows // 2, warps) if rows > 1 else (rows, warps // 2)
    return rows, warps


def smem_linear(rows: int = 2, warps: int = 16):
    """A stand-in for quant_cuda.KERNELS["c"] (the engine's 1-row kernel under the Triton configuration names)
    that runs this kernel at rows x warps instead (q4_step_budget.py's "smem" variant)."""
    max_smem = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", 227 * 1024)

    def q4c(x, qw32, scale, zero, glu, block_n, block_k, use_dot, num_warps, num_stages):
        n_out = qw32.shape[0] // 2 if glu else qw32.shape[0]
        k = x.shape[1]
        r, w = fit(k, rows, warps, glu, max_smem)
        y = torch.empty(1, n_out, dtype=x.dtype, device=x.device)
        nvrtc.launch(nvrtc.kernel(smem_source(k, r, w, glu), "q4s_gemv"), -(-n_out // (r * w)), 32 * w,
                     smem_bytes(k, r, w, glu), [q4_cuda._aligned(x), qw32, scale, zero, y, n_out, n_out], True)
        return y
    return q4c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_smem_prefetch.json")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default="2x16,1x16,2x8,4x8",
                    help="rows a warp x warps a block, comma list (fewer for a product whose slice would not fit)")
    args = ap.parse_args()
    if (dev := card()) is None:
        return 1
    name, sms, bw, table = dev
    parsed = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",") if c]
    max_smem = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", 227 * 1024)

    def smem_chain(prods, rows, warps):
        """The chain with this kernel at rows x warps, each product writing the buffer the next one reads; where a
        product's slice does not fit the shared memory, fewer rows a warp (then fewer warps) for that product."""
        launches, used = [], []
        for qw, s, z, x, y, glu in prods:
            n, k = y.shape[1], x.shape[1]
            r, w = fit(k, rows, warps, glu, max_smem)
            kern = nvrtc.kernel(smem_source(k, r, w, glu), "q4s_gemv")
            launches.append((kern, -(-n // (r * w)), 32 * w, smem_bytes(k, r, w, glu), [x, qw, s, z, y, n, n]))
            used.append(f"{r}x{w}")

        def run():
            for kern, blocks, threads, smem, a in launches:
                nvrtc.launch(kern, blocks, threads, smem, a, True)
        return run, used

    # correctness: one layer + the head, bit for bit against the engine's kernels
    h1, p1 = build_chain(1)
    engine_chain(h1, p1, table, write=True)()
    torch.cuda.synchronize()
    ref = [y.clone() for *_, y, _ in p1]
    checks = {}
    for rows, warps in parsed:
        for *_, y, _ in p1:
            y.zero_()
        smem_chain(p1, rows, warps)[0]()
        torch.cuda.synchronize()
        same = [torch.equal(y, r) for (*_, y, _), r in zip(p1, ref)]
        checks[f"{rows}x{warps}"] = same
        G.log(f"check {rows} rows x {warps} warps: bit-identical per product {same}")
        assert all(same), same
    del p1

    h, prods = build_chain(args.layers)
    wbytes = chain_bytes(prods)
    floor = wbytes / bw * 1e3
    variants = {"engine's kernels (registers, tuned depth), PDL": engine_chain(h, prods, table)}
    taken = {}
    for rows, warps in parsed:
        run, used = smem_chain(prods, rows, warps)
        variants[f"whole slice in shared memory before the wait, {rows} rows x {warps} warps"] = run
        taken[f"{rows}x{warps}"] = sorted(set(used))
    runs = time_graphs(variants, args.repeats, floor)
    res = dict(device=name, torch=torch.__version__, sms=sms, copy_bw_bytes_per_s=bw, layers=args.layers,
               products=len(prods), weight_bytes=wbytes, floor_ms=floor, checks=checks, configs_used=taken)
    finish(res, runs, args.out, f"{len(prods)} chained int4 decode products (8B shape, 1 row), {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
