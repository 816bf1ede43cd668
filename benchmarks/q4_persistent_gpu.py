"""Would a persistent decode kernel reach #12's 75 % of the int4 floor? A measured first step: the 145 int4
products of a Qwen3-8B-shape decode step (36 layers of qkv, o, gate/up + SwiGLU, down; the head), chained as in
a forward (each product reads the one before: qkv <- h, o <- qkv[:4096] (attention's stand-in), gate/up <- o,
down <- gate/up, next qkv <- down), run three ways over the same int4 weights:

  * "Triton, one kernel per product": the engine's kernels and tuned configurations (q4_configs.json), PDL on;
  * "CUDA C++, one kernel per product (engine now)": kernels/q4_cuda.py's kernel, PDL on;
  * "persistent": ONE kernel for the whole chain: every block of the grid stays resident (blocks per SM from the
    occupancy API), walks the products in order and meets the others at a grid barrier (an atomic counter)
    between products; the same per-warp arithmetic as q4_cuda.py (its source is reused); before the barrier each
    warp asks the L2 for the weights it will read in the next product (cp.async.bulk.prefetch.L2, Hopper), so the
    memory keeps streaming while blocks wait; or (second run) each warp loads the first groups of its next rows
    into the registers of its ring before the barrier (what PDL gives a separate kernel). Variants: rows per
    warp, warps, blocks per SM, groups in flight.

Each is replayed from a CUDA graph (the counter reset inside it); results checked against the per-product CUDA
kernel's outputs on a one-layer chain. The step's products-only time in the engine (q4_step_budget_h200.json,
knock-out "products only") was 1.560 ms = 71.2 % of the floor; this measures how much of the per-kernel cost a
persistent kernel removes, before any norm, RoPE or attention is moved into it. Prints a table, writes JSON + PNG.

    python benchmarks/q4_persistent_gpu.py --out benchmarks/results/q4_persistent_h200.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu as G  # noqa: E402
from forerun.kernels import nvrtc, q4_cuda  # noqa: E402
from forerun.kernels.quant_gemm import quantize_int4, repack_int4_w32  # noqa: E402
from forerun.models import quant_cuda  # noqa: E402

H, I, V, QKV = 4096, 12288, 151936, 6144
# the per-warp helpers of q4_cuda's source (everything before its kernel), then the persistent kernel
_HELPERS = q4_cuda._SRC[: q4_cuda._SRC.index('extern "C"')]
_PERSIST = r"""
#define PF {PF}
struct Prod {{ const uint4* qw; const unsigned short* S; const unsigned short* Z; const uint4* x; unsigned short* y;
              long long meta; }};  // meta: n_out | kind << 32 (0: K 4096, 1: K 4096 SwiGLU, 2: K 12288)

__device__ __forceinline__ void l2_prefetch(const void* p, unsigned int bytes) {{
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}}

__device__ __forceinline__ unsigned int ld_acquire(const unsigned int* p) {{
    unsigned int v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}}

__device__ __forceinline__ void grid_sync(unsigned int* counter, unsigned int target) {{
    __syncthreads();
    if (threadIdx.x == 0) {{
        __threadfence();
        atomicAdd(counter, 1u);
        long spins = 0;
        while (ld_acquire(counter) < target) {{
            if (++spins > (1L << 28)) __trap();  // a block that never arrives: fail instead of hanging
        }}
    }}
    __syncthreads();
}}

// the L2 prefetch of the rows warp `gw` of `nwt` will process first in product p (its first pass of R_ rows)
template <int KK, int GL>
__device__ __forceinline__ void prefetch_rows(const Prod& p, int gw, int nwt, int lane) {{
    const int n_out = (int)(p.meta & 0xffffffff);
    const int G = KK / 32;
    const int nw = GL ? 2 * R_ : R_;
    for (int r = lane; r < nw; r += 32) {{
        int n = gw * R_ + (r % R_);
        if (n >= n_out) continue;
        long row = (long)(r < R_ ? n : n + n_out) * G;
        l2_prefetch(p.qw + row, G * 16);
        l2_prefetch(p.S + row, G * 2);
        l2_prefetch(p.Z + row, G * 2);
    }}
}}

// the first DEPTH groups of the first R_ rows (SwiGLU: and their up rows) a warp reads in a product: loaded before
// the grid barrier that precedes it (PF == 2), so they are in flight while the blocks wait
struct Ring {{ uint4 w[DEPTH][2 * R_]; unsigned short s[DEPTH][2 * R_], z[DEPTH][2 * R_]; }};

template <int KK, int GL>
__device__ __forceinline__ void fill_first(const Prod& p, int gw, int lane, Ring& ring) {{
    const int G = KK / 32, NJJ = (G + 31) / 32, NWW = GL ? 2 * R_ : R_;
    const int n_out = (int)(p.meta & 0xffffffff);
    const int row0 = gw * R_;
    #pragma unroll
    for (int r = 0; r < NWW; r++) {{
        int n = row0 + (r % R_);
        n = n < n_out ? n : 0;
        long off = (long)(r < R_ ? n : n + n_out) * G;
        #pragma unroll
        for (int j = 0; j < DEPTH && j < NJJ; j++) {{
            int g = lane + 32 * j;
            if (g < G) {{
                ring.w[j][r] = __ldg(p.qw + off + g);
                ring.s[j][r] = __ldg(p.S + off + g);
                ring.z[j][r] = __ldg(p.Z + off + g);
            }}
        }}
    }}
}}

__device__ __forceinline__ void fill_any(const Prod& p, int gw, int lane, Ring& ring) {{
    const int kind = (int)(p.meta >> 32);
    if (kind == 0) fill_first<4096, 0>(p, gw, lane, ring);
    else if (kind == 1) fill_first<4096, 1>(p, gw, lane, ring);
    else fill_first<12288, 0>(p, gw, lane, ring);
}}

template <int KK, int GL>
__device__ void product(const Prod& p, uint4* smem, int gw, int nwt, int lane, Ring& ring)
{{
    const int G = KK / 32, NJJ = (G + 31) / 32, NWW = GL ? 2 * R_ : R_;
    const int n_out = (int)(p.meta & 0xffffffff);
    uint4* xq = smem;
    float* gsum = (float*)(smem + 4 * G);
    for (int base = 0; base < 4 * G; base += WARPS * 32) {{
        const int i = base + threadIdx.x;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (i < 4 * G) v = __ldcg(p.x + i);  // from L2: written by other SMs since the barrier (no stale L1)
        float a0 = bf2f(v.x & 0xFFFF), a1 = bf2f(v.x >> 16), a2 = bf2f(v.y & 0xFFFF), a3 = bf2f(v.y >> 16);
        float a4 = bf2f(v.z & 0xFFFF), a5 = bf2f(v.z >> 16), a6 = bf2f(v.w & 0xFFFF), a7 = bf2f(v.w >> 16);
        store_word(xq, gsum, G, i, i < 4 * G, a0, a1, a2, a3, a4, a5, a6, a7);
    }}
    __syncthreads();
    for (int w0 = gw; w0 * R_ < n_out; w0 += nwt) {{
        const int row0 = w0 * R_;
        long rowoff[NWW];
        #pragma unroll
        for (int r = 0; r < NWW; r++) {{
            int n = row0 + (r % R_);
            n = n < n_out ? n : 0;
            rowoff[r] = (long)(r < R_ ? n : n + n_out) * G;
        }}
        uint4 (&wbuf)[DEPTH][2 * R_] = ring.w;  // the ring of groups in flight (PF == 2: filled before the barrier)
        unsigned short (&sbuf)[DEPTH][2 * R_] = ring.s;
        unsigned short (&zbuf)[DEPTH][2 * R_] = ring.z;
        if (!(PF == 2 && w0 == gw)) {{
            #pragma unroll
            for (int j = 0; j < DEPTH && j < NJJ; j++) {{
                int g = lane + 32 * j;
                if (g < G) {{
                    #pragma unroll
                    for (int r = 0; r < NWW; r++) {{
                        wbuf[j][r] = __ldg(p.qw + rowoff[r] + g);
                        sbuf[j][r] = __ldg(p.S + rowoff[r] + g);
                        zbuf[j][r] = __ldg(p.Z + rowoff[r] + g);
                    }}
                }}
            }}
        }}
        float acc[NWW];
        #pragma unroll
        for (int r = 0; r < NWW; r++) acc[r] = 0.0f;
        #pragma unroll
        for (int j = 0; j < NJJ; j++) {{
            const int slot = j % DEPTH;
            const int g = lane + 32 * j;
            uint4 w[NWW];
            unsigned short sc[NWW], zc[NWW];
            #pragma unroll
            for (int r = 0; r < NWW; r++) {{ w[r] = wbuf[slot][r]; sc[r] = sbuf[slot][r]; zc[r] = zbuf[slot][r]; }}
            if (j + DEPTH < NJJ) {{
                int gn = g + 32 * DEPTH;
                if (gn < G) {{
                    #pragma unroll
                    for (int r = 0; r < NWW; r++) {{
                        wbuf[slot][r] = __ldg(p.qw + rowoff[r] + gn);
                        sbuf[slot][r] = __ldg(p.S + rowoff[r] + gn);
                        zbuf[slot][r] = __ldg(p.Z + rowoff[r] + gn);
                    }}
                }}
            }}
            if (g < G) {{
                uint4 x0 = xq[g], x1 = xq[G + g], x2 = xq[2 * G + g], x3 = xq[3 * G + g];
                float xs = gsum[g];
                #pragma unroll
                for (int r = 0; r < NWW; r++) {{
                    float d = (h2sum(word_dot(w[r].x, x0, 0u)) + h2sum(word_dot(w[r].y, x1, 0u)))
                            + (h2sum(word_dot(w[r].z, x2, 0u)) + h2sum(word_dot(w[r].w, x3, 0u)));
                    acc[r] = fmaf(d, 16.0f * bf2f(sc[r]), fmaf(bf2f(zc[r]), xs, acc[r]));
                }}
            }}
        }}
        #pragma unroll
        for (int r = 0; r < NWW; r++) {{
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
        }}
        #pragma unroll
        for (int r = 0; r < R_; r++) {{
            if (lane == r && row0 + r < n_out) {{
                float v = acc[r];
                if (GL) v = v / (1.0f + __expf(-v)) * acc[GL ? R_ + r : r];
                unsigned short b;
                asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
                p.y[row0 + r] = b;
            }}
        }}
    }}
}}

__device__ __forceinline__ void prefetch_any(const Prod& p, int gw, int nwt, int lane) {{
    const int kind = (int)(p.meta >> 32);
    if (kind == 0) prefetch_rows<4096, 0>(p, gw, nwt, lane);
    else if (kind == 1) prefetch_rows<4096, 1>(p, gw, nwt, lane);
    else prefetch_rows<12288, 0>(p, gw, nwt, lane);
}}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
q4c_persistent(const Prod* __restrict__ prods, int num, unsigned int* counter)
{{
    extern __shared__ uint4 smem[];
    const int lane = threadIdx.x & 31;
    const int gw = blockIdx.x * WARPS + (threadIdx.x >> 5), nwt = gridDim.x * WARPS;
    Ring ring;
    if (PF == 1) prefetch_any(prods[0], gw, nwt, lane);
    if (PF == 2) fill_any(prods[0], gw, lane, ring);
    for (int i = 0; i < num; i++) {{
        const Prod p = prods[i];
        const int kind = (int)(p.meta >> 32);
        if (kind == 0) product<4096, 0>(p, smem, gw, nwt, lane, ring);
        else if (kind == 1) product<4096, 1>(p, smem, gw, nwt, lane, ring);
        else product<12288, 0>(p, smem, gw, nwt, lane, ring);
        if (i + 1 < num) {{
            if (PF == 1) prefetch_any(prods[i + 1], gw, nwt, lane);
            if (PF == 2) fill_any(prods[i + 1], gw, lane, ring);
            grid_sync(counter, (unsigned int)(i + 1) * gridDim.x);
        }}
    }}
}}
"""
KIND = {(H, False): 0, (H, True): 1, (I, False): 2}


def compile_persistent(rows: int, warps: int, depth: int, pf: int):
    # K / GLU of the helpers' macros are unused by the persistent kernel (templates); set to valid values
    src = (_HELPERS.format(K=4096, R=rows, WARPS=warps, DEPTH=depth, GLU=0, PDL=0, NORM=0, SPLIT=0, NP=1, ADD=0, DP4A=0)
           + _PERSIST.format(PF=int(pf)))
    return torch.cuda._compile_kernel(src, "q4c_persistent")


def occupancy(kern, threads: int, smem: int) -> int:
    lib = torch.cuda._utils._get_gpu_runtime_library()
    n = ctypes.c_int(0)
    rc = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), kern.func, threads, ctypes.c_size_t(smem))
    if rc != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor: CUresult {rc}")
    return n.value


def make_weights(n_rows: int, k: int, copies: int = 1):
    w = torch.randn(n_rows, k, device="cuda", dtype=torch.bfloat16) * 0.02
    qw, s, z = quantize_int4(w)
    return repack_int4_w32(qw), s.contiguous(), z.contiguous()


def build_chain(layers: int):
    """Weights and activation buffers of the products of `layers` layers + the head, chained as a forward."""
    h = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    prods = []  # (qw32, scale, zero, x, y, glu)
    x = h
    for _ in range(layers):
        qkv = torch.empty(1, QKV, device="cuda", dtype=torch.bfloat16)
        prods.append((*make_weights(QKV, H), x, qkv, False))
        o = torch.empty(1, H, device="cuda", dtype=torch.bfloat16)
        prods.append((*make_weights(H, H), qkv[:, :H], o, False))
        act = torch.empty(1, I, device="cuda", dtype=torch.bfloat16)
        prods.append((*make_weights(2 * I, H), o, act, True))
        d = torch.empty(1, H, device="cuda", dtype=torch.bfloat16)
        prods.append((*make_weights(H, I), act, d, False))
        x = d
    logits = torch.empty(1, V, device="cuda", dtype=torch.bfloat16)
    prods.append((*make_weights(V, H), x, logits, False))
    return h, prods


def descriptors(prods) -> torch.Tensor:
    rows = []
    for qw, s, z, x, y, glu in prods:
        k = x.shape[1]
        n_out = y.shape[1]
        rows.append([qw.data_ptr(), s.data_ptr(), z.data_ptr(), x.data_ptr(), y.data_ptr(),
                     n_out | (KIND[(k, glu)] << 32)])
    return torch.tensor(rows, dtype=torch.int64, device="cuda")


def chain_bytes(prods) -> int:
    """The bytes of the chain's weights (codes, scales, offsets): what its floor streams."""
    return sum(qw.numel() * 4 + s.numel() * 2 + z.numel() * 2 for qw, s, z, *_ in prods)


def card() -> tuple[str, int, float, dict] | None:
    """(device name, SMs, copy bandwidth, its tuned table from q4_configs.json); None, after saying why, where the
    CUDA kernels cannot run. (Shared by the chain benchmarks: q4_stream_gpu.py, q4_block_timing_gpu.py.)"""
    if not q4_cuda.available():
        print(f"the CUDA kernels cannot run here: {nvrtc.why_not()}")
        return None
    name = torch.cuda.get_device_name()
    return (name, torch.cuda.get_device_properties(0).multi_processor_count, G.copy_bandwidth(2.0),
            json.loads(quant_cuda.CONFIGS.read_text()).get(name, {}))


def c_config(table: dict, n: int, k: int, glu: bool) -> dict:
    """rows / warps / depth of the 1-row CUDA C++ kernel for an (n, k, glu) product: the table's entry where it names
    that kernel, else what a card without one runs (quant_cuda.default_c_config)."""
    c = table.get(quant_cuda.config_key(1, n, k, glu)) or {}
    if c.get("kernel") != "c":
        c = quant_cuda.default_c_config(n, k, glu)
    return dict(rows=c["block_n"], warps=c["num_warps"], depth=c["num_stages"])


def engine_chain(h: torch.Tensor, prods, table: dict, write: bool = False):
    """The chain through the engine's 1-row kernel (q4_cuda.q4c_linear at the table's configurations, PDL as the
    engine launches it), one launch per product, each reading the output of the one before (o: the first H of
    qkv's); write: also copy each output into the product's buffer (what the other kernels write: the check)."""
    cfgs = {(n, k, glu): c_config(table, n, k, glu) for n, k, glu in
            ((QKV, H, False), (H, H, False), (I, H, True), (H, I, False), (V, H, False))}

    def run():
        prev = h
        for qw, s, z, x, y, glu in prods:
            prev = q4_cuda.q4c_linear(prev[:, :x.shape[1]], qw, s, z, glu=glu, **cfgs[(y.shape[1], x.shape[1], glu)])
            if write:
                y.copy_(prev)
    return run


def time_graphs(variants: dict, repeats: int, floor: float) -> dict[str, list[float]]:
    """Each variant (a function launching its chain) captured in a CUDA graph, then the graphs replayed in turn,
    `repeats` rounds (the card's clocks drift): ms per round and variant."""
    graphs = {}
    for k, fn in variants.items():
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs[k] = g
    runs: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(repeats):
        for k, g in graphs.items():
            runs[k].append(G.bench_ms(g.replay, inner=10, outer=3))
            G.log(f"[{rep}] {k:60s} {runs[k][-1]:.4f} ms ({100 * floor / runs[k][-1]:.1f} %)")
    return runs


def finish(res: dict, runs: dict[str, list[float]], out: str, title: str) -> None:
    """The best of each variant's runs into res["variants"], a table printed, the JSON and a bar plot written."""
    floor = res["floor_ms"]
    res["variants"] = {k: dict(ms=min(t), runs=t, of_floor=floor / min(t)) for k, t in runs.items()}
    print(f"\n{title}, {res['weight_bytes'] / 1e9:.2f} GB, floor {floor:.3f} ms")
    print("| variant | ms | % of floor |\n| --- | --- | --- |")
    for k, v in res["variants"].items():
        print(f"| {k} | {v['ms']:.3f} | {100 * v['of_floor']:.1f} % |")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = list(res["variants"])
    ax.barh(names, [100 * res["variants"][k]["of_floor"] for k in names])
    ax.axvline(75, color="tab:red", ls=":", label="75 % (#12's goal for the whole step)")
    ax.set_xlabel("% of the weight-streaming floor")
    ax.set_title(title)
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.splitext(out)[0] + ".png", dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_persistent.json")
    ap.add_argument("--layers", type=int, default=36)
    args = ap.parse_args()
    if (dev := card()) is None:
        return 1
    name, sms, bw, table = dev
    quant_cuda.set_configs(name, table)
    smem = q4_cuda.smem_bytes(I)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")

    def persistent_fn(prods, cfg):
        kern = compile_persistent(cfg["rows"], cfg["warps"], cfg["depth"], cfg["pf"])
        occ = occupancy(kern, 32 * cfg["warps"], smem)
        if occ < 1:
            raise RuntimeError("the persistent kernel does not fit on an SM")
        per_sm = min(cfg["blocks_per_sm"], occ)
        desc = descriptors(prods)
        grid = sms * per_sm

        def run():
            counter.zero_()
            nvrtc.launch(kern, grid, 32 * cfg["warps"], smem, [desc, len(prods), counter], False)
        return run, dict(occupancy=occ, grid=grid)

    def product(x, qw, s, z, glu, triton, cuda_cfg):
        if triton:
            return quant_cuda.q4_product(x, qw, s, z, glu, quant_cuda.tuned(1, qw.shape[0] // (2 if glu else 1),
                                                                             x.shape[1], glu))
        cfg = cuda_cfg_o if (x.shape[1], qw.shape[0]) == (H, H) else cuda_cfg[(x.shape[1], glu, qw.shape[0] == V)]
        return q4_cuda.q4c_linear(x, qw, s, z, glu=glu, **cfg)

    def per_kernel_fn(h, prods, triton: bool, cuda_cfg: dict | None = None):
        """The chain as one launch per product, each reading the output of the one before (o: its first H)."""
        def run():
            was = os.environ.get("FORERUN_Q4_CUDA")
            os.environ["FORERUN_Q4_CUDA"] = "0" if triton else "1"  # the table's "c" entries fall back to Triton
            prev = h
            for qw, s, z, x, _, glu in prods:
                prev = product(prev[:, :x.shape[1]], qw, s, z, glu, triton, cuda_cfg)
            os.environ["FORERUN_Q4_CUDA"] = was or "1"
        return run

    def reference(prods, cuda_cfg):
        """The chain through the per-product CUDA kernel, each output copied into the buffer the persistent
        kernel writes (eager; the check's reference)."""
        for qw, s, z, x, y, glu in prods:
            y.copy_(product(x, qw, s, z, glu, False, cuda_cfg))

    # correctness on one layer + head: persistent == per-product CUDA kernel (same arithmetic, same order)
    h1, p1 = build_chain(1)
    cuda_cfg = {(H, False, False): c_config(table, QKV, H, False), (H, True, False): c_config(table, I, H, True),
                (I, False, False): c_config(table, H, I, False), (H, False, True): c_config(table, V, H, False)}
    cuda_cfg_o = c_config(table, H, H, False)
    reference(p1, cuda_cfg)
    ref = [y.float().clone() for *_, y, _ in p1]
    checks = {}
    for cfg in (dict(rows=2, warps=8, depth=4, pf=2, blocks_per_sm=1), dict(rows=1, warps=8, depth=4, pf=0,
                                                                           blocks_per_sm=1)):
        run, info = persistent_fn(p1, cfg)
        for *_, y, _ in p1:
            y.zero_()
        run()
        torch.cuda.synchronize()
        errs = [((y.float() - r).abs().max() / r.abs().max().clamp_min(1e-6)).item() for (*_, y, _), r in zip(p1, ref)]
        checks[str(cfg)] = dict(errs=errs, **info)
        G.log(f"check {cfg}: {info}, rel errs vs per-product kernels {['%.1e' % e for e in errs]}")
        assert max(errs) < 2e-2, errs
    del p1

    h, prods = build_chain(args.layers)
    wbytes = chain_bytes(prods)
    floor = wbytes / bw * 1e3
    variants = {"Triton, one kernel per product (engine until now)": per_kernel_fn(h, prods, True),
                "CUDA C++, one kernel per product (engine now)": per_kernel_fn(h, prods, False, cuda_cfg)}
    info = {}
    for cfg in (dict(rows=2, warps=8, depth=4, pf=0, blocks_per_sm=2),
                dict(rows=2, warps=8, depth=4, pf=1, blocks_per_sm=2),
                dict(rows=1, warps=16, depth=2, pf=0, blocks_per_sm=1),
                dict(rows=1, warps=16, depth=2, pf=2, blocks_per_sm=1),
                dict(rows=1, warps=16, depth=4, pf=2, blocks_per_sm=1),
                dict(rows=2, warps=16, depth=2, pf=2, blocks_per_sm=1),
                dict(rows=1, warps=8, depth=6, pf=2, blocks_per_sm=2),
                dict(rows=1, warps=8, depth=2, pf=2, blocks_per_sm=2),
                dict(rows=2, warps=8, depth=4, pf=2, blocks_per_sm=1),
                dict(rows=1, warps=4, depth=4, pf=2, blocks_per_sm=4)):
        label = (f"persistent, {cfg['rows']} rows x {cfg['warps']} warps, {cfg['blocks_per_sm']} blocks/SM"
                 f"{['', ', L2 prefetch', ', next weights in registers'][cfg['pf']]}, {cfg['depth']} in flight")
        try:
            variants[label], info[label] = persistent_fn(prods, cfg)
        except Exception as e:
            G.log(f"{label}: {type(e).__name__}: {str(e)[:300]}")
    runs = time_graphs(variants, 3, floor)
    res = dict(device=name, torch=torch.__version__, sms=sms, copy_bw_bytes_per_s=bw, layers=args.layers,
               products=len(prods), weight_bytes=wbytes, floor_ms=floor, checks=checks, launch=info)
    finish(res, runs, args.out, f"{len(prods)} chained int4 decode products (8B shape, 1 row), {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
