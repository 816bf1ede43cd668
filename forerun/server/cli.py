"""`forerun serve MODEL [...]`: load the engine, serve the OpenAI API with uvicorn, shut down cleanly.

SIGTERM / SIGINT: stop accepting (new connections refused, new requests on open connections 503), let
in-flight requests run for --shutdown-timeout seconds, abort what is left (streams end with finish_reason
"abort" and [DONE]), stop the engine loop, exit 0.
"""
from __future__ import annotations

import argparse
import atexit
import gc
import logging
import math
import os
import signal
import socket
import sys
import time

from ..config import CONFIDENCE_HELP, VERIFY_RULES
from ..usage import ArgumentParser, run as run_main


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="forerun serve", description="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    p.add_argument("model", help="model name (see `forerun models list`), .gguf file or HF checkpoint directory")
    p.add_argument("--draft", default="none", help="MODEL | early-exit:N | ngram | none (default: none)")
    p.add_argument("--k", default=None, help="drafts per round, or 'auto' (adaptive; the default with a drafter)")
    p.add_argument("--rule", default=None, choices=list(VERIFY_RULES))
    p.add_argument("--tree", default=None, help="tree drafting with the draft model: children per depth, e.g. 2,2,1")
    p.add_argument("--confidence", type=float, default=None, help=CONFIDENCE_HELP)
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="the draft model ranks only the first N token ids and the special tokens (a faster draft head)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="model id(s) clients use (repeatable; default: MODEL as given)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch at most")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting beyond the running batch at most; more are answered 429")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--join-wait", type=float, nargs=2, default=None, metavar=("RATIO", "STEPS"),
                   help="hold arrivals back while a session runs until RATIO x the running requests wait or the "
                        "oldest has waited STEPS steps (fewer, larger prefill rounds; more TTFT; off by default)")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="target KV cache memory budget (GiB)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="prompts reuse the keys and values of earlier requests' equal prefixes (a shared system prompt "
                        "is read once); usage reports them as prompt_tokens_details.cached_tokens; on by default")
    p.add_argument("--default-max-tokens", type=int, default=1024,
                   help="chat requests without max_completion_tokens get min(this, room left in the context)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="request body size limit (413 above)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may still run after SIGTERM before they are aborted")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="target weights and activations (auto: float32 on the CPU, bfloat16 on CUDA)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--quantize", default=None, choices=["none", "int8", "int4", "auto"],
                   help="weights kept quantized (docs/quantization.md); default: auto (a GGUF stays quantized: int4) "
                        "unless --dtype names a float type, then none")
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own seed")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    return p


def _check(a) -> str | None:
    if not 0 <= a.port <= 65535:
        return f"--port must be in [0, 65535], got {a.port}"
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_body_bytes", "default_max_tokens"):
        if getattr(a, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if a.max_queue < 0:
        return "--max-queue must be >= 0"
    if a.max_model_len is not None and a.max_model_len < 2:
        return "--max-model-len must be >= 2"
    if not math.isfinite(a.kv_cache_gb) or (a.join_wait is not None and not all(map(math.isfinite, a.join_wait))):
        return "--kv-cache-gb and --join-wait take finite numbers"
    if not a.kv_cache_gb > 0:
        return "--kv-cache-gb must be > 0"
    if not a.shutdown_timeout >= 0:
        return "--shutdown-timeout must be >= 0"
    if a.api_key is not None and not a.api_key:
        return "--api-key must not be empty"
    if a.join_wait is not None and not (a.join_wait[0] >= 0 and a.join_wait[1] >= 0
                                        and a.join_wait[1] == int(a.join_wait[1])):
        return "--join-wait takes RATIO >= 0 and whole STEPS >= 0"
    if a.draft in (None, "none") and a.k is not None:
        return "--k does nothing with --draft none (no speculation)"
    if a.threads < 0:
        return f"--threads must be >= 0 (0 = torch's default), got {a.threads}"
    from ..devices import device_problem

    if device_problem(a.device):
        return device_problem(a.device)
    if a.served_model_name is not None and not all(n.strip() for n in a.served_model_name):
        return "--served-model-name must not be empty"
    from ..models import hub

    # the drafter's flags, judged before any weights load (as `forerun generate` does)
    from ..config import SpecConfig

    try:
        spec = SpecConfig.from_flags(a.draft, a.k, a.confidence, a.rule, tree=a.tree,
                                     draft_vocab=a.draft_vocab)
    except ValueError as e:
        return str(e)
    if spec.method == "draft":
        problem = hub.model_problem(spec.draft_model, "draft model", "early-exit:N, ngram, eagle:DIR, none")
        if problem:
            return problem
    if spec.method == "eagle" and not os.path.isfile(os.path.join(os.path.expanduser(spec.eagle_head), "config.json")):
        return f"--draft eagle:DIR: {spec.eagle_head!r} is not an EAGLE head folder (no config.json)"
    return hub.model_problem(a.model)


def main(argv=None) -> int:
    a = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    problem = _check(a)
    if problem:
        print(f"forerun serve: error: {problem}", file=sys.stderr)
        return 2
    try:  # the port first: a taken one is reported now, not after the weights load (as vLLM does)
        sock = _listen(a.host, a.port)
    except OSError as e:
        print(f"forerun serve: error: cannot listen on {a.host}:{a.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    import torch
    import uvicorn

    from ..config import CacheConfig, SpecConfig
    from ..engine.engine import Engine
    from .app import ServerConfig, build_app

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.threads:
        torch.set_num_threads(a.threads)
    t = time.perf_counter()
    try:
        spec = SpecConfig.from_flags(a.draft, a.k, a.confidence, a.rule, tree=a.tree,
                                     draft_vocab=a.draft_vocab)
        cache = CacheConfig(block_size=a.block_size, memory_budget_bytes=int(a.kv_cache_gb * (1 << 30)))
        dtype = None if a.dtype == "auto" else getattr(torch, a.dtype)
        engine = Engine(a.model, spec=spec, device=a.device, dtype=dtype, cache=cache, max_num_seqs=a.max_num_seqs,
                        max_model_len=a.max_model_len, max_num_batched_tokens=a.max_num_batched_tokens, seed=a.seed,
                        quantize=a.quantize or ("auto" if a.dtype == "auto" else "none"),
                        enable_prefix_caching=a.enable_prefix_caching,
                        join_wait=None if a.join_wait is None else (a.join_wait[0], int(a.join_wait[1])))
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        print(f"forerun serve: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    print(f"[forerun] loaded {a.model} (+ {spec.method}) in {time.perf_counter() - t:.1f}s; {engine.pool_description}",
          file=sys.stderr)
    if engine.runner.graphs is not None:  # capture every decode / verify graph now, not in a client's first request
        t = time.perf_counter()
        n = engine.warmup()
        print(f"[forerun] captured {n} CUDA graphs in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    # the server holds this engine for its whole life: what is alive now (models, graphs, tokenizer) never becomes
    # garbage, so keep the cyclic collector from walking it on every full collection (a pause in some step).
    # Not in Engine itself: a process that builds several engines (tests, benchmarks) must get them collected.
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    config = ServerConfig(model_names=tuple(a.served_model_name or [a.model]), api_key=a.api_key,
                          max_num_seqs=a.max_num_seqs, max_queue=a.max_queue, max_body_bytes=a.max_body_bytes,
                          default_max_tokens=a.default_max_tokens, drain_seconds=a.shutdown_timeout)
    app = build_app(engine, config=config)
    srv = app.state.server
    ucfg = uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level, access_log=a.access_log,
                          timeout_graceful_shutdown=a.shutdown_timeout + 5.0, lifespan="on")

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if srv.loop is not None and not self.should_exit:
                srv.loop.call_soon_threadsafe(srv.begin_drain)
            super().handle_exit(sig, frame)

    # uvicorn re-raises the signal it caught after restoring the handlers it found: make those no-ops, so a
    # SIGTERM/SIGINT shutdown ends with `return 0` instead of the default action (killed by the signal).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        _Uvicorn(ucfg).run(sockets=[sock])
    except SystemExit as e:  # uvicorn exits 1 when it cannot start
        return int(e.code or 0) if isinstance(e.code, int) else 1
    return 0 if not srv.aeng.dead else 1


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv4 or IPv6 as the host resolves), handed to uvicorn once the engine
    is up; connections made while the weights load wait in its backlog."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    sys.exit(run_main(main))
