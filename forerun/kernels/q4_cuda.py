"""The int4 decode product (1 activation row) as a CUDA C++ kernel compiled at run time with NVRTC (issue 12).

Why not Triton: the Triton decode kernel (`quant_gemm.q4v_linear`) issues ~4.6 instructions per weight, of which
the packed-f16 unpacking and products are ~2.1; the rest is the work Triton places around them (converting the
activation row in every program, layout conversions through shared memory, reductions), and at the H200's
bandwidth that leaves it bound by the issue rate at ~71 % of the floor (docs/performance.md, session 22). Here
the kernel owns its register layout:

  * one block converts the bf16 activation row once into shared memory: for each word of 8 codes, its 4 pairs
    (x[8i + 2j], x[8i + 2j + 1]) as f16 pairs pre-scaled by 1/16 (j even) or 1/256 (j odd), and the sum of
    every group of 32 activations (float32) -- the scheme of quant_gemm's packed-f16 PTX block;
  * each warp owns R output rows; lane l takes groups l, l + 32, ... of each row: one 16-byte load is one whole
    group (4 words = 32 codes), its bf16 scale and offset two 2-byte loads, coalesced across the warp; loads run
    DEPTH groups ahead of the arithmetic (a ring of registers, the loop fully unrolled);
  * per word: one shift, four lop3 into the f16 "magic" 1024 + c, four subtractions, four f16x2 fma into one
    f16x2 accumulator per word (4 products per half, each at most |x| / 16 * 15), summed in float32; per group
    and row: y += 16 * scale * sum + zero * sum(x of the group); a warp shuffle sums the lanes.
  * SwiGLU (GLU): gate rows n and up rows GLU_OFF + n in the same warp, silu(gate) * up in the epilogue.
  * PDL (Hopper): the first DEPTH groups of weights are requested before `griddepcontrol.wait`, and
    `griddepcontrol.launch_dependents` lets the next kernel start early (kernels/pdl.py says why).

DP4A (`int8_activations()`: on by default on the H100 since session 66, FORERUN_Q4_DP4A=0/1 overrides): the block rounds
the row to int8 instead, one scale per group of 32 (max |x| / 127, as llama.cpp's CUDA decode rounds its activations),
and a word of 8 codes takes two masks, a shift and two dp4a (an exact int32 sum per group) instead of ~17 packed-f16
instructions; per group and row y += scale * d * sum + zero * d * sum(int8 row) (the offsets' term over the same rounded
row, so the two terms' rounding errors cancel). Error: 0.4-0.7 % of the largest output with N(0, 1) rows (emulated; the
CPU kernels' int8 activations err the same way), against 0.25-0.35 % for the f16 pairs. The idea: at the H200's copy
bandwidth an SM must take ~32 weights a clock, i.e. at most ~4 instructions per weight at its full issue rate (4 warp
instructions a clock), and the f16 kernel spends ~2.1 of them on its unpacking alone (docs/performance.md, session 22):
near the issue bound, where the 145 chained 1-row products of the 8B shape run at 77 % of their floor on the H200
against 87-90 % on the H100 (same SMs and clocks, 0.71x the bandwidth). The int8 loop's PTX is about half as long;
`benchmarks/q4_dp4a_gpu.py` measures both. On the H100 (session 65) the chained products took 0.965x the time (90.1 ->
93.4 % of their floor) and the 8B decode step 2.065 -> 1.984 ms (session 66: 2.095 -> 2.016 ms); the H200: not yet
measured. On the real models (emulated, benchmarks/quant_accuracy.py) it adds KL 0.002 against the fp32 model on the
1.5B and makes a decode row pick another greedy token than verification's kernel 1.3-1.7x as often
(docs/quantization.md, session 66).

Layout: quant_gemm's word layout (``qw32`` int32 [N, K / 8], ``scale`` / ``zero`` bf16 [N, K / 32], w = q * scale +
zero), so the same `CudaQ4Linear` buffers serve both kernels. Compiled per (K, R, WARPS, DEPTH, GLU, PDL, DP4A, ...)
on first use (kernels/nvrtc.py); `available()` says whether it can run here (NVRTC usable, FORERUN_Q4_CUDA != 0).
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

from ..devices import card_switch
from . import nvrtc
from .pdl import enabled as pdl_enabled

GROUP = 32
_SRC = r"""
#define K_ {K}
#define G_ (K_ / 32)
#define NJ ((G_ + 31) / 32)
#define R_ {R}
#define WARPS {WARPS}
#define DEPTH {DEPTH}
#define GLU {GLU}
#define PDL {PDL}
#define NORM {NORM}
#define SPLIT {SPLIT}  // the prologue normalises x with the sums of squares an ADD kernel left (split_norm_linear)
#define NP_ {NP}       // SPLIT: partial sums per lane (n_part <= 32 * NP_)
#define ADD {ADD}      // the epilogue adds the residual and leaves the block's sum of squares (add_linear)
#define DP4A {DP4A}    // the activation row as int8 (a scale per group of 32) and dp4a products, not f16 pairs
#define NW (GLU ? 2 * R_ : R_)
#define T_ ((4 * G_ + WARPS * 32 - 1) / (WARPS * 32))  // words of the activation row per thread

__device__ __forceinline__ float bf2f(unsigned short h) {{ return __uint_as_float(((unsigned int)h) << 16); }}

__device__ __forceinline__ float bfr(float f) {{  // f rounded to bf16
    unsigned short b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
    return bf2f(b);
}}

__device__ __forceinline__ unsigned int bf2pack(float lo, float hi) {{
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}}

__device__ __forceinline__ unsigned int add2(unsigned int a, unsigned int b, float& ss) {{  // bf16 pairs, rounded
    const float lo = bfr(bf2f(a & 0xFFFF) + bf2f(b & 0xFFFF)), hi = bfr(bf2f(a >> 16) + bf2f(b >> 16));
    ss = fmaf(lo, lo, fmaf(hi, hi, ss));
    return bf2pack(lo, hi);
}}

__device__ __forceinline__ float sq2(unsigned int a, float ss) {{
    const float lo = bf2f(a & 0xFFFF), hi = bf2f(a >> 16);
    return fmaf(lo, lo, fmaf(hi, hi, ss));
}}

__device__ __forceinline__ float warp_sum(float v) {{  // xor butterfly: every lane ends with the same float
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}}

__device__ __forceinline__ unsigned int f2h2(float lo, float hi) {{
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}}

__device__ __forceinline__ unsigned int lop(unsigned int a, unsigned int b, unsigned int c) {{
    unsigned int r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));  // (a & b) | c
    return r;
}}

__device__ __forceinline__ unsigned int hsub2(unsigned int a, unsigned int b) {{
    unsigned int r;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}}

__device__ __forceinline__ unsigned int hfma2(unsigned int a, unsigned int b, unsigned int c) {{
    unsigned int r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}}

__device__ __forceinline__ float h2sum(unsigned int a) {{
    unsigned short lo, hi;
    float f0, f1;
    asm("mov.b32 {{%0, %1}}, %2;" : "=h"(lo), "=h"(hi) : "r"(a));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f0) : "h"(lo));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f1) : "h"(hi));
    return f0 + f1;
}}

// word i of the activation row (its 8 values a0..a7) -> its 4 pairs of f16, pre-scaled by 1/16 (even pairs) or 1/256
// (odd ones), at xq[(i & 3) * G + (i >> 2)], and the sum of its group of 32 (the 4 consecutive threads holding a
// group's words add theirs; the first writes it) at gsum[i >> 2]. Whole warps call it (shuffles); only `valid`
// words are stored.
__device__ __forceinline__ void store_word(uint4* xq, float* gsum, int G, int i, bool valid, float a0, float a1,
                                           float a2, float a3, float a4, float a5, float a6, float a7) {{
    float s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (valid) {{
        uint4 p;
        p.x = f2h2(a0 * 0.0625f, a1 * 0.0625f);
        p.y = f2h2(a2 * 0.00390625f, a3 * 0.00390625f);
        p.z = f2h2(a4 * 0.0625f, a5 * 0.0625f);
        p.w = f2h2(a6 * 0.00390625f, a7 * 0.00390625f);
        xq[(i & 3) * G + (i >> 2)] = p;
        if ((i & 3) == 0) gsum[i >> 2] = s;
    }}
}}

__device__ __forceinline__ unsigned int pack4(int b0, int b1, int b2, int b3) {{
    return (unsigned int)(b0 & 0xFF) | ((unsigned int)(b1 & 0xFF) << 8) | ((unsigned int)(b2 & 0xFF) << 16)
         | ((unsigned int)b3 << 24);
}}

// DP4A: word i of the activation row (a0..a7) as 8 int8, rounded to the nearest of 255 steps of its group's
// max |a| (the 4 consecutive threads holding a group's words share it: scale d = max |a| / 127), in the order the
// word's codes meet them under dp4a: the low nibbles of its bytes are codes (0, 4, 1, 5), the high ones (2, 6, 3,
// 7) (code c sits at bits 4 (c / 2) + 16 (c % 2)). Word c of group g at xq8[(c / 2) * 2G + 2g + c % 2] (so one
// 16-byte load takes words 0-1 of a group, one more 2-3), d at gscale[g], and at gsum[g] d times the sum of the
// group's int8 values: the offsets' term then multiplies the same rounded row as the codes' (with the float sum
// of the row instead, the two terms' rounding errors no longer cancel: 0.6-1 % of the output, not 0.4-0.7 %).
__device__ __forceinline__ void store_word8(uint2* xq8, float* gscale, float* gsum, int G, int i, bool valid,
                                            float a0, float a1, float a2, float a3, float a4, float a5, float a6,
                                            float a7) {{
    float m = fmaxf(fmaxf(fmaxf(fabsf(a0), fabsf(a1)), fmaxf(fabsf(a2), fabsf(a3))),
                    fmaxf(fmaxf(fabsf(a4), fabsf(a5)), fmaxf(fabsf(a6), fabsf(a7))));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const float id = m > 1e-30f ? 127.0f / m : 0.0f;  // (a group below 1e-30 counts as 0: 127 / m stays finite)
    const int q0 = __float2int_rn(a0 * id), q1 = __float2int_rn(a1 * id), q2 = __float2int_rn(a2 * id);
    const int q3 = __float2int_rn(a3 * id), q4 = __float2int_rn(a4 * id), q5 = __float2int_rn(a5 * id);
    const int q6 = __float2int_rn(a6 * id), q7 = __float2int_rn(a7 * id);
    int s = ((q0 + q1) + (q2 + q3)) + ((q4 + q5) + (q6 + q7));
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (valid) {{
        const float d = m * (1.0f / 127.0f);
        const int g = i >> 2, c = i & 3;
        xq8[(c >> 1) * 2 * G + 2 * g + (c & 1)] = make_uint2(pack4(q0, q4, q1, q5), pack4(q2, q6, q3, q7));
        if (c == 0) {{ gsum[g] = d * (float)s; gscale[g] = d; }}
    }}
}}

// one group (4 words, 32 codes 0..15) times its 32 int8 activations (words 0-1 in a, 2-3 in b): an exact int32
__device__ __forceinline__ int group_dot8(uint4 w, uint4 a, uint4 b) {{
    const unsigned int m = 0x0F0F0F0Fu;
    int s = __dp4a((int)(w.x & m), (int)a.x, 0);
    s = __dp4a((int)((w.x >> 4) & m), (int)a.y, s);
    s = __dp4a((int)(w.y & m), (int)a.z, s);
    s = __dp4a((int)((w.y >> 4) & m), (int)a.w, s);
    s = __dp4a((int)(w.z & m), (int)b.x, s);
    s = __dp4a((int)((w.z >> 4) & m), (int)b.y, s);
    s = __dp4a((int)(w.w & m), (int)b.z, s);
    return __dp4a((int)((w.w >> 4) & m), (int)b.w, s);
}}

// one word (8 codes) times its 4 activation pairs, accumulated into the f16x2 acc
__device__ __forceinline__ unsigned int word_dot(unsigned int w, uint4 xp, unsigned int acc) {{
    const unsigned int m = 0x64006400u;
    unsigned int h = w >> 8;
    acc = hfma2(hsub2(lop(w, 0x000F000Fu, m), m), xp.x, acc);
    acc = hfma2(hsub2(lop(w, 0x00F000F0u, m), m), xp.y, acc);
    acc = hfma2(hsub2(lop(h, 0x000F000Fu, m), m), xp.z, acc);
    acc = hfma2(hsub2(lop(h, 0x00F000F0u, m), m), xp.w, acc);
    return acc;
}}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
q4c_gemv(const uint4* __restrict__ x, const uint4* __restrict__ qw, const unsigned short* __restrict__ S,
         const unsigned short* __restrict__ Z, unsigned short* __restrict__ y, int n_out, int glu_off,
         const uint4* __restrict__ res, const uint4* __restrict__ nw, uint4* __restrict__ s_out, float eps,
         float* __restrict__ part_out, const float* __restrict__ part_in, int n_part)
{{
    extern __shared__ uint4 smem[];
    uint4* xq = smem;                        // [4][G_]: pairs of word c of group g at xq[c * G_ + g]
    float* gsum = (float*)(smem + 4 * G_);   // [G_]
#if DP4A
    uint2* xq8 = (uint2*)smem;               // [2][2 * G_]: int8 words of the row (store_word8); half of xq's place
    float* gscale = (float*)(smem + 2 * G_); // [G_]
#endif
#if NORM
    float* red = (float*)(smem + 4 * G_ + (G_ + 3) / 4);  // [WARPS]
#endif
#if ADD
    float* red_add = (float*)(smem + 4 * G_ + (G_ + 3) / 4);  // [WARPS] (the same place: NORM and ADD exclude)
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * WARPS + warp) * R_;

    // weight rows of this warp: R_ rows (GLU: then their R_ up rows); rows past n_out read row 0 (not stored)
    long rowoff[NW];
    #pragma unroll
    for (int r = 0; r < NW; r++) {{
        int n = row0 + (r % R_);
        n = n < n_out ? n : 0;
        rowoff[r] = (long)(r < R_ ? n : n + glu_off) * G_;
    }}
    uint4 wbuf[DEPTH][NW];
    unsigned short sbuf[DEPTH][NW], zbuf[DEPTH][NW];
    #pragma unroll
    for (int j = 0; j < DEPTH && j < NJ; j++) {{
        int g = lane + 32 * j;
        if (g < G_) {{
            #pragma unroll
            for (int r = 0; r < NW; r++) {{
                wbuf[j][r] = __ldg(qw + rowoff[r] + g);
                sbuf[j][r] = __ldg(S + rowoff[r] + g);
                zbuf[j][r] = __ldg(Z + rowoff[r] + g);
            }}
        }}
    }}
#if NORM || SPLIT
    // the norm weight is a constant of the model: this thread's words of it are fetched before the wait too
    uint4 nwr[T_];
    #pragma unroll
    for (int t = 0; t < T_; t++) {{
        const int i = t * WARPS * 32 + threadIdx.x;
        nwr[t] = i < 4 * G_ ? __ldg(nw + i) : make_uint4(0u, 0u, 0u, 0u);
    }}
#endif
#if PDL
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if ADD
    // lane r of a warp adds the residual of the warp's row r to it in the epilogue: fetched now, off the tail
    float resv = 0.0f;
    if (lane < R_ && row0 + lane < n_out) resv = bf2f(__ldca((const unsigned short*)res + row0 + lane));
#endif
    // 8 bf16 a word: this thread's words of the activation row (with NORM, of the residual too), all requested
    // before any is converted or added (one load at a time, a row of T_ words a thread paid T_ trips to the L2 in
    // a row: down's 12288-wide row took 3, ~1.6 us on the H200's critical path; with NORM block 0's store of the
    // sum kept ptxas from moving the next word's loads above it; with SPLIT they and the partials' loads travel
    // together). Written by the kernel before (PDL), so read with coherent loads: a plain read of a const
    // __restrict__ pointer compiles to ld.global.nc, which ptxas may move above griddepcontrol.wait (it did in
    // kernels/q4_mma.py, session 31; tests/test_q4_mma.py checks the SASS)
    uint4 vr[T_];
#if NORM
    uint4 rr[T_];
#endif
    #pragma unroll
    for (int t = 0; t < T_; t++) {{
        const int i = t * WARPS * 32 + threadIdx.x;
        vr[t] = i < 4 * G_ ? __ldca(x + i) : make_uint4(0u, 0u, 0u, 0u);
#if NORM
        rr[t] = res && i < 4 * G_ ? __ldca(res + i) : make_uint4(0u, 0u, 0u, 0u);
#endif
    }}
#if SPLIT
    // x is the residual stream s that the ADD product before this one wrote, one partial sum of squares per block
    // of it in part_in: warp 0 adds them up (lane l takes l, l + 32, ... in order; an xor butterfly leaves every
    // lane the same float), so every block normalises with the same 1 / rms -- as add_rmsnorm does, up to the
    // order of that sum -- and hands it to the other warps through shared memory. (Every warp reading the
    // partials itself made their few lines a hot spot of the L2: +1.5 us for the qkv product on the H200.)
    float* inv_s = (float*)(smem + 4 * G_ + (G_ + 3) / 4);
    if (warp == 0) {{
        float pv[NP_];  // (all loads in flight at once, then added in order)
        #pragma unroll
        for (int j = 0; j < NP_; j++) pv[j] = lane + 32 * j < n_part ? __ldcg(part_in + lane + 32 * j) : 0.0f;
        float tot = 0.0f;
        #pragma unroll
        for (int j = 0; j < NP_; j++) tot += pv[j];
        tot = warp_sum(tot);
        if (lane == 0) inv_s[0] = 1.0f / sqrtf(tot / (float)K_ + eps);
    }}
    __syncthreads();
    const float inv = inv_s[0];
#endif
#if NORM
    // x <- rmsnorm(x + res) * nw, as kernels/fused_norm.py's add_rmsnorm (sum rounded to bf16, then the
    // normalised value, then the product with the weight); block 0 writes the sum (the residual stream). Each
    // thread keeps its words of the sum in registers for the conversion below (same words, same thread), so the
    // prologue adds to the plain kernel's one load of the row only the residual's load (issued together) and one
    // block reduction (the words were requested above).
    float ss = 0.0f;
    #pragma unroll
    for (int t = 0; t < T_; t++) {{
        const int i = t * WARPS * 32 + threadIdx.x;
        uint4 v = vr[t];
        if (i < 4 * G_) {{
            if (res) {{
                const uint4 r = rr[t];
                v.x = add2(v.x, r.x, ss); v.y = add2(v.y, r.y, ss);
                v.z = add2(v.z, r.z, ss); v.w = add2(v.w, r.w, ss);
                if (blockIdx.x == 0) s_out[i] = v;
            }} else {{
                ss = sq2(v.x, sq2(v.y, sq2(v.z, sq2(v.w, ss))));
            }}
        }}
        vr[t] = v;
    }}
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float tot = 0.0f;
    #pragma unroll
    for (int w = 0; w < WARPS; w++) tot += red[w];
    const float inv = 1.0f / sqrtf(tot / (float)K_ + eps);
#endif
    // the activation row -> pre-scaled f16 pairs and group sums (4 consecutive threads hold a group's words)
    #pragma unroll
    for (int t = 0; t < T_; t++) {{  // whole warps stay together for the shuffles
        const int i = t * WARPS * 32 + threadIdx.x;
        const uint4 v = vr[t];
#define NV(h, c) bfr(bfr(bf2f(h) * inv) * bf2f(c))
#if NORM || SPLIT
        uint4 wn = nwr[t];
        float a0 = NV(v.x & 0xFFFF, wn.x & 0xFFFF), a1 = NV(v.x >> 16, wn.x >> 16);
        float a2 = NV(v.y & 0xFFFF, wn.y & 0xFFFF), a3 = NV(v.y >> 16, wn.y >> 16);
        float a4 = NV(v.z & 0xFFFF, wn.z & 0xFFFF), a5 = NV(v.z >> 16, wn.z >> 16);
        float a6 = NV(v.w & 0xFFFF, wn.w & 0xFFFF), a7 = NV(v.w >> 16, wn.w >> 16);
#else
        float a0 = bf2f(v.x & 0xFFFF), a1 = bf2f(v.x >> 16), a2 = bf2f(v.y & 0xFFFF), a3 = bf2f(v.y >> 16);
        float a4 = bf2f(v.z & 0xFFFF), a5 = bf2f(v.z >> 16), a6 = bf2f(v.w & 0xFFFF), a7 = bf2f(v.w >> 16);
#endif
#if DP4A
        store_word8(xq8, gscale, gsum, G_, i, i < 4 * G_, a0, a1, a2, a3, a4, a5, a6, a7);
#else
        store_word(xq, gsum, G_, i, i < 4 * G_, a0, a1, a2, a3, a4, a5, a6, a7);
#endif
    }}
    __syncthreads();

    float acc[NW];
    #pragma unroll
    for (int r = 0; r < NW; r++) acc[r] = 0.0f;
    #pragma unroll
    for (int j = 0; j < NJ; j++) {{
        const int slot = j % DEPTH;
        const int g = lane + 32 * j;
        uint4 w[NW];
        unsigned short sc[NW], zc[NW];
        #pragma unroll
        for (int r = 0; r < NW; r++) {{ w[r] = wbuf[slot][r]; sc[r] = sbuf[slot][r]; zc[r] = zbuf[slot][r]; }}
        if (j + DEPTH < NJ) {{  // refill the slot DEPTH groups ahead
            int gn = g + 32 * DEPTH;
            if (gn < G_) {{
                #pragma unroll
                for (int r = 0; r < NW; r++) {{
                    wbuf[slot][r] = __ldg(qw + rowoff[r] + gn);
                    sbuf[slot][r] = __ldg(S + rowoff[r] + gn);
                    zbuf[slot][r] = __ldg(Z + rowoff[r] + gn);
                }}
            }}
        }}
#if DP4A
        if (g < G_) {{
            const uint4 xa = xq[g], xb = xq[G_ + g];
            const float xs = gsum[g], dx = gscale[g];
            #pragma unroll
            for (int r = 0; r < NW; r++)
                acc[r] = fmaf((float)group_dot8(w[r], xa, xb) * dx, bf2f(sc[r]), fmaf(bf2f(zc[r]), xs, acc[r]));
        }}
#else
        if (g < G_) {{
            uint4 x0 = xq[g], x1 = xq[G_ + g], x2 = xq[2 * G_ + g], x3 = xq[3 * G_ + g];
            float xs = gsum[g];
            #pragma unroll
            for (int r = 0; r < NW; r++) {{
                // each word's 4 pair products leave f16 (at most 4 * 15/16 |x|: no overflow below |x| ~ 17000)
                float d = (h2sum(word_dot(w[r].x, x0, 0u)) + h2sum(word_dot(w[r].y, x1, 0u)))
                        + (h2sum(word_dot(w[r].z, x2, 0u)) + h2sum(word_dot(w[r].w, x3, 0u)));
                acc[r] = fmaf(d, 16.0f * bf2f(sc[r]), fmaf(bf2f(zc[r]), xs, acc[r]));
            }}
        }}
#endif
    }}
    #pragma unroll
    for (int r = 0; r < NW; r++) {{
        acc[r] = warp_sum(acc[r]);
    }}
#if ADD
    float ss = 0.0f;
#endif
    #pragma unroll
    for (int r = 0; r < R_; r++) {{
        if (lane == r && row0 + r < n_out) {{
            float v = acc[r];
#if GLU
            v = v / (1.0f + __expf(-v)) * acc[R_ + r];
#endif
            unsigned short b;
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
#if ADD
            // s = product + residual in bf16 (the product rounded first), as add_rmsnorm adds
            const float sv = bfr(bf2f(b) + resv);
            ss = sv * sv;
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(sv));
#endif
            y[row0 + r] = b;
        }}
    }}
#if ADD
    // the block's sum of squares of s, in a fixed order: lanes (xor butterfly), then warps
    ss = warp_sum(ss);
    if (lane == 0) red_add[warp] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {{
        float t = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; w++) t += red_add[w];
        part_out[blockIdx.x] = t;
    }}
#endif
}}
"""

DEFAULT = dict(rows=2, warps=4, depth=2)
# int8 activations and dp4a products (DP4A in the source) instead of the f16 pairs: [True] / [False], or [None]:
# FORERUN_Q4_DP4A=1 / 0 if set, else on for the cards in DP4A_CARDS. A card joins when its decode step measured
# faster with it (q4_step_budget.py) and its int4 GPU tests pass with FORERUN_Q4_DP4A=1. The H100: engine step
# 2.065 -> 1.984 ms (session 65), 2.095 -> 2.016 ms (session 66), the int4 GPU test files passing with it on (session
# 66). The H200: not yet measured. Its numeric cost (benchmarks/quant_accuracy.py, emulated on the real 1.5B):
# docs/quantization.md, session 66.
INT8_ACTIVATIONS: list[bool | None] = [None]
DP4A_CARDS: tuple[str, ...] = ("NVIDIA H100 80GB HBM3",)


def int8_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The DP4A kernel's rounding of its activation row(s), in torch: x [M, K] -> (a [M, K / 32, 32] float32 holding
    integers in -127..127, d [M, K / 32, 1] float32), x ~ a * d per group of 32 with m = max |x| of the group,
    a = round(x * (127 / m)) (a true float32 division, as the kernel's `127.0f / m`; torch's `127.0 / m` is
    reciprocal(m) * 127, one ulp off for a quarter of bf16 groups), d = m * (1 / 127); a group of zeros gives zeros."""
    g = x.float().reshape(x.shape[0], -1, 32)
    m = g.abs().amax(-1, keepdim=True)
    a = torch.round(g * torch.where(m > 1e-30, torch.full_like(m, 127.0) / m, torch.zeros_like(m)))
    return a, m * torch.tensor(1.0 / 127.0, dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def _card(device: int) -> str:
    return torch.cuda.get_device_name(device)


def int8_activations(device_name: str | None = None) -> bool:
    """Whether the 1-row kernel rounds its row to int8 (DP4A): INT8_ACTIVATIONS if set, else FORERUN_Q4_DP4A, else
    whether the card (device_name; None: the current CUDA device's, "" without one) is in DP4A_CARDS."""
    if INT8_ACTIVATIONS[0] is not None:
        return INT8_ACTIVATIONS[0]
    env = card_switch("FORERUN_Q4_DP4A")  # (a bad value is refused earlier too, when FusedLayerOps is built)
    if env is not None:
        return env
    if device_name is None:
        device_name = _card(torch.cuda.current_device()) if torch.cuda.is_available() else ""
    return device_name in DP4A_CARDS


def available(t: torch.Tensor | None = None) -> bool:
    """Whether the NVRTC kernels can run on t's device (or the current one): `nvrtc.available`, and not switched
    off with FORERUN_Q4_CUDA=0."""
    return os.environ.get("FORERUN_Q4_CUDA", "1") != "0" and nvrtc.available(t)


def dequant_available(t: torch.Tensor | None = None) -> bool:
    """Whether `q4c_dequant` / `q8c_dequant` can run: as `available`, from compute capability 8 (they use no
    Hopper instruction: Ampere / Ada cards get them too)."""
    return os.environ.get("FORERUN_Q4_CUDA", "1") != "0" and nvrtc.available(t, min_major=8)


def smem_bytes(k: int, norm: bool = False) -> int:
    """Shared memory of a launch: the pairs, the group sums; with NORM, ADD or SPLIT (norm=True) the group sums
    padded to 16 bytes and a float per warp after them."""
    g = k // GROUP
    if norm:
        return 16 * (4 * g + (g + 3) // 4) + 4 * 32
    return g * (4 * 16 + 4)


def source(k: int, rows: int, warps: int, depth: int, glu: bool, pdl: bool, norm: bool = False, split: int = 0,
           add: bool = False, dp4a: bool | None = None) -> str:
    """split: 0, or the number of partial sums of squares the prologue reads (SPLIT); dp4a: int8 activations
    (None: `int8_activations()`)."""
    dp4a = int8_activations() if dp4a is None else dp4a
    return _SRC.format(K=k, R=rows, WARPS=warps, DEPTH=depth, GLU=int(glu), PDL=int(pdl), NORM=int(norm),
                       SPLIT=int(split > 0), NP=max(1, -(-split // 32)), ADD=int(add), DP4A=int(dp4a))


@functools.lru_cache(maxsize=None)
def _kernel_on(device: int, *config):
    return nvrtc.kernel(source(*config), "q4c_gemv")


def _kernel(k: int, rows: int, warps: int, depth: int, glu: bool, pdl: bool, norm: bool = False,
            split: int = 0, add: bool = False):
    return _kernel_on(torch.cuda.current_device(), k, rows, warps, depth, glu, pdl, norm, split, add,
                      int8_activations())


def q4c_linear(x: torch.Tensor, qw32: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, glu: bool = False,
               rows: int | None = None, warps: int | None = None, depth: int | None = None,
               pdl: bool | None = None) -> torch.Tensor:
    """y = x @ W^T for one contiguous bf16 row x [1, K] and W in quant_gemm's int4 word layout (glu: W holds gate
    rows then up rows, y = silu(x @ gate^T) * (x @ up^T)); bf16 [1, N] (or N / 2). The result matches
    `q4v_linear` up to f16 rounding of the group sums (with INT8_ACTIVATIONS, up to the row's int8 rounding).
    rows: output rows per warp; warps per block; depth: groups of weights in flight per lane ahead of the
    arithmetic."""
    return _launch(x, None, qw32, scale, zero, glu, rows, warps, depth, pdl)[0]


def q4c_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    qw32: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, glu: bool = False,
                    rows: int | None = None, warps: int | None = None, depth: int | None = None,
                    pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_norm.add_rmsnorm` and `q4c_linear` in one launch: s = x + residual (bf16; residual None: s = x),
    returns (rmsnorm(s) * weight @ W^T, s). Every block normalises the row itself (a 4096-wide row is 8 KB from
    L2), block 0 writes s. Saves the norm's launch and its place in the chain of dependent kernels."""
    if weight.dtype != torch.bfloat16 or weight.shape != (x.shape[-1],) or not weight.is_contiguous() or (
            residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype)):
        raise ValueError(f"q4c_norm_linear: a bf16 norm weight [K] and a residual shaped as x; got weight "
                         f"{tuple(weight.shape)} {weight.dtype}, residual "
                         f"{None if residual is None else (tuple(residual.shape), residual.dtype)}")
    return _launch(x, (residual, weight, eps), qw32, scale, zero, glu, rows, warps, depth, pdl)


def q4c_add_linear(x: torch.Tensor, residual: torch.Tensor, qw32: torch.Tensor, scale: torch.Tensor,
                   zero: torch.Tensor, rows: int | None = None, warps: int | None = None, depth: int | None = None,
                   pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of an add + RMSNorm split across the products around it: s = x @ W^T + residual (the product
    rounded to bf16, then added in float32 and rounded, as `fused_norm.add_rmsnorm` adds), and each block's sum of
    the squares of its outputs of s. Returns (s [1, N] bf16, partial sums [blocks] float32); the product after
    the norm takes both (`q4c_split_norm_linear`), so no kernel reduces the whole row between them."""
    if residual.dtype != torch.bfloat16 or residual.numel() != qw32.shape[0]:
        raise ValueError(f"q4c_add_linear: a bf16 residual of the product's {qw32.shape[0]} outputs; got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    return _launch(x, None, qw32, scale, zero, False, rows, warps, depth, pdl, add=residual)


def q4c_split_norm_linear(s: torch.Tensor, partials: torch.Tensor, weight: torch.Tensor, eps: float,
                          qw32: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, glu: bool = False,
                          rows: int | None = None, warps: int | None = None, depth: int | None = None,
                          pdl: bool | None = None) -> torch.Tensor:
    """The second half: rmsnorm(s) * weight @ W^T (glu: SwiGLU), with mean(s^2) from the partial sums that
    `q4c_add_linear` left (added in a fixed order: every block gets the same scale), s normalised as each block
    converts it. Equal to `add_rmsnorm` + `q4c_linear` up to the order of the sum of squares."""
    if weight.dtype != torch.bfloat16 or weight.shape != (s.shape[-1],) or partials.dtype != torch.float32 \
            or partials.dim() != 1 or not partials.is_contiguous():
        raise ValueError(f"q4c_split_norm_linear: a bf16 norm weight [K] and float32 partial sums [blocks]; got "
                         f"weight {tuple(weight.shape)} {weight.dtype}, partials {tuple(partials.shape)} "
                         f"{partials.dtype}")
    return _launch(s, None, qw32, scale, zero, glu, rows, warps, depth, pdl, split=(partials, weight, eps))[0]


def _aligned(t: torch.Tensor) -> torch.Tensor:  # the kernel reads rows 16 bytes at a time (fresh copies are aligned)
    if not t.is_contiguous():
        return t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _launch(x, norm, qw32, scale, zero, glu, rows, warps, depth, pdl, add=None, split=None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    n = qw32.shape[0]
    if m != 1 or x.dtype != torch.bfloat16 or not x.is_contiguous() or qw32.shape[1] * 8 != k or k % GROUP \
            or (glu and n % 2) or scale.dtype != torch.bfloat16 or zero.dtype != torch.bfloat16:
        raise ValueError(f"q4c_linear: takes one contiguous bf16 row and bf16 scales; got x {tuple(x.shape)} "
                         f"{x.dtype}, qw32 {tuple(qw32.shape)}, scale {scale.dtype}")
    x = _aligned(x)
    rows, warps, depth = rows or DEFAULT["rows"], warps or DEFAULT["warps"], depth or DEFAULT["depth"]
    pdl = pdl_enabled(x) if pdl is None else pdl
    n_out = n // 2 if glu else n
    per_block = rows * warps
    blocks = (n_out + per_block - 1) // per_block
    y = torch.empty(1, n_out, dtype=x.dtype, device=x.device)
    null = ctypes.c_void_p(0)
    if norm is None:
        s, extra = x, [null, null, null, ctypes.c_float(0.0)]
    else:
        residual, weight, eps = norm
        residual = None if residual is None else _aligned(residual)
        s = x if residual is None else torch.empty_like(x)
        extra = [null if residual is None else residual, _aligned(weight), s if residual is not None else null,
                 ctypes.c_float(eps)]
    parts = [null, null, 0]
    if add is not None:  # the residual in place of res; the partial sums out (returned in place of s)
        s = torch.empty(blocks, dtype=torch.float32, device=x.device)
        extra[0] = add.contiguous()
        parts[0] = s
    if split is not None:  # the norm weight in place of nw, eps; the partial sums in
        partials, weight, eps = split
        extra[1], extra[3] = _aligned(weight), ctypes.c_float(eps)
        parts[1:] = [partials, partials.numel()]
    with torch.cuda.device(x.device):  # x's device: its module, its current stream
        kern = _kernel(k, rows, warps, depth, glu, pdl, norm is not None,  # (SPLIT: one build per 32 partials)
                       0 if split is None else -(-split[0].numel() // 32) * 32, add is not None)
        nvrtc.launch(kern, blocks, 32 * warps, smem_bytes(k, norm is not None or add is not None or split is not None),
                     [x, qw32, scale, zero, y, n_out, n_out] + extra + parts, pdl)
    return y, s


# ---------------------------------------------------------------------------------------------------------------
# The word layout's weights as a bf16 matrix, for products of more rows than the kernels take (prefill, wide
# verification at a batch): cuBLAS multiplies the result. Triton's one-pass kernel (quant_gemm.dequantize_int4_w32)
# serves where this cannot run. Each thread turns words of 8 codes into 8 bf16 (a 4-byte load, a 16-byte store),
# `VEC` words in a row per step of its grid-stride loop; w = code * scale + zero in float32 (multiply, then add:
# no contraction into an fma, as torch computes the reference), rounded once.
_DEQUANT_SRC = r"""
#define VEC {VEC}
__device__ __forceinline__ float bf2f(unsigned short h) {{ return __uint_as_float(((unsigned int)h) << 16); }}

__device__ __forceinline__ unsigned int pair(unsigned int w, int shift, float s, float z) {{
    const float lo = __fadd_rn(__fmul_rn((float)((w >> shift) & 15u), s), z);
    const float hi = __fadd_rn(__fmul_rn((float)((w >> (shift + 16)) & 15u), s), z);
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}}

extern "C" __global__ void __launch_bounds__(256)
q4c_dequant(const unsigned int* __restrict__ qw, const unsigned short* __restrict__ S,
            const unsigned short* __restrict__ Z, uint4* __restrict__ y, long long words)
{{
    const long long stride = (long long)gridDim.x * blockDim.x * VEC;
    for (long long i0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC; i0 < words; i0 += stride) {{
        unsigned int w[VEC];
        #pragma unroll
        for (int v = 0; v < VEC; v++) w[v] = i0 + v < words ? __ldg(qw + i0 + v) : 0u;
        #pragma unroll
        for (int v = 0; v < VEC; v++) {{
            const long long i = i0 + v;
            if (i < words) {{
                const long long g = i >> 2;  // 4 words (32 codes) per group, rows of whole groups
                const float s = bf2f(__ldg(S + g)), z = bf2f(__ldg(Z + g));
                uint4 o;  // code c of a word: nibble c / 2 of its low (c even) or high (c odd) half
                o.x = pair(w[v], 0, s, z);
                o.y = pair(w[v], 4, s, z);
                o.z = pair(w[v], 8, s, z);
                o.w = pair(w[v], 12, s, z);
                y[i] = o;
            }}
        }}
    }}
}}
"""


@functools.lru_cache(maxsize=None)
def _sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _dequant_kernel_on(device: int, vec: int):
    return nvrtc.kernel(_DEQUANT_SRC.format(VEC=vec), "q4c_dequant")


def q4c_dequant(qw32: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, vec: int = 1,
                blocks_per_sm: int = 8) -> torch.Tensor:
    """The word layout's weights [N, K] in bf16 (code * scale + zero, rounded once; equal to
    `quant_gemm.dequantize_int4_w32`'s), one memory-bound pass; bf16 scales and offsets, contiguous buffers.
    On the H200 (8B shapes, benchmarks/q4_wide_gpu.py) one word per thread (vec=1) reads and writes at 76-87 % of
    copy bandwidth, 2 and 4 at 45 % and 30 %; Triton's pass at 8 %."""
    n, kw = qw32.shape
    if scale.dtype != torch.bfloat16 or zero.dtype != torch.bfloat16 or scale.shape != (n, kw // 4) \
            or zero.shape != scale.shape or not (qw32.is_contiguous() and scale.is_contiguous()
                                                 and zero.is_contiguous()):
        raise ValueError(f"q4c_dequant: contiguous qw32 [N, K/8] and bf16 scale / zero [N, K/32]; got qw32 "
                         f"{tuple(qw32.shape)}, scale {tuple(scale.shape)} {scale.dtype}, zero {zero.dtype}")
    y = torch.empty(n, kw * 8, dtype=torch.bfloat16, device=qw32.device)
    words = n * kw
    with torch.cuda.device(qw32.device):
        kern = _dequant_kernel_on(torch.cuda.current_device(), vec)
        grid = max(1, min(_sms(torch.cuda.current_device()) * blocks_per_sm, -(-words // (256 * vec))))
        nvrtc.launch(kern, grid, 256, 0, [qw32, scale, zero, y, ctypes.c_longlong(words)], False)
    return y


# The int8 word layout (quant_gemm.pack_int8_w32: int32 words of 4 codes biased by +128, one scale per 32 codes) as
# a bf16 matrix, the same way: two words (8 codes) per thread and step, w = (u - 128) * scale in float32, rounded
# once (as quant_gemm.dequantize_int8_w32). SCALE: the scales' type, 0 bf16, 1 f16, 2 f32.
_DEQUANT8_SRC = r"""
#define SCALE {SCALE}
#if SCALE == 2
typedef float scale_t;
__device__ __forceinline__ float sf(scale_t v) {{ return v; }}
#elif SCALE == 1
typedef unsigned short scale_t;
__device__ __forceinline__ float sf(scale_t v) {{ float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f; }}
#else
typedef unsigned short scale_t;
__device__ __forceinline__ float sf(scale_t v) {{ return __uint_as_float(((unsigned int)v) << 16); }}
#endif

__device__ __forceinline__ unsigned int pair8(unsigned int w, int byte, float s) {{
    const float lo = __fmul_rn((float)((w >> (8 * byte)) & 255u) - 128.0f, s);
    const float hi = __fmul_rn((float)((w >> (8 * byte + 8)) & 255u) - 128.0f, s);
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}}

extern "C" __global__ void __launch_bounds__(256)
q8c_dequant(const uint2* __restrict__ qw, const scale_t* __restrict__ S, uint4* __restrict__ y, long long pairs)
{{
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += stride) {{
        const uint2 w = __ldg(qw + i);   // codes 8i .. 8i + 7
        const float s = sf(S[i >> 2]);   // 4 word pairs (32 codes) per group, rows of whole groups
        uint4 o;
        o.x = pair8(w.x, 0, s);
        o.y = pair8(w.x, 2, s);
        o.z = pair8(w.y, 0, s);
        o.w = pair8(w.y, 2, s);
        y[i] = o;
    }}
}}
"""
_SCALE_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@functools.lru_cache(maxsize=None)
def _dequant8_kernel_on(device: int, scale_kind: int):
    return nvrtc.kernel(_DEQUANT8_SRC.format(SCALE=scale_kind), "q8c_dequant")


def q8c_dequant(qw8: torch.Tensor, scale: torch.Tensor, blocks_per_sm: int = 8) -> torch.Tensor:
    """The int8 word layout's weights [N, K] in bf16 ((u - 128) * scale, rounded once; equal to
    `quant_gemm.dequantize_int8_w32`'s), one memory-bound pass; scales bf16, f16 or f32, contiguous buffers."""
    n, kw = qw8.shape
    if scale.dtype not in _SCALE_KINDS or scale.shape != (n, kw // 8) or qw8.dtype != torch.int32 \
            or not (qw8.is_contiguous() and scale.is_contiguous()):
        raise ValueError(f"q8c_dequant: contiguous int32 qw8 [N, K/4] and scale [N, K/32] (bf16 / f16 / f32); got "
                         f"qw8 {tuple(qw8.shape)} {qw8.dtype}, scale {tuple(scale.shape)} {scale.dtype}")
    y = torch.empty(n, kw * 4, dtype=torch.bfloat16, device=qw8.device)
    pairs = n * kw // 2
    with torch.cuda.device(qw8.device):
        kern = _dequant8_kernel_on(torch.cuda.current_device(), _SCALE_KINDS[scale.dtype])
        grid = max(1, min(_sms(torch.cuda.current_device()) * blocks_per_sm, -(-pairs // 256)))
        nvrtc.launch(kern, grid, 256, 0, [qw8, scale, y, ctypes.c_longlong(pairs)], False)
    return y
