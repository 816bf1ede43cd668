"""Load generator for `forerun serve`: concurrency sweep and Poisson arrivals over streaming chat requests;
TTFT / TPOT p50 and p99, throughput, speculation statistics; speculation on vs off.

Against a running server:  python benchmarks/serve.py --url http://127.0.0.1:8000
Launching the servers itself, plain then speculative, one after the other (each is SIGTERMed at the end,
which also checks a clean exit 0):
    python benchmarks/serve.py --launch qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --k 4

TTFT: request sent -> first content chunk. TPOT: (last chunk - first chunk) / (completion_tokens - 1) per
request (with speculation, tokens arrive in bursts of 1..k+1; this is the mean). Throughput: completion
tokens of all requests / wall time of the level. Greedy (temperature 0) by default, so the plain and
speculative runs must produce identical texts (reported as `identical_outputs`).
Writes benchmarks/results/<name>.json and .png.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from forerun.bench_prompts import CODE_PROMPTS  # noqa: E402


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[i]


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, temperature: float,
                      seed: int | None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_completion_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    t0 = time.perf_counter()
    first = last = None
    text, usage, status = [], None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        status = r.status_code
        if status != 200:
            await r.aread()
            return {"status": status, "error": r.text[:300]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                piece = ch.get("delta", {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    return {"status": status, "ttft": (first - t0) if first else None,
            "tpot": (last - first) / (n - 1) if first and n > 1 else None, "e2e": end - t0, "tokens": n,
            "text": "".join(text), "speculation": (usage or {}).get("speculation")}


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r.get("status") == 200]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    spec = [r["speculation"] for r in ok if r.get("speculation")]
    drafted = sum(s["drafted"] for s in spec)
    accepted = sum(s["accepted"] for s in spec)
    rounds = sum(s["rounds"] for s in spec)
    return {"requests": len(results), "ok": len(ok), "errors": [r for r in results if r.get("status") != 200][:3],
            "wall_s": wall, "completion_tokens": tokens, "throughput_tok_s": tokens / wall if wall else None,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "tpot_p50_s": _pct(tpot, 50),
            "tpot_p99_s": _pct(tpot, 99), "e2e_p50_s": _pct([r["e2e"] for r in ok], 50),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": accepted / rounds if rounds else None,
            "texts": [r["text"] for r in results if r.get("status") == 200]}


async def closed_loop(url: str, model: str, concurrency: int, prompts: list[str], max_tokens: int, temperature: float,
                      api_key: str | None) -> dict:
    """`concurrency` clients, each sending its next request as soon as the previous one ends."""
    queue = list(enumerate(prompts))
    results: list[dict | None] = [None] * len(prompts)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), headers=headers,
                                 limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        async def worker() -> None:
            while queue:
                i, p = queue.pop(0)
                results[i] = await one_request(client, model, p, max_tokens, temperature, seed=i)

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t
    return summarize(results, wall)


async def poisson(url: str, model: str, rate: float, prompts: list[str], max_tokens: int, temperature: float,
                  api_key: str | None, seed: int = 0) -> dict:
    """Open loop: request i is sent at the i-th arrival of a Poisson process of `rate` requests per second."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        t += rng.expovariate(rate)
        arrivals.append(t)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), headers=headers,
                                 limits=httpx.Limits(max_connections=len(prompts) + 2)) as client:
        start = time.perf_counter()

        async def send(i: int, p: str) -> dict:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            return await one_request(client, model, p, max_tokens, temperature, seed=i)

        results = await asyncio.gather(*(send(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - start
    return summarize(list(results), wall)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str, draft: str, k: str, threads: int, extra: list[str], log_path: str,
           timeout: float = 900.0) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "forerun.server.cli", model, "--draft", draft, "--port", str(port),
           "--max-num-seqs", "16", "--log-level", "warning", *(["--k", k] if draft != "none" else []),
           *(["--threads", str(threads)] if threads else []), *extra]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"server did not come up in {timeout:.0f}s; see {log_path}")


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return -9


def load() -> dict:
    one, five, fifteen = os.getloadavg()
    return {"loadavg_1m": one, "loadavg_5m": five, "loadavg_15m": fifteen,
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}


def run_suite(url: str, model: str, args) -> dict:
    out = {"levels": [], "poisson": None, "load_before": load()}
    # warm-up: one short request (first-call costs: oneDNN packing, allocator)
    asyncio.run(closed_loop(url, model, 1, CODE_PROMPTS[:1], 4, args.temperature, args.api_key))
    for c in args.concurrency:
        n = max(args.requests, c)
        prompts = [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(n)]
        r = asyncio.run(closed_loop(url, model, c, prompts, args.max_tokens, args.temperature, args.api_key))
        r["concurrency"] = c
        out["levels"].append(r)
        print(f"  concurrency {c}: {r['ok']}/{r['requests']} ok, {r['throughput_tok_s']:.2f} tok/s, TTFT p50 "
              f"{r['ttft_p50_s']:.2f}s p99 {r['ttft_p99_s']:.2f}s, TPOT p50 {1e3 * (r['tpot_p50_s'] or 0):.0f} ms "
              f"p99 {1e3 * (r['tpot_p99_s'] or 0):.0f} ms", flush=True)
    if args.poisson_rate > 0 and args.poisson_requests > 0:
        prompts = [CODE_PROMPTS[(i + 7) % len(CODE_PROMPTS)] for i in range(args.poisson_requests)]
        r = asyncio.run(poisson(url, model, args.poisson_rate, prompts, args.max_tokens, args.temperature,
                                args.api_key))
        r["rate_req_s"] = args.poisson_rate
        out["poisson"] = r
        print(f"  poisson {args.poisson_rate}/s: {r['ok']}/{r['requests']} ok, {r['throughput_tok_s']:.2f} tok/s, "
              f"TTFT p50 {r['ttft_p50_s']:.2f}s p99 {r['ttft_p99_s']:.2f}s, TPOT p50 "
              f"{1e3 * (r['tpot_p50_s'] or 0):.0f} ms", flush=True)
    out["load_after"] = load()
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, run in res["runs"].items():
        cs = [lv["concurrency"] for lv in run["levels"]]
        axes[0].plot(cs, [lv["throughput_tok_s"] for lv in run["levels"]], "o-", label=name)
        axes[1].plot(cs, [lv["ttft_p50_s"] for lv in run["levels"]], "o-", label=f"{name} p50")
        axes[1].plot(cs, [lv["ttft_p99_s"] for lv in run["levels"]], "x--", label=f"{name} p99")
        axes[2].plot(cs, [1e3 * (lv["tpot_p50_s"] or 0) for lv in run["levels"]], "o-", label=f"{name} p50")
        axes[2].plot(cs, [1e3 * (lv["tpot_p99_s"] or 0) for lv in run["levels"]], "x--", label=f"{name} p99")
    for ax, title, ylabel in zip(axes, ("throughput", "time to first token", "time per output token"),
                                 ("completion tok/s", "seconds", "ms")):
        ax.set_title(title)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(res["concurrency"], [str(c) for c in res["concurrency"]])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"forerun serve: {res['model']} ({res['date']}, {res['max_tokens']} tokens/request)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (then only that one is measured)")
    p.add_argument("--model", default=None, help="model id to send (default: the server's first)")
    p.add_argument("--launch", default=None, help="MODEL: launch `forerun serve MODEL` plain and with --draft")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--k", default="4")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for the launched servers")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--requests", type=int, default=4, help="requests per concurrency level (at least the level)")
    p.add_argument("--poisson-rate", type=float, default=0.2, help="requests per second (0: skip)")
    p.add_argument("--poisson-requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--name", default="serve_cpu", help="results file name (without extension)")
    args = p.parse_args(argv)
    if not args.url and not args.launch:
        p.error("give --url (a running server) or --launch MODEL")

    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "max_tokens": args.max_tokens,
           "temperature": args.temperature, "concurrency": args.concurrency, "requests_per_level": args.requests,
           "poisson_rate": args.poisson_rate, "poisson_requests": args.poisson_requests, "cpus": os.cpu_count(),
           "server_args": args.server_arg, "threads": args.threads, "runs": {}}
    out = os.path.join(REPO, "benchmarks", "results", f"{args.name}.json")
    if args.url:
        model = args.model or httpx.get(args.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        res["model"] = model
        print(f"server {args.url} ({model})", flush=True)
        res["runs"]["server"] = run_suite(args.url, model, args)
    else:
        res["model"] = args.launch
        res["draft"] = args.draft
        res["k"] = args.k
        for name, draft in (("plain", "none"), (f"spec ({args.draft}, k={args.k})", args.draft)):
            log_path = os.path.join(tempfile.gettempdir(), f"forerun_{args.name}_{name.split()[0]}.log")
            t = time.perf_counter()
            proc, url = launch(args.launch, draft, args.k, args.threads, args.server_arg, log_path)
            print(f"{name}: server up in {time.perf_counter() - t:.0f}s at {url}", flush=True)
            try:
                run = run_suite(url, args.launch, args)
            finally:
                run_code = stop(proc)
            run["exit_code_after_sigterm"] = run_code
            res["runs"][name] = run
            with open(out, "w") as f:  # after each server, so a run cut short keeps what it measured
                json.dump(res, f, indent=1)
            print(f"{name}: exit code after SIGTERM {run_code}", flush=True)
        plain, spec = list(res["runs"].values())
        if args.temperature == 0:
            pairs = [(a, b) for lp, ls in zip(plain["levels"], spec["levels"])
                     for a, b in zip(lp["texts"], ls["texts"])]
            res["identical_outputs"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        res["speedup_throughput"] = {
            str(lp["concurrency"]): ls["throughput_tok_s"] / lp["throughput_tok_s"]
            for lp, ls in zip(plain["levels"], spec["levels"]) if lp["throughput_tok_s"]}
    print()
    print(f"{'run':34s} {'conc':>5s} {'tok/s':>7s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p50':>9s} "
          f"{'TPOT p99':>9s} {'accept':>7s}")
    for name, run in res["runs"].items():
        rows = [(str(lv["concurrency"]), lv) for lv in run["levels"]]
        if run.get("poisson"):
            rows.append((f"P{run['poisson']['rate_req_s']}", run["poisson"]))
        for label, lv in rows:
            acc = f"{lv['acceptance_rate']:.2f}" if lv["acceptance_rate"] is not None else "-"
            print(f"{name[:34]:34s} {label:>5s} {lv['throughput_tok_s']:7.2f} {lv['ttft_p50_s']:8.2f}s "
                  f"{lv['ttft_p99_s']:8.2f}s {1e3 * (lv['tpot_p50_s'] or 0):7.0f}ms "
                  f"{1e3 * (lv['tpot_p99_s'] or 0):7.0f}ms {acc:>7s}")
    if "identical_outputs" in res:
        print(f"identical greedy outputs plain vs spec: {res['identical_outputs']}")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, out[:-5] + ".png")
    print(f"wrote {out} and {out[:-5]}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
