"""A weight stream apart from the products: a resident L2 prefetcher beside the chain of int4 products (issue 12,
session 54).

The engine's 145 chained 1-row products of the 8B shape lose ~1.5-1.8 us each to their boundaries (the PDL
hand-over, the activation row's conversion, the slowest blocks' tail: q4_block_timing_gpu.py), and during those
microseconds the memory is not streaming. A persistent kernel that keeps streaming across its own barriers lost to
the per-product kernels (q4_stream_gpu.py, session 51), and a product that prefetches the next one's weights
into L2 is delayed, because a kernel does not complete before its bulk prefetches land (session 50). This
benchmark keeps the engine's kernels and moves the stream into a second, persistent kernel on a parallel branch of
the CUDA graph, which never has to complete early:

  * the products are the engine's 1-row kernel (q4_cuda.py, the card's tuned table, PDL), changed by source edit
    in one place: lane 0 of each warp adds 1 (`red.relaxed.gpu`, no return) after its stores to one of 32
    progress counters (block b's warps to counter b % 32);
  * the prefetcher (PF_BLOCKS blocks of one warp) walks the chain's weight bytes in the order the products' blocks
    read them (block by block: codes, scales, offsets of the block's rows; the up rows beside the gate rows),
    in chunks of at most 16 KB, and issues `cp.async.bulk.prefetch.L2.global` for each chunk as soon as the
    progress counter says the products have consumed all but AHEAD bytes before its end (the warps' progress
    mapped to bytes at each product's mean bytes a warp); so the memory keeps streaming AHEAD bytes in front of
    the products, through their boundaries, and the products read what has landed from L2.

Variants, interleaved (CUDA graph replays, best of the rounds): the engine's kernels; the counting kernels alone
(what the counter costs); counting kernels + a prefetcher that issues nothing (what its residency costs:
a warp on an SM can leave room for one product block fewer, the qkv and gate/up builds use 64 registers at 512
threads); + the prefetcher at several AHEAD and PF_BLOCKS; and the prefetcher alone, unthrottled (how fast bulk
L2 prefetches stream the chain's bytes). Every variant's outputs are checked bit for bit against the engine's.
Prints a table, writes JSON + PNG.

Every kernel runs at one shared-memory carveout (`--carveout`, 100 % by default; gpu.set_carveout): an SM can change
its L1 / shared-memory split only with no block resident, so with the prefetcher on every SM the down product's
blocks, which need a larger split than the others, never started (session 55: the chain stalled after layer 0's
gate/up until the prefetcher's watchdog released it; `--carveout -1` leaves the driver's choices).

    python benchmarks/q4_l2_prefetcher_gpu.py --out benchmarks/results/q4_l2_prefetcher_h200.json
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu as G  # noqa: E402
from forerun.kernels import nvrtc, q4_cuda  # noqa: E402
from forerun.models import quant_cuda  # noqa: E402
from q4_persistent_gpu import build_chain, c_config, card, chain_bytes, engine_chain, finish, time_graphs  # noqa: E402

CHUNK = 16384  # bytes of one bulk prefetch at most
_PREFETCHER = r"""
extern "C" __global__ void __launch_bounds__(32)
l2_prefetcher(const unsigned long long* __restrict__ addr, const unsigned int* __restrict__ size,
              const unsigned int* __restrict__ need, int n, const unsigned int* prog, unsigned int stop,
              unsigned int* __restrict__ dbg)
{
    // warp w takes the groups of 32 consecutive chunks w, w + gridDim.x, ...; a lane issues its chunk once the
    // products' progress (the warps done: the sum of the 32 counters) has reached the chunk's need
    const int lane = threadIdx.x;
    unsigned int seen = 0;
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (int g = blockIdx.x; g * 32 < n; g += gridDim.x) {
        const int c = g * 32 + lane;
        bool done = c >= n;
        const unsigned int want = done ? 0u : need[c];
        const unsigned long long a = done ? 0ull : addr[c];
        const unsigned int s = done ? 0u : size[c];
        while (true) {
            if (!done && seen >= want) {
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(a), "r"(s) : "memory");
                done = true;
            }
            if (__all_sync(0xffffffffu, done)) break;
            unsigned int v;  // lane l reads counter l; their sum is the warps done
            asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(prog + 32 * lane) : "memory");
            seen = __reduce_add_sync(0xffffffffu, v);
            if (seen >= stop) {  // the chain has ended: what is left would land too late
                if (lane == 0) dbg[blockIdx.x] = 1u;
                return;
            }
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            if (t - t0 > 100000000ull) {  // a watchdog (100 ms): a count that never comes would hang the graph
                if (lane == 0) dbg[blockIdx.x] = 0x80000000u | (seen & 0x7fffffffu);
                return;
            }
            if (!__any_sync(0xffffffffu, !done && seen >= want)) __nanosleep(128);
        }
    }
}
"""


def counting_source(k: int, rows: int, warps: int, depth: int, glu: bool) -> str:
    """q4_cuda's plain PDL kernel, lane 0 of each warp adding 1 to a progress counter after its stores
    (AssertionError if the source moved)."""
    src = q4_cuda.source(k, rows, warps, depth, glu, True)
    old = "int n_part)"
    assert src.count(old) == 1, "q4_cuda's source moved"
    src = src.replace(old, "int n_part, unsigned int* __restrict__ prog)")
    end = src.rindex("\n}\n")
    # 32 counters, 128 bytes apart, block b's warps adding to counter b % 32: one counter took every warp's add
    # in turn (the first run: the chain 0.09 ms slower; same-address atomics are performed one at a time)
    tail = ('\n    if (lane == 0) asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" :: '
            '"l"(prog + 32 * (blockIdx.x & 31)) : "memory");')
    return src[:end] + tail + src[end:]


def plan(prods, table) -> tuple[list, list]:
    """The counting launches and the chain's bytes in the order the products' blocks read them: per product
    (kernel, blocks, threads, smem, args), and per product a list of (address, bytes) ranges, block by block."""
    launches, ranges = [], []
    for qw, s, z, x, y, glu in prods:
        n, k = y.shape[1], x.shape[1]
        cfg = c_config(table, n, k, glu)
        rows, warps, depth = cfg["rows"], cfg["warps"], cfg["depth"]
        kern = nvrtc.kernel(counting_source(k, rows, warps, depth, glu), "q4c_gemv")
        per_block = rows * warps
        blocks = -(-n // per_block)
        launches.append((kern, blocks, warps, q4_cuda.smem_bytes(k), (x, qw, s, z, y, n)))
        code_row, scale_row = k // 2, k // 16  # bytes of one row: int4 codes, bf16 scales (offsets the same)
        r = []
        for b in range(blocks):
            r0, r1 = b * per_block, min((b + 1) * per_block, n)
            for base in ((0, n) if glu else (0,)):
                r.append((qw.data_ptr() + (base + r0) * code_row, (r1 - r0) * code_row))
            for t in (s, z):
                for base in ((0, n) if glu else (0,)):
                    r.append((t.data_ptr() + (base + r0) * scale_row, (r1 - r0) * scale_row))
        ranges.append((r, blocks * warps))
    return launches, ranges


def chunk_table(ranges, ahead: int, dev: str = "cuda", chunk: int = CHUNK
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(addresses, sizes, needs): the chain's bytes in chunks of at most `chunk` bytes, and for each the progress count
    (warps done) after which it may be requested: the first at which the bytes consumed, counted at each
    product's mean bytes a warp, reach the chunk's end minus `ahead`."""
    addr, size, ends = [], [], []
    consumed_at = [np.zeros(1)]  # bytes consumed after P warps: piecewise linear over the products
    total = 0
    for r, nwarps in ranges:
        start = total
        for a, nb in r:
            for o in range(0, nb, chunk):
                addr.append(a + o)
                size.append(min(chunk, nb - o))
                total += size[-1]
                ends.append(total)
        consumed_at.append(start + (total - start) * np.arange(1, nwarps + 1) / nwarps)
    consumed = np.concatenate(consumed_at)
    need = np.searchsorted(consumed, np.asarray(ends, dtype=np.float64) - ahead, side="left")
    assert all(a % 16 == 0 for a in addr) and all(s % 16 == 0 for s in size), "bulk prefetches take 16 B units"
    return (torch.tensor(addr, dtype=torch.int64, device=dev), torch.tensor(size, dtype=torch.int32, device=dev),
            torch.tensor(np.minimum(need, 2 ** 31 - 1), dtype=torch.int32, device=dev))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/q4_l2_prefetcher.json")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ahead", default="2,4,8,16", help="MB the prefetcher runs ahead of the products")
    ap.add_argument("--blocks", default="32,132", help="prefetcher blocks (one warp each)")
    ap.add_argument("--carveout", type=int, default=100,
                    help="every kernel's preferred shared-memory carveout, %% (gpu.set_carveout; -1: the driver's)")
    args = ap.parse_args()
    if (dev := card()) is None:
        return 1
    name, sms, bw, table = dev
    quant_cuda.set_configs(name, table)
    h, prods = build_chain(args.layers)
    wbytes = chain_bytes(prods)
    floor = wbytes / bw * 1e3
    launches, ranges = plan(prods, table)
    assert sum(nb for r, _ in ranges for _, nb in r) == wbytes
    pf_kern = nvrtc.kernel(_PREFETCHER, "l2_prefetcher")
    prog = torch.zeros(32 * 32, dtype=torch.int32, device="cuda")  # 32 counters, 128 bytes apart
    total_warps = sum(nw for _, nw in ranges)
    dbg = torch.zeros(1024, dtype=torch.int32, device="cuda")  # per prefetcher warp: 1 left at the chain's end,
    # 0x80000000 | the count seen where the watchdog fired, 0 when it issued its chunks and returned
    side = torch.cuda.Stream()
    null, zero = ctypes.c_void_p(0), ctypes.c_float(0.0)
    tables: dict = {}

    def chain_fn(pf: tuple[int, int] | tuple[int, int, int] | None, chain: bool = True):
        """The counting chain, with pf = (bytes ahead, prefetcher blocks[, chunk bytes]) beside it on a parallel
        branch of the graph (ahead < 0: a prefetcher that issues nothing, resident until the chain ends), or None;
        chain False: the prefetcher alone, every chunk released at once."""
        if pf is not None and pf not in tables:
            a, sz, need = chunk_table(ranges, max(pf[0], 0), chunk=pf[2] if len(pf) > 2 else CHUNK)
            if pf[0] < 0:
                need.fill_(total_warps)
            if not chain:
                need.zero_()
            tables[pf] = (a, sz, need)

        def run():
            prog.zero_()
            cur = torch.cuda.current_stream()
            if pf is not None:
                a, sz, need = tables[pf]
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    nvrtc.launch(pf_kern, pf[1], 32, 0, [a, sz, need, a.numel(), prog, total_warps, dbg], False)
            if chain:
                for kern, blocks, warps, smem, (x, qw, s, z, y, n) in launches:
                    nvrtc.launch(kern, blocks, 32 * warps, smem,
                                 [x, qw, s, z, y, n, n, null, null, null, zero, null, null, 0, prog], True)
            if pf is not None:
                cur.wait_stream(side)
        return run

    engine = engine_chain(h, prods, table)

    def engine_run():  # the engine's kernels
        prog.zero_()  # (the same memset node as the other variants)
        engine()

    # the check: every variant's outputs equal the engine's bit for bit (bit patterns: random layers overflow)
    engine_chain(h, prods, table, write=True)()  # (their outputs copied into the products' buffers)
    torch.cuda.synchronize()
    ref = [y.clone() for *_, y, _ in prods]
    if args.carveout != -1:  # (every kernel is compiled by now)
        G.log(f"shared-memory carveout {args.carveout} % on {G.set_carveout(args.carveout)} kernels")
    ahead_mb = [int(v) for v in args.ahead.split(",")]
    pf_blocks = [int(v) for v in args.blocks.split(",")]
    variants = {"engine's kernels": engine_run, "counting kernels": chain_fn(None),
                f"counting kernels + an idle prefetcher ({pf_blocks[-1]} warps)": chain_fn((-1, pf_blocks[-1]))}
    for nb in pf_blocks:
        for mb in ahead_mb:
            variants[f"counting kernels + prefetcher {mb} MB ahead, {nb} warps"] = chain_fn((mb << 20, nb))
    for kb in (4, 64):  # other chunk sizes at one setting
        variants[f"counting kernels + prefetcher 8 MB ahead, {pf_blocks[-1]} warps, {kb} KB chunks"] = chain_fn(
            (8 << 20, pf_blocks[-1], kb << 10))
    checks = {}
    for label, fn in variants.items():
        if label == "engine's kernels":
            continue
        for *_, y, _ in prods:
            y.zero_()
        fn()
        torch.cuda.synchronize()
        bad = [i for i, ((*_, y, _), r) in enumerate(zip(prods, ref))
               if not torch.equal(y.view(torch.int16), r.view(torch.int16))]
        checks[label] = dict(identical=not bad, first_products_differing=bad[:5])
        fired = int(((dbg.view(torch.int32) < 0)).sum())
        G.log(f"{label}: outputs == the engine's: {not bad}; counted {int(prog.sum())} of {total_warps} warps; "
              f"watchdog fired in {fired} prefetcher warps" + (f" (count seen {int(dbg.min()) & 0x7fffffff})"
                                                                 if fired else ""))
        assert not fired, f"{label}: the prefetcher's watchdog fired"
        dbg.zero_()
        assert not bad, f"{label}: outputs differ from the engine's kernels in products {bad[:5]}"
    for nb in pf_blocks:  # (outputs: none)
        variants[f"prefetcher alone, unthrottled, {nb} warps"] = chain_fn((0, nb), chain=False)
    runs = time_graphs(variants, args.repeats, floor)
    assert int(prog.sum()) in (0, total_warps), int(prog.sum())
    res = dict(device=name, torch=torch.__version__, sms=sms, copy_bw_bytes_per_s=bw, layers=args.layers,
               products=len(prods), weight_bytes=wbytes, floor_ms=floor, chunk_bytes=CHUNK, checks=checks,
               carveout=args.carveout,
               chunks=int(tables[(0, pf_blocks[0])][0].numel()))
    finish(res, runs, args.out, f"{len(prods)} chained int4 products (8B shape, 1 row) + an L2 prefetcher, {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
