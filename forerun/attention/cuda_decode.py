"""Decode attention (one new token per sequence) as one CUDA C++ kernel: flash-decoding with the merge of the KV
splits done by the last block of each (sequence, KV head), so a layer's attention is one launch, not two.

Why: at batch 1 the Triton backend's decode attention is two short kernels (the split kernel and the merge), each
paying a launch and a ramp-up, for ~2 MB of keys and values per layer at 512 cached tokens: by knock-out it was the
largest cost between the int4 products of an 8B-shape decode step (0.22 ms of 1.94, docs/performance.md).

One block per (sequence b, KV head h, split s), WARPS warps. The group's queries (pre-scaled by softmax scale *
log2 e) sit in shared memory. A warp takes 32 of the split's tokens at a time: Q.K with one token per lane (its
key row read whole, the queries read by every lane at once: no sums across lanes), an online softmax per head
(one max and one sum across the warp per tile), then P.V with the value rows' dimensions across the lanes (each
token's probability passed round by a shuffle); every key and value load of a tile is issued before the
arithmetic. The warps' partials meet in shared memory; with one split the block writes the output, else it writes
its partial (max, sum, acc) and counts itself in at the (b, h) counter; the block that arrives last reads every
split's weights, then every partial at once, merges and resets the counter (`__threadfence` on both sides). PDL:
the block lets the next kernel launch at TRIGGER and waits for its inputs before any read.

Status (H200, docs/performance.md, session 24): correct; the first version (a warp-wide sum per token and head)
cost 16-17 us a layer at 512 cached tokens and 63 us at 4096, this one 12 and 19 (8 warps), against 7.4 and 17.5
for the Triton split + merge kernels. So the backend uses it only when asked (`TritonPagedAttention(
cuda_decode=True)`).

Paged layout as the Triton backend: K/V [num_blocks, PAGE, Hkv, D] (rows contiguous), block_tables [B, W] int64,
seq_lens [B] int64 (the new token already written). `supports(q, k_cache, meta, window)` says when it applies
(pure decode, no tree, no window, bf16, D 64 or 128, NVRTC available).
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

from ..kernels import nvrtc
from ..kernels.pdl import enabled as pdl_enabled
from .base import kv_splits
from .metadata import AttnMetadata

_LOG2E = 1.4426950408889634
WARPS = 8  # warps per block (a warp takes 32 of the split's tokens at a time)
TRIGGER = 0  # where a block lets the next kernel launch (PDL): 0 at its start, 1 after its tokens, 2 at its exit
MAX_SPLITS = 16
# CUDA C++ shared with attention/fused_decode.py (format templates: braces doubled). TILE_DEFS: bf16 halves of
# a word and an 8-wide key-query dot product; TILE_STEP: one 32-token tile of a warp (kw: the lane's key row,
# vv[j]: token j's values of the lane's dimensions, ok: the lane holds a token; lane 0 always does): scores, the
# online softmax per head, P.V; WARPS_MERGE: the warps' partials into shared memory, then for each (head g,
# dimension d) of this thread the block's max mx, sum ls and accumulator a
TILE_DEFS = r"""#if DPL == 2
typedef unsigned int vrow_t;
#else
typedef uint2 vrow_t;
#endif

__device__ __forceinline__ float lo(unsigned int w) {{ return __uint_as_float(w << 16); }}
__device__ __forceinline__ float hi(unsigned int w) {{ return __uint_as_float(w & 0xFFFF0000u); }}

__device__ __forceinline__ float dot8(uint4 k, float4 a, float4 b, float s) {{
    s = fmaf(a.x, lo(k.x), s); s = fmaf(a.y, hi(k.x), s); s = fmaf(a.z, lo(k.y), s); s = fmaf(a.w, hi(k.y), s);
    s = fmaf(b.x, lo(k.z), s); s = fmaf(b.y, hi(k.z), s); s = fmaf(b.z, lo(k.w), s); s = fmaf(b.w, hi(k.w), s);
    return s;
}}

"""
TILE_STEP = r"""        float sc[GROUP];
        #pragma unroll
        for (int g = 0; g < GROUP; g++) sc[g] = 0.0f;
        #pragma unroll
        for (int c = 0; c < KW; c++) {{
            #pragma unroll
            for (int g = 0; g < GROUP; g++) sc[g] = dot8(kw[c], sm_q[g][2 * c], sm_q[g][2 * c + 1], sc[g]);
        }}
        float p[GROUP];
        #pragma unroll
        for (int g = 0; g < GROUP; g++) {{
            const float sg = ok ? sc[g] : NEG_INF;
            float mx = sg;
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, o));
            const float m_new = fmaxf(m[g], mx);  // finite: lane 0 always holds a token
            const float alpha = exp2f(m[g] - m_new);
            p[g] = exp2f(sg - m_new);
            float ps = p[g];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(FULL, ps, o);
            l[g] = l[g] * alpha + ps;
            m[g] = m_new;
            #pragma unroll
            for (int d = 0; d < DPL; d++) acc[g][d] *= alpha;
        }}
        #pragma unroll
        for (int j = 0; j < 32; j++) {{
            float v[DPL];
#if DPL == 2
            v[0] = lo(vv[j]); v[1] = hi(vv[j]);
#else
            v[0] = lo(vv[j].x); v[1] = hi(vv[j].x); v[2] = lo(vv[j].y); v[3] = hi(vv[j].y);
#endif
            #pragma unroll
            for (int g = 0; g < GROUP; g++) {{
                const float pj = __shfl_sync(FULL, p[g], j);
                #pragma unroll
                for (int d = 0; d < DPL; d++) acc[g][d] = fmaf(pj, v[d], acc[g][d]);
            }}
        }}
"""
WARPS_MERGE = r"""    #pragma unroll
    for (int g = 0; g < GROUP; g++) {{
        if (lane == 0) {{ sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }}
        #pragma unroll
        for (int d = 0; d < DPL; d++) sm_acc[warp][g][lane * DPL + d] = acc[g][d];
    }}
    __syncthreads();
    // the block's partial per (head g, dim d): warps merged
    for (int i = threadIdx.x; i < GROUP * D; i += WARPS * 32) {{
        const int g = i / D, d = i % D;
        float mx = NEG_INF;
        #pragma unroll
        for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, sm_m[w][g]);
        float ls = 0.0f, a = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; w++) {{
            const float f = sm_m[w][g] == NEG_INF ? 0.0f : exp2f(sm_m[w][g] - mx);
            ls += sm_l[w][g] * f;
            a += sm_acc[w][g][d] * f;
        }}
"""
_SRC = r"""
#define D {D}
#define GROUP {GROUP}
#define WARPS {WARPS}
#define PDL {PDL}
#define TRIGGER {TRIGGER}  // when the next kernel may launch: 0 at the start, 1 after the tokens, 2 at exit
#define DPL (D / 32)       // dimensions of a value row per lane
#define KW (D / 8)         // 16-byte words of a key row
#define MAXS {MAXS}
#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)  // (NVRTC has no math.h INFINITY)
""" + TILE_DEFS + r"""extern "C" __global__ void __launch_bounds__(WARPS * 32)
decode_attention(const unsigned short* __restrict__ q, const unsigned short* __restrict__ kc,
                 const unsigned short* __restrict__ vc, unsigned short* __restrict__ out,
                 float* __restrict__ part_acc, float* __restrict__ part_ml, unsigned int* __restrict__ counters,
                 const long long* __restrict__ seq_lens, const long long* __restrict__ tables,
                 float qk_scale, int num_kv, int num_splits, int page,
                 int stride_qt, int stride_qh, int stride_ot, int stride_oh,
                 long long stride_kb, int stride_kp, int stride_kh,
                 long long stride_vb, int stride_vp, int stride_vh, int stride_bt)
{{
    __shared__ float4 sm_q[GROUP][D / 4];  // the group's queries, pre-scaled (read by all lanes at once: broadcast)
    __shared__ float sm_acc[WARPS][GROUP][D];
    __shared__ float sm_m[WARPS][GROUP], sm_l[WARPS][GROUP];
    __shared__ float sm_f[GROUP][MAXS];
    __shared__ int last;
    const int bh = blockIdx.x, b = bh / num_kv, h = bh % num_kv, split = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#if PDL
#if TRIGGER == 0
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    asm volatile("griddepcontrol.wait;" ::: "memory");  // (before any read: the lengths too may be this step's)
#endif
    const long long* row_tables = tables + (long long)b * stride_bt;
    const int L = (int)seq_lens[b];
    const int per = (L + num_splits - 1) / num_splits;
    const int t0 = split * per, t1 = min(L, t0 + per);

    for (int i = threadIdx.x; i < GROUP * D / 2; i += WARPS * 32) {{
        const int g = i / (D / 2), c = i % (D / 2);
        const unsigned int w = *(const unsigned int*)(q + (long long)b * stride_qt + (long long)(h * GROUP + g) * stride_qh + 2 * c);
        float* qs = (float*)sm_q[g];
        qs[2 * c] = lo(w) * qk_scale;
        qs[2 * c + 1] = hi(w) * qk_scale;
    }}
    __syncthreads();

    float m[GROUP], l[GROUP], acc[GROUP][DPL];
    #pragma unroll
    for (int g = 0; g < GROUP; g++) {{
        m[g] = NEG_INF; l[g] = 0.0f;
        #pragma unroll
        for (int d = 0; d < DPL; d++) acc[g][d] = 0.0f;
    }}
    // a warp takes 32 tokens at a time: Q.K with a token per lane (no reduction across lanes), then P.V with the
    // value rows' dimensions across the lanes (each lane's probabilities passed round with shuffles)
    for (int base = t0 + warp * 32; base < t1; base += WARPS * 32) {{
        const int t = base + lane, n = min(32, t1 - base);
        const bool ok = lane < n;
        long long krow = 0, vrow = 0;
        if (ok) {{
            const long long pg = row_tables[t / page];
            const int off = t % page;
            krow = pg * stride_kb + (long long)off * stride_kp + h * stride_kh;
            vrow = pg * stride_vb + (long long)off * stride_vp + h * stride_vh;
        }}
        uint4 kw[KW];
        #pragma unroll
        for (int c = 0; c < KW; c++) kw[c] = ok ? __ldg((const uint4*)(kc + krow) + c) : make_uint4(0u, 0u, 0u, 0u);
        vrow_t vv[32];
        #pragma unroll
        for (int j = 0; j < 32; j++) {{  // every load of the tile is in flight before the arithmetic
            const long long r = __shfl_sync(FULL, vrow, j);
            if (j < n) vv[j] = __ldg((const vrow_t*)(vc + r) + lane);
#if DPL == 2
            else vv[j] = 0u;
#else
            else vv[j] = make_uint2(0u, 0u);
#endif
        }}
""" + TILE_STEP + r"""    }}
#if PDL && TRIGGER == 1
    asm volatile("griddepcontrol.launch_dependents;");
#endif
""" + WARPS_MERGE + r"""        const long long row = (long long)b * num_kv * GROUP + h * GROUP + g;  // query head row b * Hq + head
        if (num_splits == 1) {{
            const float o = ls > 0.0f ? a / ls : 0.0f;
            unsigned short r;
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(o));
            out[(long long)b * stride_ot + (long long)(h * GROUP + g) * stride_oh + d] = r;
        }} else {{
            part_acc[(row * num_splits + split) * D + d] = a;
            if (d == 0) {{ part_ml[(row * num_splits + split) * 2] = mx; part_ml[(row * num_splits + split) * 2 + 1] = ls; }}
        }}
    }}
    if (num_splits == 1) return;
    __threadfence();  // this thread's partials visible to the whole device before the block counts itself in
    __syncthreads();
    if (threadIdx.x == 0) {{
        last = atomicAdd(counters + bh, 1u) == (unsigned int)(num_splits - 1);
    }}
    __syncthreads();
    if (!last) return;
    __threadfence();
    // the last block merges: each split's weight per head first (max and sums), then every partial at once
    const long long row0 = (long long)b * num_kv * GROUP + h * GROUP;
    if (threadIdx.x < GROUP) {{
        const int g = threadIdx.x;
        float ms[MAXS], ls[MAXS];
        #pragma unroll
        for (int s = 0; s < MAXS; s++) {{
            ms[s] = s < num_splits ? __ldcg(part_ml + ((row0 + g) * num_splits + s) * 2) : NEG_INF;
            ls[s] = s < num_splits ? __ldcg(part_ml + ((row0 + g) * num_splits + s) * 2 + 1) : 0.0f;
        }}
        float mx = NEG_INF;
        #pragma unroll
        for (int s = 0; s < MAXS; s++) mx = fmaxf(mx, ms[s]);
        float lt = 0.0f;
        #pragma unroll
        for (int s = 0; s < MAXS; s++) {{
            ms[s] = ms[s] == NEG_INF ? 0.0f : exp2f(ms[s] - mx);
            lt += ls[s] * ms[s];
        }}
        #pragma unroll
        for (int s = 0; s < MAXS; s++) sm_f[g][s] = lt > 0.0f ? ms[s] / lt : 0.0f;
    }}
    __syncthreads();
    for (int i = threadIdx.x; i < GROUP * D; i += WARPS * 32) {{
        const int g = i / D, d = i % D;
        float as[MAXS];
        #pragma unroll
        for (int s = 0; s < MAXS; s++)  // every split's partial requested at once (not one L2 trip per split)
            as[s] = s < num_splits ? __ldcg(part_acc + ((row0 + g) * num_splits + s) * D + d) : 0.0f;
        float o = 0.0f;
        #pragma unroll
        for (int s = 0; s < MAXS; s++) o = fmaf(sm_f[g][s], as[s], o);
        unsigned short r;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(o));
        out[(long long)b * stride_ot + (long long)(h * GROUP + g) * stride_oh + d] = r;
    }}
    if (threadIdx.x == 0) counters[bh] = 0u;  // ready for the next launch (and the next graph replay)
}}
"""

_counters: dict[tuple, torch.Tensor] = {}


def max_warps(d: int, group: int, warps: int) -> int:
    """warps (at most 8: more leaves under 128 registers a thread, and the kernel spills), halved until the block's
    partials (warps x group x d floats) fit in 48 KB of static shared memory."""
    warps = min(warps, 8)
    while warps > 1 and warps * group * d * 4 > 48 * 1024:
        warps //= 2
    return warps


def source(d: int, group: int, pdl: bool, warps: int = WARPS, trigger: int = TRIGGER) -> str:
    return _SRC.format(D=d, GROUP=group, WARPS=warps, PDL=int(pdl), TRIGGER=trigger, MAXS=MAX_SPLITS)


@functools.lru_cache(maxsize=None)
def _kernel(device: int, d: int, group: int, pdl: bool, warps: int, trigger: int):
    return nvrtc.kernel(source(d, group, pdl, warps, trigger), "decode_attention")


def available(t: torch.Tensor | None = None) -> bool:
    """NVRTC usable (kernels/nvrtc.py) and not switched off with FORERUN_CUDA_ATTENTION=0."""
    return os.environ.get("FORERUN_CUDA_ATTENTION", "1") != "0" and nvrtc.available(t)


def supports(q: torch.Tensor, k_cache: torch.Tensor, meta: AttnMetadata, window: int | None) -> bool:
    """Pure decode (one query per sequence, no tree, no sliding window), bf16, D 64 or 128, GQA groups up to 8,
    contiguous rows, and the kernel available here."""
    t, hq, d = q.shape
    return (meta.max_query_len == 1 and meta.tree_mask is None and window is None and t == meta.num_seqs
            and q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16 and d in (64, 128)
            and hq % k_cache.shape[2] == 0 and hq // k_cache.shape[2] <= 8 and q.stride(2) == 1
            and k_cache.stride(3) == 1 and available(q))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, scale: float,
                     num_splits: int | None = None, warps: int | None = None, trigger: int | None = None,
                     pdl: bool | None = None) -> torch.Tensor:
    """q [B, Hq, D] (row b: sequence b's new token) -> [B, Hq, D], as TritonPagedAttention for decode steps.
    warps / trigger / pdl: the launch's shape and its PDL use (defaults WARPS, TRIGGER, kernels/pdl.py)."""
    b, hq, d = q.shape
    num_kv, page = k_cache.shape[2], k_cache.shape[1]
    group = hq // num_kv
    splits = min(num_splits or kv_splits(b * num_kv, q.device, MAX_SPLITS), MAX_SPLITS)
    out = torch.empty_like(q)
    if b == 0:
        return out
    with torch.cuda.device(q.device):
        # arrival counters, left at zero by every launch; one set per stream (launches on one stream never run
        # two attention kernels at once: each waits for the grid before it). Graphs keep the set of the stream
        # they were captured on: replaying two such graphs concurrently on two streams is not supported.
        key = (q.device.index, torch.cuda.current_stream().cuda_stream)
        cnt = _counters.get(key)
        if cnt is None or cnt.numel() < b * num_kv:
            cnt = _counters[key] = torch.zeros(max(4096, b * num_kv), dtype=torch.int32, device=q.device)
        part_acc = torch.empty(b * hq, splits, d, dtype=torch.float32, device=q.device) if splits > 1 else out
        part_ml = torch.empty(b * hq, splits, 2, dtype=torch.float32, device=q.device) if splits > 1 else out
        pdl = pdl_enabled(q) if pdl is None else pdl
        warps = max_warps(d, group, warps or WARPS)
        kern = _kernel(torch.cuda.current_device(), d, group, pdl, warps, TRIGGER if trigger is None else trigger)
        tables = meta.block_tables
        if tables.dtype != torch.int64 or meta.seq_lens.dtype != torch.int64:
            raise ValueError("decode_attention: block tables and sequence lengths must be int64")
        nvrtc.launch(kern, (b * num_kv, splits), 32 * warps, 0, [
            q, k_cache, v_cache, out, part_acc, part_ml, cnt, meta.seq_lens, tables,
            ctypes.c_float(scale * _LOG2E), num_kv, splits, page, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            ctypes.c_longlong(k_cache.stride(0)), k_cache.stride(1), k_cache.stride(2),
            ctypes.c_longlong(v_cache.stride(0)), v_cache.stride(1), v_cache.stride(2), tables.stride(0)], pdl)
    return out
