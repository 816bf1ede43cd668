"""Micro-benchmark of the batched verify_chain (needs only torch).

Batches of 1, 16 and 256 requests with k = 4 drafts (5 rows each) over a 151,936-token vocabulary, rules
"greedy" (temperature 0) and "rejection" (temperature 0.8, draft probabilities given), on the CPU and,
when available, on the GPU (timed with torch.cuda.synchronize). The same run measures the copy bandwidth
of the device (bytes read + written per second by a 512 MiB clone, and by copy_ into a preallocated
tensor: on the CPU a fresh clone pays page faults, which the verifier's own allocations pay too) and
reports how fast the verifier reads the target logits ("in GB/s": logits + draft probabilities)
against both. "logits GB/s" counts each input byte once; the verifier makes several passes, so 100%
of copy bandwidth is not the ceiling of a single pass. Prints a table and writes
benchmarks/results/verify_micro_<device>.json.

    python benchmarks/verify_micro.py [--devices cpu,cuda] [--vocab 151936] [--batches 1,16,256]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from forerun.verify import SamplingTensors, logits_to_probs, verify_chain

K = 4  # drafts per request: k + 1 = 5 rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median seconds of fn() over `repeats` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 512 << 20, repeats: int = 5) -> tuple[float, float]:
    """Bytes read + written per second by clone() of a large float32 tensor (allocation included, as in
    the verifier), and by copy_() into a preallocated tensor."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    clone = _time(lambda: x.clone(), device, repeats)
    copy = _time(lambda: y.copy_(x), device, repeats)
    return 2 * nbytes / clone, 2 * nbytes / copy


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_batch(num_req: int, vocab: int, rule: str, device: torch.device, g: torch.Generator) -> dict:
    rows = num_req * (K + 1)
    logits = torch.randn(rows, vocab, generator=g).to(device)
    temperature = 0.0 if rule == "greedy" else 0.8
    sampling = SamplingTensors(torch.full((num_req,), temperature, device=device),
                               torch.zeros(num_req, dtype=torch.long, device=device),
                               torch.ones(num_req, device=device), torch.zeros(num_req, device=device))
    draft_probs = None
    drafts = logits.argmax(-1)  # greedy: every draft agrees, the whole chain is walked
    if rule != "greedy":
        s = sampling
        t = torch.full((rows,), temperature, device=device)
        draft_probs = logits_to_probs(logits + 0.5, t, s.top_k.repeat_interleave(K + 1), s.top_p.repeat_interleave(K + 1),
                                      s.min_p.repeat_interleave(K + 1))
        drafts = torch.multinomial(draft_probs, 1).squeeze(1)
    drafts.view(num_req, K + 1)[:, -1] = -1
    return dict(target_logits=logits, draft_token_ids=drafts,
                first_token_positions=torch.arange(num_req, device=device) * (K + 1),
                seqlens_q=torch.full((num_req,), K + 1, device=device), sampling=sampling,
                uniforms=torch.rand(rows, 2, generator=g).to(device), draft_probs=draft_probs, rule=rule,
                max_q=K + 1, nextn=K)


def run_device(device: torch.device, vocab: int, batches: list[int]) -> dict:
    g = torch.Generator().manual_seed(0)
    bandwidth, copy_into = copy_bandwidth(device)
    results = []
    for num_req in batches:
        for rule in ("greedy", "rejection"):
            batch = make_batch(num_req, vocab, rule, device, g)
            repeats = 3 if device.type == "cpu" and num_req >= 256 else (5 if device.type == "cpu" else 20)
            seconds = _time(lambda: verify_chain(**batch), device, repeats)
            logits_bytes = batch["target_logits"].numel() * 4
            input_bytes = logits_bytes + (0 if batch["draft_probs"] is None else batch["draft_probs"].numel() * 4)
            results.append(dict(batch=num_req, rows=num_req * (K + 1), rule=rule, ms=seconds * 1e3,
                                logits_gbps=logits_bytes / seconds / 1e9, input_gbps=input_bytes / seconds / 1e9,
                                logits_frac_of_clone_bw=logits_bytes / seconds / bandwidth,
                                logits_frac_of_copy_bw=logits_bytes / seconds / copy_into,
                                input_frac_of_copy_bw=input_bytes / seconds / copy_into))
            del batch
    return dict(device=device.type, device_name=device_name(device), torch=torch.__version__,
                threads=torch.get_num_threads() if device.type == "cpu" else None,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                vocab=vocab, drafts_per_request=K, clone_bandwidth_gbps=bandwidth / 1e9,
                copy_bandwidth_gbps=copy_into / 1e9, results=results)


def print_table(report: dict) -> None:
    print(f"\n{report['device_name']}  torch {report['torch']}  clone {report['clone_bandwidth_gbps']:.1f} GB/s, "
          f"copy_ into a preallocated tensor {report['copy_bandwidth_gbps']:.1f} GB/s (bytes read + written)")
    print(f"{'batch':>6} {'rows':>6} {'rule':>10} {'ms':>10} {'logits GB/s':>12} {'of clone':>9} {'of copy_':>9} "
          f"{'in GB/s':>9}")
    for r in report["results"]:
        print(f"{r['batch']:>6} {r['rows']:>6} {r['rule']:>10} {r['ms']:>10.3f} {r['logits_gbps']:>12.2f} "
              f"{r['logits_frac_of_clone_bw']:>9.1%} {r['logits_frac_of_copy_bw']:>9.1%} {r['input_gbps']:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--batches", default="1,16,256")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default); on a shared, "
                    "loaded machine 1 thread avoids waiting on descheduled worker threads")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    for name in args.devices.split(","):
        report = run_device(torch.device(name), args.vocab, batches)
        print_table(report)
        out = Path(args.out_dir) / f"verify_micro_{report['device']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
