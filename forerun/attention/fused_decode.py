"""A decode step's whole attention in one CUDA C++ launch: Q/K RMSNorm + RoPE + the new key / value written to the
cache + flash-decoding over the cached keys + the merge of the KV splits, the merge through distributed shared
memory inside a thread-block cluster (Hopper) instead of a second kernel or a global atomic.

Why (issue 12, session 56): between the qkv and o products of a batch-1 int4 decode step the engine runs three
short kernels (Q/K norm + RoPE + cache write, the split attention, the merge; kernels/fused_norm.py and
attention/triton_backend.py). Each is a chain of dependent trips through L2 while the HBM streams the next product's
weights: by knock-out they cost ~6 us a layer on the H200 (q4_step_budget.py: attention 0.19 ms of a 1.74 ms step,
RoPE ~0.04 ms). Session 31 folded the merge into the split kernel with a global counter (slower: the last block's
atomic round trip and its loads of every partial were a serial tail) and session 24's one-launch CUDA kernel
(attention/cuda_decode.py) did the same and read every key after its PDL wait. Here the splits of one (sequence,
KV head) are the blocks of one cluster: each block's partial softmax stays in its shared memory, a hardware cluster
barrier replaces the kernel boundary, and every block then merges a slice of the outputs reading the others'
partials over the SM-to-SM network; the first tile of cached keys and values is fetched before the PDL wait.

One cluster of S blocks (S = the KV splits, at most MAX_SPLITS: 8 is the portable cluster size, 16 the most) per
(sequence b, KV head h); the splits share the tokens cached before this step; WARPS warps a block, a warp takes 32
of the split's tokens at a time (a token per lane for Q.K, the value dimensions across the lanes for P.V; as
cuda_decode.py). After the wait: the group's queries and (in the last split's block) the new key through RMSNorm and
RoPE, rounded to bf16 at the same points as kernels/fused_norm.py's kernel; the new key and value are written to the
cache and added by that block's last warp from shared memory, after its tiles (session 57: with the new token
counted into the splits, 513 tokens in 8 splits of 2 warps made every split's 65th token a second tile, a dependent
trip to memory after the wait).

Inputs as FusedLayerOps.qkv_to_cache + TritonPagedAttention.forward take them: qkv [B, (Hq + 2 Hkv) D] bf16 (row b:
sequence b's new token), positions / slot_mapping / seq_lens [B] int64 (seq_lens counting the new token), block
tables [B, W] int64, cos / sin [P, D] float32 (rotate-half tables), the Q / K norm weights [D] bf16 (or none).
`supports()` says when it applies (pure decode, no tree, no window, bf16, D 64 or 128, GQA group <= 8).
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

from ..kernels import nvrtc
from ..kernels.pdl import attention_waits, enabled as pdl_enabled
from .base import kv_splits
from .cuda_decode import TILE_DEFS, TILE_STEP, WARPS_MERGE
from .metadata import AttnMetadata

_LOG2E = 1.4426950408889634
WARPS = 2  # warps per block: few, so that the blocks fit beside the qkv product's and fetch their tile early
# the portable cluster size; up to 16 launch as non-portable clusters (Hopper allows 16; a cluster whose blocks
# cannot be placed together in one GPC fails to launch: more than 8 is a benchmark knob, not a default)
MAX_SPLITS = 8
EARLY_TRIGGER = True  # let the next kernel launch at once (PDL); False: at this kernel's end (a benchmark knob)
_SRC = r"""
#define D {D}
#define HALF (D / 2)
#define GROUP {GROUP}
#define WARPS {WARPS}
#define MAXS {MAXS}        // the most splits (cluster blocks) this build merges: 8 or 16
#define TRIGGER {TRIGGER}  // lets the next kernel (the o product) launch at once (PDL)
#define WAIT {WAIT}        // launched early (PDL): the first tile of cached keys / values fetched before the wait
#define QKN {QKN}          // Q / K RMSNorm before RoPE (Qwen3)
#define DPL (D / 32)       // value dimensions per lane
#define KW (D / 8)         // 16-byte words of a key row
#define HPL (HALF / 32)    // RoPE: elements of each half per lane
#define RAW_WORDS ((GROUP + 2) * KW)  // 16-byte words of the qkv row this block reads
#define RAW_PER_THREAD ((RAW_WORDS + WARPS * 32 - 1) / (WARPS * 32))
#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)
""" + TILE_DEFS + r"""__device__ __forceinline__ float bf(unsigned short v) {{ return __uint_as_float(((unsigned int)v) << 16); }}
__device__ __forceinline__ unsigned short to_bf(float f) {{
    unsigned short r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
}}
__device__ __forceinline__ float rbf(float f) {{ return bf(to_bf(f)); }}

// a float of block `rank`'s shared memory (same cluster), at the address p has in this block's
__device__ __forceinline__ float cluster_ld(const float* p, unsigned int rank) {{
    unsigned int a = (unsigned int)__cvta_generic_to_shared(p), r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r) : "memory");
    return v;
}}

__device__ __forceinline__ void cluster_sync() {{
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}}

// one head (D bf16 at src, in shared memory) through RMSNorm (weights w) and RoPE (cos / sin halves), rounded to bf16 where
// kernels/fused_norm.py's kernel rounds; a lane holds elements lane * HPL + e of the low half and HALF + that
__device__ __forceinline__ void norm_rope(const unsigned short* src, const float* w, const float* cs, const float* sn,
                                          float eps, int lane, float* lo_o, float* hi_o) {{
    float a[HPL], c[HPL];
    float ss = 0.0f;
    #pragma unroll
    for (int e = 0; e < HPL; e++) {{
        const int i = lane * HPL + e;
        a[e] = bf(src[i]);
        c[e] = bf(src[HALF + i]);
        ss = fmaf(a[e], a[e], fmaf(c[e], c[e], ss));
    }}
#if QKN
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(FULL, ss, o);
    const float inv = 1.0f / sqrtf(ss / D + eps);
    #pragma unroll
    for (int e = 0; e < HPL; e++) {{
        const int i = lane * HPL + e;
        a[e] = rbf(rbf(a[e] * inv) * w[i]);
        c[e] = rbf(rbf(c[e] * inv) * w[HALF + i]);
    }}
#endif
    #pragma unroll
    for (int e = 0; e < HPL; e++) {{
        const int i = lane * HPL + e;
        lo_o[e] = rbf(a[e] * cs[i] - c[e] * sn[i]);
        hi_o[e] = rbf(c[e] * cs[i] + a[e] * sn[i]);
    }}
}}

// the keys (a row per lane: the lane's token) and values (token j's dimensions of this lane in vv[j]) of the 32
// tokens from base, those before t_old only (cached before this step); zeros elsewhere
__device__ __forceinline__ void load_tile(const unsigned short* __restrict__ kc, const unsigned short* __restrict__ vc,
                                          const long long* __restrict__ row_tables, int base, int t_old, int page, int h,
                                          long long stride_kb, int stride_kp, int stride_kh, long long stride_vb,
                                          int stride_vp, int stride_vh, int lane, uint4* kw, vrow_t* vv) {{
    const int t = base + lane;
    const bool ok = t < t_old;
    long long krow = 0, vrow = 0;
    if (ok) {{
        const long long pg = row_tables[t / page];
        const int off = t % page;
        krow = pg * stride_kb + (long long)off * stride_kp + h * stride_kh;
        vrow = pg * stride_vb + (long long)off * stride_vp + h * stride_vh;
    }}
    #pragma unroll
    for (int c = 0; c < KW; c++) kw[c] = ok ? __ldcg((const uint4*)(kc + krow) + c) : make_uint4(0u, 0u, 0u, 0u);
    #pragma unroll
    for (int j = 0; j < 32; j++) {{
        const long long r = __shfl_sync(FULL, vrow, j);
        if (base + j < t_old) vv[j] = __ldcg((const vrow_t*)(vc + r) + lane);
#if DPL == 2
        else vv[j] = 0u;
#else
        else vv[j] = make_uint2(0u, 0u);
#endif
    }}
}}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
fused_decode_attention(const unsigned short* __restrict__ qkv, const long long* __restrict__ pos,
                       const long long* __restrict__ slots, const long long* __restrict__ seq_lens,
                       const long long* __restrict__ tables, const float* __restrict__ cos_t,
                       const float* __restrict__ sin_t, const unsigned short* __restrict__ q_w,
                       const unsigned short* __restrict__ k_w, unsigned short* __restrict__ kc,
                       unsigned short* __restrict__ vc, unsigned short* __restrict__ out,
                       float eps, float qk_scale, int num_kv, int page, int stride_t, int stride_cos,
                       long long stride_kb, int stride_kp, int stride_kh,
                       long long stride_vb, int stride_vp, int stride_vh, int stride_bt, int stride_ot, int stride_oh)
{{
    __shared__ float4 sm_q[GROUP][D / 4];       // the group's queries after RoPE, pre-scaled (broadcast reads)
    __shared__ float sm_cos[HALF], sm_sin[HALF];
    __shared__ float sm_w[2][D];                // Q / K norm weights
    __shared__ __align__(16) unsigned short sm_k[D];  // the new token's key (after RoPE; the owner's only)
    __shared__ __align__(16) unsigned short sm_v[D];  // and its value
    __shared__ float sm_acc[WARPS][GROUP][D];
    __shared__ float sm_m[WARPS][GROUP], sm_l[WARPS][GROUP];
    __shared__ float cl_acc[GROUP][D];          // this block's partial: read by the cluster's other blocks
    __shared__ float cl_m[GROUP], cl_l[GROUP];
    __shared__ float sm_f[MAXS][GROUP];         // every split's weight per head (the merge)
    __shared__ __align__(16) unsigned short sm_raw[GROUP + 2][D];  // the qkv row's queries, key, value (raw)

    const int split = blockIdx.x, S = gridDim.x;
    const int b = blockIdx.y / num_kv, h = blockIdx.y % num_kv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#if TRIGGER
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    // before the wait: only what no kernel launched with PDL writes (kernels/pdl.py): the step's metadata, the
    // RoPE tables, the norm weights, and keys / values cached before this step
    const long long* row_tables = tables + (long long)b * stride_bt;
    const int L = (int)seq_lens[b];
    // the splits share the tokens cached before this step (tiles fetched before the wait, none after: at 512
    // cached tokens and 8 splits of 2 warps exactly one tile a warp); the new token is added by the last split's
    // last warp from shared memory, after its tiles
    const int cached = max(L - 1, 0);
    const int per = (cached + S - 1) / S;
    const int t0 = split * per, t1 = min(cached, t0 + per);
    const int t_old = t1;
    const long long slot = slots[b], p_rope = pos[b];
    for (int i = threadIdx.x; i < HALF; i += WARPS * 32) {{
        sm_cos[i] = cos_t[p_rope * stride_cos + i];  // (the rows repeat their first half)
        sm_sin[i] = sin_t[p_rope * stride_cos + i];
    }}
#if QKN
    for (int i = threadIdx.x; i < D; i += WARPS * 32) {{ sm_w[0][i] = bf(q_w[i]); sm_w[1][i] = bf(k_w[i]); }}
#endif
    int base = t0 + warp * 32;
    uint4 kw[KW];
    vrow_t vv[32];
#if WAIT
    load_tile(kc, vc, row_tables, base, t_old, page, h, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp,
              stride_vh, lane, kw, vv);
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    // what this block reads of the qkv product's row: the group's queries and the KV head's new key and value,
    // every 16-byte word requested at once (one trip through L2), then normalised and rotated from shared memory
    const int hq = num_kv * GROUP;
    const unsigned short* row = qkv + (long long)b * stride_t;
    {{
        uint4 rw[RAW_PER_THREAD];
        #pragma unroll
        for (int k = 0; k < RAW_PER_THREAD; k++) {{
            const int w = threadIdx.x + k * WARPS * 32;
            if (w < RAW_WORDS) {{
                const int r = w / KW, c = w % KW;
                const int head = r < GROUP ? h * GROUP + r : (r == GROUP ? hq + h : hq + num_kv + h);
                rw[k] = __ldcg((const uint4*)(row + (long long)head * D) + c);
            }}
        }}
        #pragma unroll
        for (int k = 0; k < RAW_PER_THREAD; k++) {{
            const int w = threadIdx.x + k * WARPS * 32;
            if (w < RAW_WORDS) ((uint4*)sm_raw)[w] = rw[k];
        }}
    }}
    __syncthreads();
    const bool owner = split == S - 1;  // writes the new key and value (and attends to them if L > 0)
    for (int j = warp; j <= GROUP; j += WARPS) {{
        float lo_o[HPL], hi_o[HPL];
        if (j < GROUP) {{
            norm_rope(sm_raw[j], sm_w[0], sm_cos, sm_sin, eps, lane, lo_o, hi_o);
            float* qs = (float*)sm_q[j];
            #pragma unroll
            for (int e = 0; e < HPL; e++) {{
                qs[lane * HPL + e] = lo_o[e] * qk_scale;
                qs[HALF + lane * HPL + e] = hi_o[e] * qk_scale;
            }}
        }} else if (owner) {{
            norm_rope(sm_raw[GROUP], sm_w[1], sm_cos, sm_sin, eps, lane, lo_o, hi_o);
            const long long blk = slot / page, in_blk = slot % page;
            unsigned short* kd = kc + blk * stride_kb + in_blk * stride_kp + (long long)h * stride_kh;
            unsigned short* vd = vc + blk * stride_vb + in_blk * stride_vp + (long long)h * stride_vh;
            #pragma unroll
            for (int e = 0; e < HPL; e++) {{
                const int i = lane * HPL + e;
                const unsigned short a = to_bf(lo_o[e]), c = to_bf(hi_o[e]);
                kd[i] = a; kd[HALF + i] = c; sm_k[i] = a; sm_k[HALF + i] = c;
            }}
            for (int i = lane; i < D; i += 32) {{ const unsigned short v = sm_raw[GROUP + 1][i]; vd[i] = v; sm_v[i] = v; }}
        }}
    }}
    __syncthreads();

    float m[GROUP], l[GROUP], acc[GROUP][DPL];
    #pragma unroll
    for (int g = 0; g < GROUP; g++) {{
        m[g] = NEG_INF; l[g] = 0.0f;
        #pragma unroll
        for (int d = 0; d < DPL; d++) acc[g][d] = 0.0f;
    }}
    bool have = WAIT;  // kw / vv hold the tile at base
    for (; base < t1; base += WARPS * 32) {{
        if (!have)
            load_tile(kc, vc, row_tables, base, t_old, page, h, stride_kb, stride_kp, stride_kh, stride_vb,
                      stride_vp, stride_vh, lane, kw, vv);
        have = false;
        const bool ok = lane < t1 - base;
""" + TILE_STEP + r"""    }}
    if (owner && L > 0 && warp == WARPS - 1) {{  // the new token: one score per head, the lanes over dimensions
        // (whole words a lane, as the tiles read their values: no bank conflicts)
        const vrow_t kr = ((const vrow_t*)sm_k)[lane], vr = ((const vrow_t*)sm_v)[lane];
#if DPL == 2
        const float kf[DPL] = {{lo(kr), hi(kr)}}, vf[DPL] = {{lo(vr), hi(vr)}};
#else
        const float kf[DPL] = {{lo(kr.x), hi(kr.x), lo(kr.y), hi(kr.y)}};
        const float vf[DPL] = {{lo(vr.x), hi(vr.x), lo(vr.y), hi(vr.y)}};
#endif
        #pragma unroll
        for (int g = 0; g < GROUP; g++) {{
#if DPL == 2
            const float2 q2 = ((const float2*)sm_q[g])[lane];
            const float qv[DPL] = {{q2.x, q2.y}};
#else
            const float4 q4 = sm_q[g][lane];
            const float qv[DPL] = {{q4.x, q4.y, q4.z, q4.w}};
#endif
            float sg = 0.0f;
            #pragma unroll
            for (int d = 0; d < DPL; d++) sg = fmaf(qv[d], kf[d], sg);
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) sg += __shfl_xor_sync(FULL, sg, o);
            const float m_new = fmaxf(m[g], sg);
            const float alpha = exp2f(m[g] - m_new), pg = exp2f(sg - m_new);
            l[g] = l[g] * alpha + pg;
            m[g] = m_new;
            #pragma unroll
            for (int d = 0; d < DPL; d++) acc[g][d] = fmaf(pg, vf[d], acc[g][d] * alpha);
        }}
    }}
""" + WARPS_MERGE + r"""        if (S == 1) {{
            out[(long long)b * stride_ot + (long long)(h * GROUP + g) * stride_oh + d] = to_bf(ls > 0.0f ? a / ls : 0.0f);
        }} else {{
            cl_acc[g][d] = a;
            if (d == 0) {{ cl_m[g] = mx; cl_l[g] = ls; }}
        }}
    }}
    if (S == 1) return;
    cluster_sync();  // every block's partial written (release / acquire across the cluster)
    if (threadIdx.x < GROUP) {{  // each split's weight per head, from the splits' maxima and sums
        const int g = threadIdx.x;
        float ms[MAXS], ls[MAXS];
        float mx = NEG_INF;
        #pragma unroll
        for (int s = 0; s < MAXS; s++) {{
            ms[s] = s < S ? cluster_ld(&cl_m[g], s) : NEG_INF;
            ls[s] = s < S ? cluster_ld(&cl_l[g], s) : 0.0f;
            mx = fmaxf(mx, ms[s]);
        }}
        float lt = 0.0f;
        #pragma unroll
        for (int s = 0; s < MAXS; s++) {{
            ms[s] = ms[s] == NEG_INF ? 0.0f : exp2f(ms[s] - mx);
            lt += ls[s] * ms[s];
        }}
        #pragma unroll
        for (int s = 0; s < MAXS; s++) sm_f[s][g] = lt > 0.0f ? ms[s] / lt : 0.0f;
    }}
    __syncthreads();
    // this block's slice of the outputs (every S-th run of WARPS * 32), every split's partial requested at once
    for (int i = split * WARPS * 32 + threadIdx.x; i < GROUP * D; i += S * WARPS * 32) {{
        const int g = i / D, d = i % D;
        float as[MAXS];
        #pragma unroll
        for (int s = 0; s < MAXS; s++) as[s] = s < S ? cluster_ld(&cl_acc[g][d], s) : 0.0f;
        float o = 0.0f;
        #pragma unroll
        for (int s = 0; s < MAXS; s++) o = fmaf(sm_f[s][g], as[s], o);
        out[(long long)b * stride_ot + (long long)(h * GROUP + g) * stride_oh + d] = to_bf(o);
    }}
    // no block leaves (its shared memory) while another may still read it: lifetime only, nothing to publish
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}}
"""


def source(d: int, group: int, trigger: bool, wait: bool, qk_norm: bool, warps: int = WARPS,
           max_splits: int = 8) -> str:
    return _SRC.format(D=d, GROUP=group, WARPS=warps, TRIGGER=int(trigger), WAIT=int(wait), QKN=int(qk_norm),
                       MAXS=max_splits)


@functools.lru_cache(maxsize=None)
def _kernel(device: int, d: int, group: int, trigger: bool, wait: bool, qk_norm: bool, warps: int, max_splits: int):
    return nvrtc.kernel(source(d, group, trigger, wait, qk_norm, warps, max_splits), "fused_decode_attention")


# Off unless FORERUN_FUSED_ATTENTION=1 (or set_enabled): on by default once measured faster on a card
_switch = [os.environ.get("FORERUN_FUSED_ATTENTION", "0") == "1"]


def set_enabled(on: bool) -> None:
    """Use the fused kernel where it applies (benchmarks compare; captured graphs keep what they had)."""
    _switch[0] = on


def enabled() -> bool:
    return _switch[0]


def applies(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, meta: AttnMetadata,
            k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
            window: int | None) -> bool:
    """The step is one the kernel computes: pure decode (one new token per sequence, no tree, no sliding window),
    bf16 rows (16-byte aligned) and caches (rows contiguous and 16-byte aligned), D 64 or 128, a GQA group of at
    most 8, float32 RoPE tables with contiguous rows (an EAGLE head moved to bf16 has bf16 ones: not here), norm
    weights bf16 if any, int64 positions and metadata."""
    def aligned(t: torch.Tensor) -> bool:
        return t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:-1]) and t.stride(-1) == 1

    norms = [w for w in (q_norm_weight, k_norm_weight) if w is not None]
    return (meta.max_query_len == 1 and meta.tree_mask is None and window is None
            and qkv.shape[0] == meta.num_seqs and qkv.dtype == torch.bfloat16 and head_dim in (64, 128)
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 8
            and k_cache.dtype == v_cache.dtype == torch.bfloat16 and aligned(qkv) and aligned(k_cache)
            and aligned(v_cache) and cos.dtype == sin.dtype == torch.float32 and cos.stride() == sin.stride()
            and cos.stride(-1) == 1 and len(norms) in (0, 2) and all(w.dtype == torch.bfloat16 for w in norms)
            and positions.dtype == meta.slot_mapping.dtype == meta.block_tables.dtype == meta.seq_lens.dtype
            == torch.int64)


def supports(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, meta: AttnMetadata,
             k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
             window: int | None) -> bool:
    """Switched on (FORERUN_FUSED_ATTENTION, set_enabled), a CUDA tensor on a card where NVRTC kernels run
    (compute capability 9: clusters and griddepcontrol), and a step the kernel computes (`applies`)."""
    return (_switch[0] and qkv.is_cuda and applies(qkv, positions, cos, sin, q_norm_weight, k_norm_weight, meta,
                                                   k_cache, v_cache, num_heads, num_kv_heads, head_dim, window)
            and nvrtc.available(qkv))


def attention(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
              meta: AttnMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int, scale: float, num_splits: int | None = None, warps: int | None = None) -> torch.Tensor:
    """qkv [B, (Hq + 2 Hkv) D] -> the heads' outputs [B, Hq, D]; the new keys and values written into the caches
    (as qk_norm_rope_store then TritonPagedAttention.forward)."""
    b = qkv.shape[0]
    group = num_heads // num_kv_heads
    warps = warps or WARPS
    out = torch.empty(b, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if b == 0:
        return out
    most = 16 if (num_splits or MAX_SPLITS) > 8 else 8  # a cluster holds at most 16 blocks
    splits = max(1, min(num_splits or kv_splits(b * num_kv_heads, qkv.device, MAX_SPLITS), most))
    wait = attention_waits(qkv, b)  # launched early, waiting on the qkv product (kernels/pdl.py)
    trigger = EARLY_TRIGGER and pdl_enabled(qkv)
    norm = q_norm_weight is not None
    tables = meta.block_tables
    with torch.cuda.device(qkv.device):
        kern = _kernel(torch.cuda.current_device(), head_dim, group, trigger, wait, norm, warps, most)
        nvrtc.launch(kern, (splits, b * num_kv_heads), 32 * warps, 0, [
            qkv, positions, meta.slot_mapping, meta.seq_lens, tables, cos, sin,
            q_norm_weight if norm else cos, k_norm_weight if norm else cos, k_cache, v_cache, out,
            ctypes.c_float(eps), ctypes.c_float(scale * _LOG2E), num_kv_heads, k_cache.shape[1], qkv.stride(0),
            cos.stride(0), ctypes.c_longlong(k_cache.stride(0)), k_cache.stride(1), k_cache.stride(2),
            ctypes.c_longlong(v_cache.stride(0)), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
            out.stride(0), out.stride(1)], wait, cluster=splits)
    return out
