"""The int4 product of 2-32 activation rows (verification) on tensor cores, CUDA C++ compiled with NVRTC (issue 12).

Why: the CUDA-core kernels pay per row (~0.9 instructions per weight per extra row), and the Triton tensor-core
kernel routes its dequantized tile through shared memory, so on the H200 a 5-token verification step of the int4
8B model cost 3.5x a decode step (bf16: 1.05x). Here each weight is unpacked once, in registers, straight into
the operand of `mma.sync.m16n8k16` (bf16 in, float32 accumulation), so up to 8 rows cost one MMA per 256 weights
and the unpacking is the same whatever the row count (one MMA per tile of 8 rows, up to 4 tiles: 32 rows, so a
verification of 4 x 5 or 2 x 16 tokens streams the weights once).

The weights are the MMA's A operand (16 output rows x 16 codes), the activations its B operand (16 codes x 8
tokens). Which code sits at which of the MMA's 16 k positions does not matter as long as A and B agree, so each
lane takes what it can load in one piece: in lane (g, t) of a warp (g = lane / 4, t = lane % 4), rows g and g + 8
of the warp's 16-row tile, and the whole group 4 s + t (32 codes, one 16-byte load) of each, in superblock s
(4 groups, 128 codes). The 16 bf16 pairs of a group (pair p = codes 2p, 2p + 1) feed the 8 MMAs of the superblock:
MMA u takes pair 2u as the lane's k positions (2t, 2t + 1) and pair 2u + 1 as (2t + 8, 2t + 9) -- its A registers
{row g pair 2u, row g + 8 pair 2u, row g pair 2u + 1, row g + 8 pair 2u + 1}, its B registers the activations of
token g (+ 8 per tile of 8 tokens) at the same codes. A code is unpacked with the bf16 "magic number": OR-ed into
the mantissa of 128.0 it gives 128 + q exactly; then q = (128 + q) - 128 and w = q * scale + zero in one
`fma.rn.bf16x2`, rounded once (the dequantized reference's value).

The warps of a block split K; their partial sums meet in shared memory and warp 0 writes the tile (SwiGLU: the
gate tile and its up tile in the same warp, silu(gate) * up in the epilogue). PDL as in q4_cuda.py: the first
DEPTH superblocks of weights are requested before `griddepcontrol.wait`. Layout: quant_gemm's word layout
(``qw32`` int32 [N, K / 8], bf16 ``scale`` / ``zero`` [N, K / 32]), the same buffers as the other int4 kernels,
plus, where given, its own copy of the scales and offsets (`packed_scales`: a lane's four of a superblock in one
8-byte load, the warp's in one 256-byte piece). Read from [N, K / 32] directly they cost four 2-byte loads per lane
and superblock, each from 8 rows, and those loads bound the kernel at 2-8 rows: on the H200 the packed copy made
the 8-row SwiGLU gate/up product 1.12x faster and the head 1.34x (benchmarks/q4_mma_loads_gpu.py, session 33;
CudaQ4Linear keeps the copy: 20 % more memory than the int4 weights alone, none more read per product).
Needs N (per half with SwiGLU) a multiple of 16 and K a multiple of 128 x warps.
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

from . import nvrtc
from .pdl import enabled as pdl_enabled
from .q4_cuda import _aligned

GROUP = 32
SUPER = 128  # codes per superblock: 4 groups, one per lane of a quad
MAX_ROWS = 32  # four MMA tiles of 8 tokens (ceil(rows / 8) tiles; 32 rows compile without spills)

_SRC = r"""
#define K_ {K}
#define WARPS {WARPS}
#define DEPTH {DEPTH}
#define NT {NT}
#define GLU {GLU}
#define PDL {PDL}
#define SZP {SZP}
#define XST {XST}
#define G_ (K_ / 32)
#define SPW (K_ / 128 / WARPS)
#define NR (GLU ? 2 : 1)

__device__ __forceinline__ unsigned int lop(unsigned int a, unsigned int b, unsigned int c) {{
    unsigned int r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));  // (a & b) | c
    return r;
}}

__device__ __forceinline__ unsigned int bfma2(unsigned int a, unsigned int b, unsigned int c) {{
    unsigned int r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}}

// pair j (0..3) of word w: codes at bits 4j and 16 + 4j -> the bf16 pair (q_lo, q_hi) * scale + zero
__device__ __forceinline__ unsigned int deq(unsigned int w, int j, unsigned int s2, unsigned int z2) {{
    const unsigned int v = lop(w >> (4 * j), 0x000F000Fu, 0x43004300u);  // 128 + q, exact
    const unsigned int q = bfma2(v, 0x3F803F80u, 0xC300C300u);           // (128 + q) * 1 - 128 = q, exact
    return bfma2(q, s2, z2);                                              // q * scale + zero, rounded once
}}

__device__ __forceinline__ unsigned int wordof(uint4 v, int i) {{
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}}

__device__ __forceinline__ void mma(float* c, unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                                    unsigned int b0, unsigned int b1) {{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, "
                 "{{%8, %9}}, {{%0, %1, %2, %3}};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
q4m_gemm(const uint4* __restrict__ x, const uint4* __restrict__ qw, const unsigned short* __restrict__ S,
         const unsigned short* __restrict__ Z, unsigned short* __restrict__ y, int T, int n_out, int glu_off,
         const uint2* __restrict__ SZ)
{{
    // x [T, K] bf16 as uint4 (8 codes' activations each); qw [N, G_] uint4 (a group's 4 words); y [T, n_out];
    // SZ (SZP): the scales and offsets again, packed per (16-row tile, superblock) in lane order (packed_scales)
#if WARPS > 1
    __shared__ float red[WARPS - 1][4 * NT * NR][32];
#endif
#if XST
    __shared__ uint4 xst[WARPS][4 * (32 * NT + 1)];  // a warp's staged activations of one superblock (see below)
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16;
    long roff[NR][2];  // the lane's rows g and g + 8 of the gate (and up) tile, in groups
    #pragma unroll
    for (int r = 0; r < NR; r++) {{
        #pragma unroll
        for (int h = 0; h < 2; h++) roff[r][h] = (long)(n0 + g + 8 * h + (r ? glu_off : 0)) * G_;
    }}
    const int s0 = warp * SPW;  // this warp's first superblock
    uint4 wq[DEPTH][NR][2];
#if SZP
    // lane (g, t)'s (scale, offset) of rows g and g + 8, group 4 s + t: one 8-byte load, the warp's 256 bytes in one
    // piece (S / Z directly: four 2-byte loads from 8 rows each, which bound the kernel at 2-8 rows)
    uint2 szv[DEPTH][NR];
    const uint2* szr[NR];
    #pragma unroll
    for (int r = 0; r < NR; r++) szr[r] = SZ + ((long)(blockIdx.x + (r ? glu_off / 16 : 0)) * (K_ / 128)) * 32 + lane;
#else
    unsigned short sc[DEPTH][NR][2], zc[DEPTH][NR][2];
#endif
    #pragma unroll
    for (int d = 0; d < DEPTH; d++) {{
        const int gi = 4 * (s0 + d) + t;
        #pragma unroll
        for (int r = 0; r < NR; r++) {{
            #pragma unroll
            for (int h = 0; h < 2; h++) {{
                wq[d][r][h] = __ldg(qw + roff[r][h] + gi);
#if !SZP
                sc[d][r][h] = __ldg(S + roff[r][h] + gi);
                zc[d][r][h] = __ldg(Z + roff[r][h] + gi);
#endif
            }}
#if SZP
            szv[d][r] = __ldg(szr[r] + 32 * (s0 + d));
#endif
        }}
    }}
#if PDL
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    float acc[NT][NR][4];
    #pragma unroll
    for (int nt = 0; nt < NT; nt++) {{
        #pragma unroll
        for (int r = 0; r < NR; r++) {{
            #pragma unroll
            for (int e = 0; e < 4; e++) acc[nt][r][e] = 0.0f;
        }}
    }}
    #pragma unroll
    for (int s = 0; s < SPW; s++) {{
        const int slot = s % DEPTH;
        const int gi = 4 * (s0 + s) + t;
        uint4 w[NR][2];
        unsigned int s2[NR][2], z2[NR][2];
        #pragma unroll
        for (int r = 0; r < NR; r++) {{
            #pragma unroll
            for (int h = 0; h < 2; h++) {{
                w[r][h] = wq[slot][r][h];
#if SZP
                const unsigned int v = h ? szv[slot][r].y : szv[slot][r].x;  // (scale, offset) -> both pairs
                s2[r][h] = __byte_perm(v, 0u, 0x1010);
                z2[r][h] = __byte_perm(v, 0u, 0x3232);
#else
                s2[r][h] = (unsigned int)sc[slot][r][h] * 0x10001u;
                z2[r][h] = (unsigned int)zc[slot][r][h] * 0x10001u;
#endif
            }}
        }}
        if (s + DEPTH < SPW) {{  // refill the slot DEPTH superblocks ahead
            #pragma unroll
            for (int r = 0; r < NR; r++) {{
                #pragma unroll
                for (int h = 0; h < 2; h++) {{
                    wq[slot][r][h] = __ldg(qw + roff[r][h] + gi + 4 * DEPTH);
#if !SZP
                    sc[slot][r][h] = __ldg(S + roff[r][h] + gi + 4 * DEPTH);
                    zc[slot][r][h] = __ldg(Z + roff[r][h] + gi + 4 * DEPTH);
#endif
                }}
#if SZP
                szv[slot][r] = __ldg(szr[r] + 32 * (s0 + s + DEPTH));
#endif
            }}
        }}
        // the activations of token g (+ 8 nt) at the group's 32 codes: 16 pairs in 4 uint4. Coherent loads that
        // stay in L1 (__ldca: every block on the SM reads the same x): x is written by the kernel before, and a
        // read-only (.nc, __ldg) load here was moved above griddepcontrol.wait by ptxas -- reading x before it was
        // written (found in session 31); __ldcg (L2 only) was safe too, but 1.2-1.6x slower at 4-16 rows
        uint4 xv[NT][4];
#if XST
        // staged (XST): the warp loads the superblock's activations whole (16 lanes per token, 256 contiguous bytes)
        // and puts them in fragment order in shared memory (plane i, token, group t; planes padded by 16 bytes
        // against bank conflicts), then each lane reads its pieces back: the direct loads below touch 2 cache
        // lines per token and load (16 bytes at a 64-byte stride), which bound the kernel at 8-16 rows
        __syncwarp();  // (the previous superblock's reads are done)
        #pragma unroll
        for (int e0 = 0; e0 < 8 * NT * 16; e0 += 32) {{
            const int e = e0 + lane, tk = e >> 4, p = e & 15;  // piece p = 4 t' + i' of token tk
            const uint4 v = tk < T ? __ldca(x + (long)tk * (K_ / 8) + (long)(s0 + s) * 16 + p)
                                   : make_uint4(0u, 0u, 0u, 0u);
            xst[warp][(p & 3) * (32 * NT + 1) + tk * 4 + (p >> 2)] = v;
        }}
        __syncwarp();
        #pragma unroll
        for (int nt = 0; nt < NT; nt++) {{
            #pragma unroll
            for (int i = 0; i < 4; i++) xv[nt][i] = xst[warp][i * (32 * NT + 1) + (g + 8 * nt) * 4 + t];
        }}
#else
        #pragma unroll
        for (int nt = 0; nt < NT; nt++) {{
            const int tok = g + 8 * nt;
            #pragma unroll
            for (int i = 0; i < 4; i++)
                xv[nt][i] = tok < T ? __ldca(x + (long)tok * (K_ / 8) + gi * 4 + i) : make_uint4(0u, 0u, 0u, 0u);
        }}
#endif
        #pragma unroll
        for (int u = 0; u < 8; u++) {{  // MMA u: pairs 2u and 2u + 1 = word u / 2, pairs j and j + 1
            const int i = u >> 1, j = 2 * (u & 1);
            #pragma unroll
            for (int r = 0; r < NR; r++) {{
                const unsigned int w0 = wordof(w[r][0], i), w1 = wordof(w[r][1], i);
                const unsigned int a0 = deq(w0, j, s2[r][0], z2[r][0]), a1 = deq(w1, j, s2[r][1], z2[r][1]);
                const unsigned int a2 = deq(w0, j + 1, s2[r][0], z2[r][0]), a3 = deq(w1, j + 1, s2[r][1], z2[r][1]);
                #pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    mma(acc[nt][r], a0, a1, a2, a3, wordof(xv[nt][i], j), wordof(xv[nt][i], j + 1));
            }}
        }}
    }}
#if WARPS > 1
    if (warp > 0) {{
        #pragma unroll
        for (int nt = 0; nt < NT; nt++) {{
            #pragma unroll
            for (int r = 0; r < NR; r++) {{
                #pragma unroll
                for (int e = 0; e < 4; e++) red[warp - 1][(nt * NR + r) * 4 + e][lane] = acc[nt][r][e];
            }}
        }}
    }}
    __syncthreads();
    if (warp > 0) return;
    #pragma unroll
    for (int o = 0; o < WARPS - 1; o++) {{
        #pragma unroll
        for (int nt = 0; nt < NT; nt++) {{
            #pragma unroll
            for (int r = 0; r < NR; r++) {{
                #pragma unroll
                for (int e = 0; e < 4; e++) acc[nt][r][e] += red[o][(nt * NR + r) * 4 + e][lane];
            }}
        }}
    }}
#endif
    // C registers: e = 0, 1: row g, tokens 2t, 2t + 1 (+ 8 nt); e = 2, 3: row g + 8
    #pragma unroll
    for (int nt = 0; nt < NT; nt++) {{
        #pragma unroll
        for (int e = 0; e < 4; e++) {{
            const int tok = 8 * nt + 2 * t + (e & 1), row = n0 + g + 8 * (e >> 1);
            float v = acc[nt][0][e];
#if GLU
            v = v / (1.0f + __expf(-v)) * acc[nt][1][e];
#endif
            if (tok < T) {{
                unsigned short b;
                asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
                y[(long)tok * n_out + row] = b;
            }}
        }}
    }}
}}
"""


def default_warps(k: int) -> int:
    """Warps per block (splitting K): as many of 8, 4, 2, 1 as divide K's superblocks evenly."""
    for w in (8, 4, 2, 1):
        if k % (SUPER * w) == 0:
            return w
    return 1


def fits(m: int, n_out: int, k: int) -> bool:
    """Whether a product of m rows, n_out outputs (per half with SwiGLU) and width k can run here."""
    return 1 <= m <= MAX_ROWS and n_out % 16 == 0 and k % SUPER == 0


def available(t: torch.Tensor | None = None) -> bool:
    """NVRTC usable (kernels/nvrtc.py) and not switched off with FORERUN_Q4_MMA=0 (then tuned entries naming it
    ("m") fall back to the Triton entries kept beside them). Its first version read the activations with __ldg,
    which ptxas moved above griddepcontrol.wait in some configurations (tests/test_gpu.py's PDL chain test failed
    on the H200, session 31); they are read with __ldca now, and tests/test_q4_mma.py checks the machine code."""
    return os.environ.get("FORERUN_Q4_MMA", "1") != "0" and nvrtc.available(t)


def source(k: int, warps: int, depth: int, tiles: int, glu: bool, pdl: bool, packed: bool = False,
           staged: bool = False) -> str:
    return _SRC.format(K=k, WARPS=warps, DEPTH=depth, NT=tiles, GLU=int(glu), PDL=int(pdl), SZP=int(packed),
                       XST=int(staged))


def staged_fits(warps: int, tiles: int, glu: bool) -> bool:
    """Whether the staged activations (XST) can run: up to 2 tiles (16 rows; at 4 tiles with SwiGLU the kernel
    spills registers), and with the warps' partial sums within the 48 KB of static shared memory."""
    stage = warps * 4 * (32 * tiles + 1) * 16
    red = (warps - 1) * 4 * tiles * (2 if glu else 1) * 32 * 4
    return tiles <= 2 and stage + red <= 48 * 1024


def packed_scales(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor | None:
    """The kernel's own copy of the scales and offsets [N, K / 32] (bf16): per 16-row tile and superblock, for lane
    4 g + t of a warp, (scale, offset) of row g then of row g + 8 at group 4 s + t -- int32 [N / 16, K / 128, 32, 2]
    (each int32 a bf16 scale in its low half, the offset in its high half). One 8-byte load per lane replaces four
    2-byte loads from 8 rows each, which bound the kernel at 2-8 rows (benchmarks/q4_mma_loads_gpu.py). None
    where the shape cannot be packed (N not a multiple of 16, K not of 128)."""
    n, groups = scale.shape
    if n % 16 or groups % 4 or zero.shape != scale.shape or scale.dtype != torch.bfloat16 \
            or zero.dtype != torch.bfloat16:
        return None
    sz = torch.stack([scale, zero], -1).view(n // 16, 2, 8, groups // 4, 4, 2)  # [tile, h, g, s, t, (s, z)]
    return sz.permute(0, 3, 2, 4, 1, 5).contiguous().view(torch.int32).view(n // 16, groups // 4, 32, 2)


@functools.lru_cache(maxsize=None)
def _kernel_on(device: int, *config):
    return nvrtc.kernel(source(*config), "q4m_gemm")


def q4m_linear(x: torch.Tensor, qw32: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, glu: bool = False,
               warps: int | None = None, depth: int | None = None, pdl: bool | None = None,
               packed: torch.Tensor | None = None, staged: bool = False) -> torch.Tensor:
    """y = x @ W^T for 1..32 bf16 rows x [M, K] and W in quant_gemm's int4 word layout (glu: W holds gate rows then
    up rows, y = silu(x @ gate^T) * (x @ up^T)); bf16 [M, N] (or N / 2). warps: per block, splitting K; depth:
    superblocks of weights in flight per lane (at most K / 128 / warps); packed: `packed_scales(scale, zero)`, read
    instead of scale and zero when given (the same values: the same result bit for bit, faster); staged: the
    activations go through shared memory (XST above; the same result bit for bit) where that fits the 48 KB of
    static shared memory (`staged_fits`), else they are loaded directly."""
    m, k = x.shape
    n = qw32.shape[0]
    n_out = n // 2 if glu else n
    warps = warps or default_warps(k)
    spw = k // SUPER // warps if k % (SUPER * warps) == 0 else 0
    if not fits(m, n_out, k) or not spw or x.dtype != torch.bfloat16 or qw32.shape[1] * 8 != k \
            or (glu and n % 2) or scale.dtype != torch.bfloat16 or zero.dtype != torch.bfloat16:
        raise ValueError(f"q4m_linear: takes 1..{MAX_ROWS} bf16 rows, N (per half) a multiple of 16, K a multiple of "
                         f"{SUPER} x warps and bf16 scales; got x {tuple(x.shape)} {x.dtype}, qw32 "
                         f"{tuple(qw32.shape)}, warps {warps}, scale {scale.dtype}")
    depth = max(1, min(depth or 4, spw))
    x = _aligned(x)  # (rows read 16 bytes at a time)
    pdl = pdl_enabled(x) if pdl is None else pdl
    if packed is not None and (packed.shape != (n // 16, k // SUPER, 32, 2) or packed.dtype != torch.int32
                               or not packed.is_contiguous()):
        raise ValueError(f"q4m_linear: packed scales must be packed_scales(scale, zero), int32 "
                         f"{(n // 16, k // SUPER, 32, 2)}; got {packed.dtype} {tuple(packed.shape)}")
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    with torch.cuda.device(x.device):
        tiles = -(-m // 8)
        kern = _kernel_on(torch.cuda.current_device(), k, warps, depth, tiles, glu, pdl, packed is not None,
                          bool(staged) and staged_fits(warps, tiles, glu))
        nvrtc.launch(kern, n_out // 16, 32 * warps, 0,
                     [x, qw32, scale, zero, y, m, n_out, n_out, packed if packed is not None else ctypes.c_void_p(0)],
                     pdl)
    return y
