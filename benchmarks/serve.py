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

Token-id prompts (a server whose model has no vocabulary, e.g. random weights; benchmarks/serve_gpu.py):
--token-prompts LEN --vocab V sends LEN random ids per request to /v1/completions (ignore_eos), and
--json-out PATH writes only the measured suite to PATH (for a driver that runs this as a client process).
Every level is bounded in count (--requests + --requests-per-client * concurrency) and in time
(--level-timeout: requests still unfinished then are cancelled and reported as timeouts).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
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
from dataclasses import dataclass

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def code_prompts() -> tuple[str, ...]:
    from forerun.bench_prompts import CODE_PROMPTS  # lazily: forerun's package import pulls in torch

    return CODE_PROMPTS


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[i]


async def one_request(client: httpx.AsyncClient, model: str, prompt: str | list[int], max_tokens: int,
                      temperature: float, seed: int | None, extra: dict | None = None) -> dict:
    """One streaming request: a chat request for a text prompt, a completion for a list of token ids."""
    if isinstance(prompt, str):
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                              "max_completion_tokens": max_tokens}
    else:
        path, body = "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens}
    body.update(model=model, temperature=temperature, stream=True, stream_options={"include_usage": True},
                **(extra or {}))
    if seed is not None:
        body["seed"] = seed
    t0 = time.perf_counter()
    first = last = None
    text, usage, status, chunks = [], None, None, 0
    async with client.stream("POST", path, json=body) as r:
        status = r.status_code
        if status != 200:
            await r.aread()
            return {"status": status, "error": r.text[:300]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                return {"status": 500, "error": str(chunk["error"])[:300]}
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                piece = ch["delta"].get("content") if "delta" in ch else ch.get("text")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
                    text.append(piece)
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    return {"status": status, "ttft": (first - t0) if first else None,
            "tpot": (last - first) / (n - 1) if first and n > 1 else None, "e2e": end - t0, "tokens": n,
            "chunks": chunks, "text": "".join(text), "speculation": (usage or {}).get("speculation")}


async def bounded(coros: list, timeout: float) -> list[dict]:
    """Run the request coroutines together; those not finished after `timeout` seconds are cancelled (their
    streams close, so the server aborts them) and reported with status 'timeout'."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending, timeout=10)
    out = []
    for t in tasks:
        if t in pending or t.cancelled():
            out.append({"status": "timeout"})
        elif t.exception() is not None:
            out.append({"status": "exception", "error": repr(t.exception())[:300]})
        else:
            out.append(t.result())
    return out


def summarize(results: list[dict], wall: float, client_cpu: float | None = None) -> dict:
    """client_cpu: the load generator's own CPU seconds in the level (near wall_s: the client, not the
    server, may be what limits the level)."""
    ok = [r for r in results if r.get("status") == 200]
    timeouts = sum(r.get("status") == "timeout" for r in results)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    spec = [r["speculation"] for r in ok if r.get("speculation")]
    drafted = sum(s["drafted"] for s in spec)
    accepted = sum(s["accepted"] for s in spec)
    rounds = sum(s["rounds"] for s in spec)
    return {"requests": len(results), "ok": len(ok), "timeouts": timeouts,
            "errors": [r for r in results if r.get("status") not in (200, "timeout")][:3],
            "wall_s": wall, "client_cpu_s": client_cpu, "completion_tokens": tokens,
            "throughput_tok_s": tokens / wall if wall else None,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "tpot_p50_s": _pct(tpot, 50),
            "tpot_p99_s": _pct(tpot, 99), "e2e_p50_s": _pct([r["e2e"] for r in ok], 50),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": accepted / rounds if rounds else None,
            "chunks": sum(r["chunks"] for r in ok), "text_chars": sum(len(r["text"]) for r in ok),
            "texts": [r["text"] for r in results if r.get("status") == 200]}


@dataclass
class Load:
    """What every request of a suite shares."""

    url: str
    model: str
    max_tokens: int
    temperature: float
    api_key: str | None = None
    extra: dict | None = None


async def _shard(load: Load, items: list[tuple], concurrency: int | None, start_at: float,
                 timeout: float) -> tuple[dict[int, dict], float]:
    """Requests (index, prompt[, arrival]) of one client process, starting at `start_at` (time.perf_counter,
    CLOCK_MONOTONIC on Linux: the same clock in every process). Closed loop with `concurrency` workers, or
    (concurrency None) each request at its arrival offset. Returns {index: result} and this process's CPU
    seconds."""
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    cpu = time.process_time()
    results: dict[int, dict] = {}
    headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}
    conns = (concurrency if concurrency is not None else len(items)) + 2
    async with httpx.AsyncClient(base_url=load.url, timeout=httpx.Timeout(timeout + 5.0), headers=headers,
                                 limits=httpx.Limits(max_connections=conns)) as client:
        async def send(i: int, p) -> None:
            try:
                results[i] = await one_request(client, load.model, p, load.max_tokens, load.temperature, seed=i,
                                               extra=load.extra)
            except (httpx.HTTPError, ValueError, KeyError) as e:  # a broken stream: counted, the level goes on
                results[i] = {"status": "exception", "error": repr(e)[:300]}

        if concurrency is not None:
            queue = list(items)

            async def worker() -> None:
                while queue:
                    await send(*queue.pop(0)[:2])

            coros = [worker() for _ in range(concurrency)]
        else:
            async def arrive(i: int, p, at: float) -> None:
                await asyncio.sleep(max(0.0, start_at + at - time.perf_counter()))
                await send(i, p)

            coros = [arrive(*it) for it in items]
        for r in await bounded(coros, max(0.0, start_at + timeout - time.perf_counter())):
            if isinstance(r, dict) and r.get("status") == "exception":
                raise RuntimeError(f"load generator failed: {r['error']}")
    return results, time.process_time() - cpu


def _shard_process(job: tuple) -> tuple[dict[int, dict], float]:
    return asyncio.run(_shard(*job))


def run_level(load: Load, prompts: list, timeout: float, concurrency: int | None = None,
              arrivals: list[float] | None = None, pool=None, procs: int = 1) -> dict:
    """One level: a closed loop at `concurrency`, or requests at `arrivals` (seconds after the start). With a
    process pool, the requests and the workers are spread over `procs` client processes (round robin: each
    runs its own closed loop, or its own share of the arrivals), so that the client's parsing is not what
    limits a server at high concurrency; their results are merged. Requests still running `timeout` seconds
    after the start are cancelled (status 'timeout')."""
    items = [(i, p) if arrivals is None else (i, p, arrivals[i]) for i, p in enumerate(prompts)]
    shards = min(procs if pool is not None else 1, len(items), concurrency or len(items))
    jobs = []
    start_at = time.perf_counter() + (0.2 if shards > 1 else 0.0)  # every process starts at the same moment
    for s in range(shards):
        workers = None if concurrency is None else concurrency // shards + (s < concurrency % shards)
        jobs.append((load, items[s::shards], workers, start_at, timeout))
    if shards > 1:
        parts = list(pool.map(_shard_process, jobs))
    else:
        parts = [_shard_process(jobs[0])]
    wall = time.perf_counter() - start_at
    results = [{"status": "timeout"} for _ in prompts]
    for res, _ in parts:
        for i, r in res.items():
            results[i] = r
    out = summarize(results, wall, sum(cpu for _, cpu in parts))
    out["client_processes"] = shards
    return out


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append(t)
    return arrivals


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str, draft: str, k: str, threads: int, extra: list[str], log_path: str,
           timeout: float = 900.0) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "forerun.server.cli", model, "--draft", draft, "--port", str(port),
           "--max-num-seqs", "16", "--log-level", "warning", *(["--k", k] if draft != "none" else []),
           *(["--threads", str(threads)] if threads else []), *extra,
           # (the rows of earlier runs were measured without the prefix cache, the server's default since session 41)
           *([] if any("prefix-caching" in x for x in extra) else ["--no-enable-prefix-caching"])]
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
    try:
        uptime = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        uptime = None
    return {"loadavg_1m": one, "loadavg_5m": five, "loadavg_15m": fifteen, "uptime": uptime}


def make_prompts(args, n: int, offset: int = 0) -> list:
    """n prompts: the code prompts (chat), or with --token-prompts random token ids (the same for every run)."""
    if args.token_prompts:
        rng = random.Random(1000 + offset)
        return [[rng.randrange(args.vocab) for _ in range(args.token_prompts)] for _ in range(n)]
    cp = code_prompts()
    return [cp[(i + offset) % len(cp)] for i in range(n)]


def _line(label: str, r: dict) -> str:
    def f(v, scale=1.0, fmt=".2f"):
        return "-" if v is None else format(v * scale, fmt)

    bad = f", {r['timeouts']} timed out" if r.get("timeouts") else ""
    return (f"  {label}: {r['ok']}/{r['requests']} ok{bad}, {f(r['throughput_tok_s'])} tok/s, TTFT p50 "
            f"{f(r['ttft_p50_s'])}s p99 {f(r['ttft_p99_s'])}s, TPOT p50 {f(r['tpot_p50_s'], 1e3, '.1f')} ms "
            f"p99 {f(r['tpot_p99_s'], 1e3, '.1f')} ms")


def run_suite(url: str, model: str, args) -> dict:
    out = {"levels": [], "poisson": None, "skipped": [], "load_before": load()}
    end = time.perf_counter() + args.time_budget if args.time_budget else None
    base = Load(url, model, args.max_tokens, args.temperature, args.api_key,
                {"ignore_eos": True} if args.ignore_eos else None)
    pool = None
    if args.client_procs > 1:
        import concurrent.futures
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # each child imports only this script (httpx)
        pool = concurrent.futures.ProcessPoolExecutor(args.client_procs, mp_context=ctx)
        list(pool.map(time.sleep, [0.5] * args.client_procs))  # every process started before any level

    def left() -> float:  # this level's time limit: --level-timeout, or less near the end of --time-budget
        return args.level_timeout if end is None else min(args.level_timeout, end - time.perf_counter())

    def level(prompts, max_tokens=None, **kw):
        ld = base if max_tokens is None else dataclasses.replace(base, max_tokens=max_tokens)
        return run_level(ld, prompts, left(), pool=pool, procs=args.client_procs, **kw)

    try:
        # warm-up: one short request (first-call costs: oneDNN packing, allocator, kernel compilation)
        level(make_prompts(args, 1, 99), 4, concurrency=1)
        for c in args.concurrency:
            if left() < 1:
                out["skipped"].append(f"concurrency {c}")
                print(f"  concurrency {c}: skipped (--time-budget {args.time_budget:.0f}s spent)", flush=True)
                continue
            n = max(c, args.requests + args.requests_per_client * c)
            if args.warmup_tokens:  # the level's batch sizes once, short (CUDA graphs are captured on first use)
                level(make_prompts(args, 2 * c, 500), args.warmup_tokens, concurrency=c)
            r = level(make_prompts(args, n), concurrency=c)
            r["concurrency"] = c
            out["levels"].append(r)
            print(_line(f"concurrency {c}", r), flush=True)
        if args.poisson_rate > 0 and args.poisson_requests > 0:
            if left() < 1:
                out["skipped"].append("poisson")
                print("  poisson: skipped (--time-budget spent)", flush=True)
            else:
                n = args.poisson_requests
                r = level(make_prompts(args, n, 7), arrivals=poisson_arrivals(n, args.poisson_rate))
                r["rate_req_s"] = args.poisson_rate
                out["poisson"] = r
                print(_line(f"poisson {args.poisson_rate}/s", r), flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
    out["load_after"] = load()
    return out


def plot(res: dict, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG", flush=True)
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def col(run, key, scale=1.0):  # a level that measured nothing is a gap
        return [float("nan") if lv[key] is None else scale * lv[key] for lv in run["levels"]]

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, run in res["runs"].items():
        cs = [lv["concurrency"] for lv in run["levels"]]
        axes[0].plot(cs, col(run, "throughput_tok_s"), "o-", label=name)
        axes[1].plot(cs, col(run, "ttft_p50_s"), "o-", label=f"{name} p50")
        axes[1].plot(cs, col(run, "ttft_p99_s"), "x--", label=f"{name} p99")
        axes[2].plot(cs, col(run, "tpot_p50_s", 1e3), "o-", label=f"{name} p50")
        axes[2].plot(cs, col(run, "tpot_p99_s", 1e3), "x--", label=f"{name} p99")
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
    plt.close(fig)
    return True


def print_table(res: dict) -> None:
    def f(v, scale=1.0, fmt="8.2f"):
        return "-".rjust(int(fmt.split(".")[0])) if v is None else format(v * scale, fmt)

    print(f"{'run':34s} {'conc':>5s} {'ok':>7s} {'tok/s':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p50':>9s} "
          f"{'TPOT p99':>9s} {'accept':>7s}")
    for name, run in res["runs"].items():
        rows = [(str(lv["concurrency"]), lv) for lv in run["levels"]]
        if run.get("poisson"):
            rows.append((f"P{run['poisson']['rate_req_s']:g}", run["poisson"]))
        for label, lv in rows:
            acc = f"{lv['acceptance_rate']:.2f}" if lv["acceptance_rate"] is not None else "-"
            print(f"{name[:34]:34s} {label:>5s} {str(lv['ok']) + '/' + str(lv['requests']):>7s} "
                  f"{f(lv['throughput_tok_s']):>8s} {f(lv['ttft_p50_s'], 1, '8.3f')}s "
                  f"{f(lv['ttft_p99_s'], 1, '8.3f')}s "
                  f"{f(lv['tpot_p50_s'], 1e3, '7.2f')}ms {f(lv['tpot_p99_s'], 1e3, '7.2f')}ms {acc:>7s}")


def speedups(res: dict, base: str) -> dict:
    """Throughput of every other run over `base`'s, per concurrency level (and the Poisson level)."""
    plain = res["runs"].get(base)
    out = {}
    for name, run in res["runs"].items():
        if name == base or plain is None:
            continue
        base_tp = {lv["concurrency"]: lv["throughput_tok_s"] for lv in plain["levels"]}
        d = {str(lv["concurrency"]): lv["throughput_tok_s"] / base_tp[lv["concurrency"]] for lv in run["levels"]
             if base_tp.get(lv["concurrency"]) and lv["throughput_tok_s"]}
        if plain.get("poisson") and run.get("poisson") and plain["poisson"]["throughput_tok_s"]:
            d["poisson"] = (run["poisson"]["throughput_tok_s"] or 0.0) / plain["poisson"]["throughput_tok_s"]
        out[name] = d
    return out


def add_load_args(p: argparse.ArgumentParser, **defaults) -> None:
    """The load generator's options (shared with benchmarks/serve_gpu.py, which passes them on to its client)."""
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--concurrency", type=ints, default=[1, 2, 4], help="levels, e.g. 1,4,16,64")
    p.add_argument("--requests", type=int, default=4,
                   help="requests per level: max(concurrency, REQUESTS + REQUESTS_PER_CLIENT * concurrency)")
    p.add_argument("--requests-per-client", type=int, default=0)
    p.add_argument("--poisson-rate", type=float, default=0.2, help="requests per second (0: skip)")
    p.add_argument("--poisson-requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: every request gets max_tokens")
    p.add_argument("--token-prompts", type=int, default=0, metavar="LEN",
                   help="random token-id prompts of LEN ids to /v1/completions instead of chat prompts")
    p.add_argument("--vocab", type=int, default=0, help="token ids for --token-prompts are in [0, VOCAB)")
    p.add_argument("--warmup-tokens", type=int, default=0,
                   help="before each level, 2 x concurrency requests of this many tokens (not measured)")
    p.add_argument("--level-timeout", type=float, default=600.0,
                   help="seconds per level; requests unfinished then are cancelled and counted as timeouts")
    p.add_argument("--client-procs", type=int, default=1,
                   help="client processes a level's requests and workers are spread over (round robin)")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds for the whole suite (0: no limit); levels not started by then are skipped")
    p.set_defaults(**defaults)


LOAD_OPTIONS = ("concurrency", "requests", "requests_per_client", "poisson_rate", "poisson_requests", "max_tokens",
                "temperature", "ignore_eos", "token_prompts", "vocab", "warmup_tokens", "level_timeout",
                "time_budget", "client_procs")


def load_argv(args) -> list[str]:
    """args' load-generator options as a command line for `serve.py --url`."""
    out = []
    for name in LOAD_OPTIONS:
        v = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(v, bool):
            out += [flag] if v else []
        elif isinstance(v, list):
            out += [flag, ",".join(map(str, v))]
        else:
            out += [flag, str(v)]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (then only that one is measured)")
    p.add_argument("--model", default=None, help="model id to send (default: the server's first)")
    p.add_argument("--launch", default=None, help="MODEL: launch `forerun serve MODEL` plain and with --draft")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--k", default="4")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for the launched servers")
    add_load_args(p)
    p.add_argument("--api-key", default=None)
    p.add_argument("--name", default="serve_cpu", help="results file name (without extension)")
    p.add_argument("--json-out", default=None, help="with --url: write only the measured suite to this file")
    args = p.parse_args(argv)
    if not args.url and not args.launch:
        p.error("give --url (a running server) or --launch MODEL")
    if args.token_prompts and args.vocab < 1:
        p.error("--token-prompts needs --vocab")

    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "max_tokens": args.max_tokens,
           "temperature": args.temperature, "concurrency": args.concurrency, "requests_per_level": args.requests,
           "requests_per_client": args.requests_per_client, "poisson_rate": args.poisson_rate,
           "poisson_requests": args.poisson_requests, "cpus": os.cpu_count(),
           "server_args": args.server_arg, "threads": args.threads, "runs": {}}
    out = os.path.join(REPO, "benchmarks", "results", f"{args.name}.json")
    if args.url:
        model = args.model or httpx.get(args.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        res["model"] = model
        print(f"server {args.url} ({model})", flush=True)
        res["runs"]["server"] = run_suite(args.url, model, args)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(res["runs"]["server"], f, indent=1)
            return 0
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
        res["speedup_throughput"] = speedups(res, "plain")[list(res["runs"])[1]]
    print()
    print_table(res)
    if "identical_outputs" in res:
        print(f"identical greedy outputs plain vs spec: {res['identical_outputs']}")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    png = plot(res, out[:-5] + ".png")
    print(f"wrote {out}" + (f" and {out[:-5]}.png" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
