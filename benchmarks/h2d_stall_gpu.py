#!/usr/bin/env python
"""Does a small host->device copy with non_blocking=True hold the host while the GPU is busy? (#13, the EAGLE round)

The engine's rounds hand small host tensors (token ids, positions, lengths) to the GPU with
`.to(device, non_blocking=True)` while earlier work is still queued. From pageable memory the CUDA driver stages
the bytes through its own pinned buffer and, per the CUDA docs, such a copy "might be synchronous". If it waits
for the queued work, the host cannot prepare the next launches meanwhile, which shows up as idle gaps after
"Memcpy HtoD (Pageable)" in the round's profile. This queues `torch.cuda._sleep` (a known amount of GPU work),
then times on the host: the copy call from pageable memory, from pinned memory, and `torch.tensor(list, device=)`
(what `ModelRunner.prepare` did). A copy that blocks takes about as long as the queued sleep.

    python benchmarks/h2d_stall_gpu.py --out benchmarks/results/h2d_stall_h200.json

Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def host_us(make, queued_ms: float, reps: int) -> tuple[list[float], list[float]]:
    """Host time of make() issued right after queueing about queued_ms of GPU sleep (0: an idle GPU), and the
    queued work's measured length (CUDA events: the sleep is counted in cycles and the clock varies)."""
    out, queued = [], []
    cycles = int(queued_ms * 1.98e6)  # at the H200's boost clock; the events say what it was
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if queued_ms:
            torch.cuda._sleep(cycles)
        end.record()
        t0 = time.perf_counter()
        make()
        out.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        queued.append(start.elapsed_time(end) * 1e3)
    return out, queued


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/h2d_stall.json")
    ap.add_argument("--queued-ms", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ints = list(range(64))
    pageable = torch.arange(64, dtype=torch.int64)
    pinned = pageable.pin_memory()
    cases = {
        "pageable .to(non_blocking=True), 512 B": lambda: pageable.to(dev, non_blocking=True),
        "pinned .to(non_blocking=True), 512 B": lambda: pinned.to(dev, non_blocking=True),
        "torch.tensor(list, device=cuda), 512 B": lambda: torch.tensor(ints, dtype=torch.int64, device=dev),
        "torch.tensor(list).to(non_blocking=True), 512 B": lambda: torch.tensor(ints).to(dev, non_blocking=True),
        "torch.tensor(list).pin_memory().to(non_blocking=True)":
            lambda: torch.tensor(ints).pin_memory().to(dev, non_blocking=True),
    }
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, queued_ms=args.queued_ms, cases={})
    print(f"host time of the call, us (median of {args.reps}); GPU idle vs {args.queued_ms} ms of work queued")
    print("| call | idle GPU | busy GPU | work queued | waits for it? |\n| --- | --- | --- | --- | --- |")
    for name, make in cases.items():
        host_us(make, 0, 3)  # warm-up
        idle, _ = host_us(make, 0, args.reps)
        busy, queued = host_us(make, args.queued_ms, args.reps)
        blocks = statistics.median(busy) > 0.5 * statistics.median(queued)  # it waited for the queued work
        res["cases"][name] = dict(idle_us=idle, busy_us=busy, queued_us=queued, idle_median_us=statistics.median(idle),
                                  busy_median_us=statistics.median(busy), queued_median_us=statistics.median(queued),
                                  blocks=blocks)
        print(f"| {name} | {statistics.median(idle):.1f} | {statistics.median(busy):.1f} | "
              f"{statistics.median(queued):.0f} | {'yes' if blocks else 'no'} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
