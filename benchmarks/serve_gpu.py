"""`forerun serve` under load on the H200 with random weights: a Qwen3-8B-shape bf16 target (+ a Qwen3-0.6B-shape
draft) built in this process, served by the real server (forerun.server.app.build_app, uvicorn on 127.0.0.1,
a free port, in a background thread: the same app, engine loop thread and event loop as `forerun serve`),
measured by benchmarks/serve.py's load generator in a separate client process over loopback.

  python benchmarks/serve_gpu.py            H200: Qwen3-8B / 0.6B shapes, concurrency 1,4,16,64 + Poisson
  python benchmarks/serve_gpu.py --tiny     this CPU: tiny random models, the same code path (a smoke run)

Configs, one server each (started, measured, shut down, then the next): plain decoding; a draft model with
k = 4; adaptive k (k_max = 8). Both speculative configs use synthetic acceptance 0.8 (benchmarks/online.py's
SyntheticSampler: the draft and the verifier run for real, then each draft is accepted with probability 0.8
until the first miss), since random weights accept nothing. Their outputs are therefore not the target's:
the benchmark measures costs, scheduling and the server, not text.

Random weights have no vocabulary. Requests are streaming /v1/completions with prompts of random token ids
and ignore_eos; the server's tokenizer is a stand-in that decodes every token id to one character, so each
stream chunk carries one character per new token: TTFT (request sent -> first text chunk) and TPOT
((last chunk - first chunk) / (completion tokens - 1)) are measured from the text exactly as for a real
model, and the characters received are checked against usage.completion_tokens. (forerun's
_NoTextTokenizer decodes to nothing, and the server sends no chunk for a delta without text; logprobs would
put a chunk on every delta but add a log-softmax over the vocabulary to every step.) The stand-in's decode
is cheaper than a real tokenizer's (a few microseconds per token less host time).

The client runs in its own processes (--client-procs, 4; each level's requests and workers spread over
them) so that its parsing neither takes the GIL from the server's event loop and engine thread nor limits
the level (each level records the clients' CPU seconds: client_cpu_s against wall_s x processes).
Before serving, each engine is warmed up directly (online.py's drive at concurrency 1, 2, 4, .., 64:
kernels compiled, every batch size's CUDA graph captured); the client also runs 2 x c short unmeasured
requests before each level. Every level is bounded in count (4 + 2 x concurrency requests of 128 tokens)
and time (--level-timeout), and the whole run by --deadline (configs not started by then are skipped, and
the client skips levels once the deadline has passed).
Prints a table; writes $OUT/serve_h200.json and .png when OUT is set, else benchmarks/results/.
Needs: torch, fastapi (+ starlette, pydantic), uvicorn, prometheus_client (server) and httpx (client);
matplotlib for the PNG (optional). A GPU machine without network access and without the server's modules:
download their wheels here into the git-ignored .whl/ (pip download -d .whl --only-binary=:all:
--python-version 3.12 --platform manylinux2014_x86_64 fastapi uvicorn), carry .whl there, and run
  python -m pip install -q --no-index --find-links .whl --target /tmp/pylib fastapi uvicorn &&
  PYTHONPATH=/tmp/pylib python benchmarks/serve_gpu.py
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(REPO, "benchmarks")
REQUIRED = ("torch", "fastapi", "starlette", "pydantic", "uvicorn", "prometheus_client", "httpx")


def check_modules() -> None:
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"serve_gpu.py: missing Python modules: {', '.join(missing)} "
                 f"(needs {', '.join(REQUIRED)}; matplotlib optional, for the PNG)")


class CharTokenizer:
    """Random weights have no vocabulary: every token id decodes to one letter, so streamed text counts
    tokens. No EOS, no chat template (chat requests get a 400; the benchmark sends token ids)."""

    eos_token_id = None
    chat_template = None
    _letters = "abcdefghijklmnopqrstuvwxyz"

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(self._letters[int(t) % 26] for t in ids)

    def encode(self, text: str, **kw) -> list[int]:
        raise ValueError("this benchmark model has no vocabulary: send token ids")

    def get_vocab(self) -> dict:
        return {}


class InProcessServer:
    """uvicorn serving build_app(engine) on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, engine, model_name: str, max_num_seqs: int, timeout: float = 120.0, aeng=None) -> None:
        import httpx
        import uvicorn

        from forerun.server.app import ServerConfig, build_app
        from serve import free_port

        config = ServerConfig(model_names=(model_name,), max_num_seqs=max_num_seqs, max_queue=256,
                              drain_seconds=5.0)
        self.app = build_app(engine, aeng, config=config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False, timeout_graceful_shutdown=10, lifespan="on"))
        # (in a thread, uvicorn installs no signal handlers: Ctrl-C reaches this script's main thread)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.time() + timeout
        while True:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited while starting")
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not answer /health within {timeout:.0f}s")
            if self.server.started:
                try:
                    if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)

    def stop(self, timeout: float = 60.0) -> bool:
        """Clean shutdown (the lifespan aborts what still runs and stops the engine loop); True when the
        server thread and the engine loop have both ended."""
        self.server.should_exit = True
        self.thread.join(timeout)
        aeng = self.app.state.server.aeng
        return not self.thread.is_alive() and not aeng.is_running


def build_models(tiny: bool):
    """(target, draft, tokenizer, engine kwargs, vocab, description)."""
    import torch

    if tiny:
        sys.path.insert(0, os.path.join(REPO, "tests"))
        from tiny import hf_model, model_from_hf as ours

        vocab = 1000
        target = ours(hf_model("qwen3", 0, vocab_size=vocab))
        draft = ours(hf_model("qwen3", 1, vocab_size=vocab, num_hidden_layers=1))
        return target, draft, CharTokenizer(), dict(device="cpu"), vocab, "tiny random qwen3 (CPU)"
    from gpu import BF16, QWEN3_06B, QWEN3_8B, build_model

    torch.manual_seed(0)
    target = build_model(QWEN3_8B, None, seed=0)
    draft = build_model(QWEN3_06B, None, seed=3)
    return (target, draft, CharTokenizer(), dict(device="cuda", dtype=BF16), QWEN3_8B["vocab_size"],
            "random Qwen3-8B-shape bf16 target, Qwen3-0.6B-shape draft")


def main(argv=None) -> int:
    check_modules()
    from serve import add_load_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny random models on this CPU (smoke run, < 2 minutes)")
    p.add_argument("--acceptance", type=float, default=0.8, help="synthetic acceptance of the speculative configs")
    p.add_argument("--configs", default="plain,k4,adaptive", help="subset of plain,k4,adaptive")
    p.add_argument("--prompt-len", type=int, default=None, help="token ids per prompt (128; tiny: 32)")
    p.add_argument("--blocks", type=int, default=None, help="KV blocks of 16 tokens (4000; tiny: 512)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for the whole run; configs not started by then are skipped (380; tiny: 110)")
    p.add_argument("--out", default=None, help="results directory (default: $OUT, else benchmarks/results)")
    p.add_argument("--name", default=None, help="results file name (serve_h200; tiny: serve_tiny)")
    add_load_args(p, concurrency=None, requests=4, requests_per_client=2, max_tokens=None, poisson_rate=None,
                  poisson_requests=None, ignore_eos=True, warmup_tokens=None, level_timeout=None, client_procs=None)
    args = p.parse_args(argv)
    tiny = args.tiny
    for name, gpu, cpu in (("concurrency", [1, 4, 16, 64], [1, 4, 16]), ("max_tokens", 128, 24),
                           ("prompt_len", 128, 32), ("blocks", 4000, 512), ("poisson_rate", 16.0, 4.0),
                           ("poisson_requests", 48, 8), ("warmup_tokens", 16, 4), ("level_timeout", 60.0, 40.0),
                           ("deadline", 380.0, 110.0), ("name", "serve_h200", "serve_tiny"), ("client_procs", 4, 2)):
        if getattr(args, name) is None:
            setattr(args, name, cpu if tiny else gpu)
    configs = [c for c in args.configs.split(",") if c]
    if not set(configs) <= {"plain", "k4", "adaptive"}:
        p.error(f"--configs: unknown {sorted(set(configs) - {'plain', 'k4', 'adaptive'})}")
    T0 = time.perf_counter()

    def log(m: str) -> None:
        print(f"[{time.perf_counter() - T0:6.1f}s] {m}", flush=True)

    import torch

    if not tiny and not torch.cuda.is_available():
        sys.exit("serve_gpu.py: no CUDA device (use --tiny for the CPU smoke run)")
    if tiny:
        torch.set_num_threads(1)  # this process serves; the client process needs a core too
    from online import SyntheticSampler, drive, free_memory
    from serve import load, load_argv, plot, print_table, speedups

    from forerun.config import CacheConfig, SpecConfig
    from forerun.engine.engine import Engine

    target, draft, tok, kw, vocab, desc = build_models(tiny)
    args.token_prompts, args.vocab = args.prompt_len, vocab
    cache = CacheConfig(block_size=16, num_blocks=args.blocks)
    gen = torch.Generator().manual_seed(7)
    warm_prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(64)]
    a = args.acceptance
    specs = {"plain": ("plain", None),
             "k4": (f"k=4, synthetic a={a}", dict(k=4)),
             "adaptive": (f"adaptive k<=8, synthetic a={a}", dict(adaptive=True, k_max=8))}
    log(f"models built: {desc}")

    out_dir = args.out or os.environ.get("OUT") or os.path.join(REPO, "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, f"{args.name}.json")
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "model": desc, "tiny": tiny,
           "device": torch.cuda.get_device_name() if not tiny else "cpu", "torch": torch.__version__,
           "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "temperature": args.temperature,
           "concurrency": args.concurrency, "requests_per_level": "max(c, %d + %d * c)" % (
               args.requests, args.requests_per_client), "poisson_rate": args.poisson_rate,
           "poisson_requests": args.poisson_requests, "warmup_tokens": args.warmup_tokens,
           "synthetic_acceptance": a, "kv_blocks": args.blocks, "max_num_seqs": 64, "cpus": os.cpu_count(),
           "client": f"benchmarks/serve.py --url, {args.client_procs} processes, streaming /v1/completions, "
                     "token-id prompts",
           "runs": {}, "skipped": []}
    problems = []
    for key in configs:
        name, spec_kw = specs[key]
        if time.perf_counter() - T0 > args.deadline:
            res["skipped"].append(name)
            problems.append(f"{name}: skipped (deadline)")
            log(f"{name}: skipped (past the {args.deadline:.0f}s deadline)")
            continue
        eng = srv = None
        try:
            spec = None if spec_kw is None else SpecConfig(method="draft", draft_model=(draft, tok), **spec_kw)
            eng = Engine.from_model(target, tok, cache=cache, max_num_seqs=64, spec=spec, **kw,
                                    enable_prefix_caching=False)
            if spec is not None:
                eng.round.sampler = eng.sampler = SyntheticSampler(a)
            t = time.perf_counter()
            # warm-up on the engine itself, before it serves: every decode / verify CUDA graph captured (as
            # `forerun serve` does at startup), then kernels compiled by a closed loop at each concurrency b
            eng.warmup(max_batch=max(args.concurrency))
            for b in (1, 2, 4, 8, 16, 32, 64):
                if b <= max(args.concurrency):
                    drive(eng, warm_prompts[:b], args.warmup_tokens, concurrency=b)
            log(f"{name}: engine built and warmed up in {time.perf_counter() - t:.1f}s")
            t = time.perf_counter()
            srv = InProcessServer(eng, "random-qwen3-8b" if not tiny else "tiny-random", max_num_seqs=64)
            log(f"{name}: server up at {srv.url} in {time.perf_counter() - t:.1f}s")
            js = os.path.join(tempfile.mkdtemp(prefix="forerun_serve_"), "run.json")
            # the client's whole suite is bounded by what is left of --deadline (30 s at least)
            args.time_budget = max(30.0, args.deadline - (time.perf_counter() - T0))
            cmd = [sys.executable, os.path.join(HERE, "serve.py"), "--url", srv.url, "--json-out", js, *load_argv(args)]
            try:
                rc = subprocess.run(cmd, cwd=REPO, timeout=args.time_budget + 2 * args.level_timeout + 60).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            finally:
                clean = srv.stop()
            run = json.load(open(js)) if os.path.exists(js) else None
            if run is None:
                problems.append(f"{name}: the client exited with {rc} and wrote nothing")
                log(problems[-1])
            else:
                graphs = {}
                for side, runner in (("target", eng.runner), ("draft", getattr(eng.drafter, "runner", None))):
                    g = getattr(runner, "graphs", None) if runner is not None else None
                    if g is not None:
                        graphs[side] = {k: getattr(g, k, None) for k in ("replays", "eager_steps")}
                st = eng.stats()
                run.update(config=key, engine_dead=srv.app.state.server.aeng.dead, clean_shutdown=clean,
                           client_exit=rc, graphs=graphs, kv_blocks_free_after=st.kv_blocks_free,
                           kv_blocks_total=st.kv_blocks_total, preemptions=st.num_preemptions)
                for lv in run["levels"] + ([run["poisson"]] if run.get("poisson") else []):
                    if lv["text_chars"] != lv["completion_tokens"]:
                        problems.append(f"{name}: streamed {lv['text_chars']} characters for "
                                        f"{lv['completion_tokens']} completion tokens")
                    if lv["ok"] != lv["requests"]:
                        problems.append(f"{name}: {lv['ok']}/{lv['requests']} requests ok "
                                        f"({lv.get('timeouts', 0)} timed out; {lv['errors'][:1]})")
                if run.get("skipped"):
                    problems.append(f"{name}: skipped {', '.join(run['skipped'])} (time budget)")
                for lv in run["levels"] + ([run["poisson"]] if run.get("poisson") else []):
                    lv.pop("texts", None)  # not the target's text (synthetic acceptance): not worth keeping
                res["runs"][name] = run
                log(f"{name}: done; clean shutdown {clean}, KV blocks free {st.kv_blocks_free}/{st.kv_blocks_total}, "
                    f"graphs {graphs}")
                if not clean:
                    problems.append(f"{name}: the server did not shut down cleanly")
                if st.kv_blocks_free != st.kv_blocks_total:
                    used = st.kv_blocks_total - st.kv_blocks_free
                    problems.append(f"{name}: {used} KV blocks still used after shutdown")
        except Exception as e:  # noqa: BLE001 - one config failing must not lose the others' numbers
            traceback.print_exc()
            problems.append(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            if srv is not None and srv.thread.is_alive():
                srv.stop()
        with open(out, "w") as f:  # after each config, so a run cut short keeps what it measured
            json.dump(res, f, indent=1)
        del srv, eng
        free_memory()
    res["speedup_throughput_vs_plain"] = speedups(res, specs["plain"][0])
    res["problems"] = problems
    res["load_after"] = load()
    res["wall_s"] = time.perf_counter() - T0
    print()
    print_table(res)
    for name, d in res["speedup_throughput_vs_plain"].items():
        print(f"throughput vs plain, {name}: " + ", ".join(f"{c}: {v:.2f}x" for c, v in d.items()))
    for m in problems:
        print(f"PROBLEM: {m}")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    png = bool(res["runs"]) and plot(res, out[:-5] + ".png")
    log(f"wrote {out}" + (f" and {out[:-5]}.png" if png else ""))
    return 1 if problems or not res["runs"] else 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.path.insert(0, HERE)
    sys.exit(main())
