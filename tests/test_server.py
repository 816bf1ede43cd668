"""`forerun serve`: the real uvicorn server on 127.0.0.1 (random free port) over the real online engine,
talked to with the official `openai` client (sync, async, streaming) and raw httpx.

References nobody here wrote: the openai client's parsing of every response, prometheus_client's parser for
/metrics, and LLM.generate for the text (greedy output over HTTP must equal it token for token).
Every loop is bounded in count and time; everything stays on loopback.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from forerun.config import CacheConfig, SpecConfig
from forerun.engine.engine import Engine
from forerun.engine.llm import LLM
from forerun.sampling_params import SamplingParams
from forerun.server.app import ServerConfig, build_app
from forerun.server.cli import main as serve_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOL = "smollm2-135m-instruct"
NAME = "smol"


# ---------------------------------------------------------------------------------------------- harness
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """uvicorn serving `app` in a thread (its own event loop), stopped by should_exit."""

    def __init__(self, app) -> None:
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.time() < deadline, "server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def metrics(url: str) -> dict[str, float]:
    """/metrics parsed by prometheus_client: {'name{label=value,...}': value} for every sample."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is used; returns the last reading."""
    deadline = time.time() + timeout
    while True:
        m = metrics(url)
        idle = m["forerun:kv_blocks_used"] == 0 and m["forerun:num_requests_running"] == 0 and \
            m["forerun:num_requests_waiting"] == 0
        if idle or time.time() > deadline:
            return m
        time.sleep(0.05)


def client(run, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=run.url + "/v1", api_key="none", max_retries=0, timeout=120, **kw)


# --------------------------------------------------------------------------------- the real SmolLM2 server
@pytest.fixture(scope="module")
def smol():
    from forerun.models.registry import load_model

    torch.manual_seed(0)
    model, tok, _ = load_model(SMOL, "cpu", torch.float32)
    return model, tok


@pytest.fixture(scope="module")
def reference(smol):
    """LLM.generate on the same weights: what greedy output over HTTP must equal."""
    model, tok = smol
    llm = LLM.from_model(model, tok, cache=CacheConfig(block_size=16, num_blocks=256))
    cache = {}

    def gen(prompt: str, max_tokens: int, chat: bool = False, **kw):
        key = (prompt, max_tokens, chat, tuple(sorted(kw.items())))
        if key not in cache:
            params = SamplingParams(temperature=kw.pop("temperature", 0.0), max_tokens=max_tokens, **kw)
            cache[key] = llm.generate([prompt], params, chat=chat)[0]
        return cache[key]

    return gen


@pytest.fixture(scope="module")
def served(smol):
    """The real server on SmolLM2 with n-gram speculation (k=4), as `forerun serve` builds it."""
    model, tok = smol
    engine = Engine.from_model(model, tok, spec=SpecConfig(method="ngram", k=4),
                               cache=CacheConfig(block_size=16, num_blocks=1024), max_num_seqs=64)
    app = build_app(engine, config=ServerConfig(model_names=(NAME,), max_num_seqs=64, max_queue=512,
                                                max_body_bytes=1 << 20, default_max_tokens=64))
    run = Running(app)
    yield run
    run.stop()


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Repeat after me: red green blue, red green blue, red green blue,",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5, 6,",
    "The three primary colors are",
    "import numpy as np\nimport",
    "Q: What is 2 + 2?\nA:",
]


@pytest.mark.slow
def test_completions_greedy_equals_llm_generate_and_usage_adds_up(served, reference, smol):
    _, tok = smol
    oc = client(served)
    for prompt in PROMPTS[:4]:
        r = oc.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
        ref = reference(prompt, 24)
        assert r.choices[0].text == ref.text, prompt
        assert r.choices[0].finish_reason == ref.finish_reason
        u = r.usage
        assert u.prompt_tokens == len(tok.encode(prompt)) == len(ref.prompt_token_ids)
        assert u.completion_tokens == len(ref.token_ids)
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        spec = u.model_extra["speculation"]
        assert 0 <= spec["accepted"] <= spec["drafted"]
        assert 0.0 <= spec["acceptance_rate"] <= 1.0
        assert len(spec["per_position_acceptance"]) <= 4
    # a list of prompts, and a prompt of token ids, give the same texts
    r = oc.completions.create(model=NAME, prompt=PROMPTS[:3], max_tokens=12, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [reference(p, 12).text for p in PROMPTS[:3]]
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS[:3])
    r2 = oc.completions.create(model=NAME, prompt=tok.encode(PROMPTS[0]), max_tokens=12, temperature=0)
    assert r2.choices[0].text == reference(PROMPTS[0], 12).text


def _templated(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.slow
def test_chat_template_applied_and_streams_match(served, reference, smol):
    _, tok = smol
    oc = client(served)
    q = "What is the capital of France? Answer in one word."
    msgs = [{"role": "user", "content": q}]
    r = oc.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=20, temperature=0)
    ref = reference(q, 20, chat=True)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(_templated(tok, msgs)) > len(tok.encode(q))  # the template's tokens
    # streaming: role chunk first, joined deltas == the non-streamed text, a final usage chunk with no choices
    chunks = list(oc.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=20, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert all(c.usage is None for c in chunks[:-1])
    # completions streaming
    parts = list(oc.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == reference(PROMPTS[1], 24).text
    # a system message is rendered by the template too
    msgs2 = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": q}]
    r3 = oc.chat.completions.create(model=NAME, messages=msgs2, max_completion_tokens=2)
    assert r3.usage.prompt_tokens == len(_templated(tok, msgs2))


@pytest.mark.slow
def test_async_client_concurrent_requests_equal_reference(served, reference):
    async def main():
        ac = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)

        async def one(p):
            return await ac.completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0)

        async def streamed(p):
            s = await ac.completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in s])

        outs = await asyncio.wait_for(asyncio.gather(*(one(p) for p in PROMPTS), *(streamed(p) for p in PROMPTS)), 120)
        await ac.close()
        return outs

    outs = asyncio.run(main())
    want = [reference(p, 16).text for p in PROMPTS]
    assert [o.choices[0].text for o in outs[:len(PROMPTS)]] == want
    assert outs[len(PROMPTS):] == want


@pytest.mark.slow
def test_logprobs_n_and_seed(served, reference):
    oc = client(served)
    q = "Name a fruit."
    r = oc.chat.completions.create(model=NAME, messages=[{"role": "user", "content": q}], max_completion_tokens=8,
                                   temperature=0, logprobs=True, top_logprobs=3)
    ref = reference(q, 8, chat=True, logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(ref.token_ids)
    for item, want in zip(content, ref.logprobs):
        assert len(item.top_logprobs) == 3
        lps = [t.logprob for t in item.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert item.logprob == pytest.approx(want["logprob"], abs=1e-3)
        assert item.logprob == pytest.approx(lps[0], abs=1e-6)  # greedy: the chosen token is the most likely
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    c = oc.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert lp.text_offset[0] == 0 and all(len(t) <= 2 for t in lp.top_logprobs)
    # n samples with a seed: choice i uses seed + i, reproducible, equal to LLM.generate with that seed
    kw = dict(model=NAME, prompt=PROMPTS[3], max_tokens=10, temperature=0.9, n=3, seed=7, extra_body={"top_k": 40})
    a, b = oc.completions.create(**kw), oc.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    refs = [reference(PROMPTS[3], 10, temperature=0.9, top_k=40, seed=7 + i) for i in range(3)]
    assert texts == [x.text for x in refs]
    assert len(set(texts)) > 1
    assert a.usage.completion_tokens == sum(len(x.token_ids) for x in refs)


@pytest.mark.slow
def test_metrics_parse_and_move(served):
    before = metrics(served.url)
    for name in ("forerun:spec_decode_num_drafts_total", "forerun:spec_decode_num_draft_tokens_total",
                 "forerun:spec_decode_num_accepted_tokens_total", "forerun:num_requests_running",
                 "forerun:num_requests_waiting", "forerun:kv_blocks_used", "forerun:kv_blocks_free",
                 "forerun:time_to_first_token_seconds_count", "forerun:time_per_output_token_seconds_count",
                 "forerun:e2e_request_latency_seconds_count", "forerun:generation_tokens_total"):
        assert name in before, name
    oc = client(served)
    r = oc.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=32, temperature=0)
    after = wait_idle(served.url)
    spec = r.usage.model_extra["speculation"]
    assert spec["drafted"] > 0  # the repetitive prompt gives the n-gram drafter matches
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert d["forerun:spec_decode_num_draft_tokens_total"] == spec["drafted"]
    assert d["forerun:spec_decode_num_accepted_tokens_total"] == spec["accepted"]
    assert d["forerun:generation_tokens_total"] == r.usage.completion_tokens
    assert d["forerun:prompt_tokens_total"] == r.usage.prompt_tokens
    assert d["forerun:e2e_request_latency_seconds_count"] == 1 and d["forerun:time_to_first_token_seconds_count"] == 1
    assert d["forerun:request_success_total{finished_reason=" + r.choices[0].finish_reason + "}"] == 1
    per_pos = sum(v for k, v in d.items() if k.startswith("forerun:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == spec["accepted"]
    assert after["forerun:kv_blocks_used"] == 0 and after["forerun:kv_blocks_free"] > 0


@pytest.mark.slow
def test_errors_in_openai_shape(served):
    c = httpx.Client(base_url=served.url, timeout=30)
    cases = [
        ({"model": "nope", "prompt": "hi"}, "/v1/completions", 404, "model"),
        ({"model": NAME, "prompt": "hi", "temperature": -1}, "/v1/completions", 400, "temperature"),
        ({"model": NAME, "prompt": "hi", "max_tokens": 10**9}, "/v1/completions", 400, "max_tokens"),
        ({"model": NAME, "prompt": "hi", "bogus": 1}, "/v1/completions", 400, "bogus"),
        ({"model": NAME, "prompt": "hi", "presence_penalty": 0.5}, "/v1/completions", 400, "presence_penalty"),
        ({"model": NAME, "prompt": "hi", "echo": True}, "/v1/completions", 400, "echo"),
        ({"model": NAME, "prompt": "hi", "stream_options": {"include_usage": True}}, "/v1/completions", 400,
         "stream_options"),
        ({"model": NAME, "messages": []}, "/v1/chat/completions", 400, "messages"),
        ({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, "/v1/chat/completions", 400,
         "messages.0.role"),
        ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "/v1/chat/completions",
         400, "top_logprobs"),
    ]
    for body, path, status, param in cases:
        r = c.post(path, json=body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (body, err)
        assert "Traceback" not in r.text and "\n" not in err["message"]
    # an image part: 400 naming the content
    r = c.post("/v1/chat/completions", json={"model": NAME, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.content")
    # the prompt too long for the context: 400 naming the context length
    r = c.post("/v1/completions", json={"model": NAME, "prompt": "hello " * 9000, "max_tokens": 4})
    assert r.status_code == 400 and "8192" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"
    # the openai client raises its own typed errors from these bodies
    oc = client(served)
    with pytest.raises(openai.NotFoundError):
        oc.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        oc.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], temperature=5)
    assert e.value.body["param"] == "temperature"
    assert c.get("/v1/models").json()["data"][0]["id"] == NAME
    assert c.get("/v1/nothing").status_code == 404 and c.get("/v1/completions").status_code == 405


def _fuzz_cases(rng: random.Random) -> list[tuple[str, bytes, dict]]:
    """Malformed or out-of-range requests: (path, raw body, headers). Every valid-looking one asks for at
    most 2 new tokens (or a chat default of 64), so the set runs in seconds."""
    comp = {"model": NAME, "prompt": "Hello", "max_tokens": 2}
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    bad_values = [None, True, False, -1, 0, 1, -(10**30), 10**30, 2**63, -0.5, 1.5, 1e308, -1e308, "", "x", "1",
                  [], [1], [[]], {}, {"a": 1}, [None], ["a", 3], 3.5, "NaN"]
    fields_c = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stop",
                "seed", "logprobs", "echo", "suffix", "best_of", "presence_penalty", "frequency_penalty",
                "logit_bias", "user", "stream_options", "ignore_eos", "stop_token_ids", "response_format",
                "repetition_penalty"]
    fields_h = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
                "stream", "stop", "seed", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format",
                "stream_options", "store", "user", "min_p"]
    cases = []

    def js(o) -> bytes:
        return json.dumps(o).encode()

    for path, base, fields in (("/v1/completions", comp, fields_c), ("/v1/chat/completions", chat, fields_h)):
        for f in fields:  # every field x every wrong value
            for v in bad_values:
                cases.append((path, js(dict(base, **{f: v})), {}))
        for lit in ("NaN", "Infinity", "-Infinity", "1e999"):  # not JSON numbers: refused
            cases.append((path, js(base)[:-1] + f', "temperature": {lit}}}'.encode(), {}))
        raw = js(base)
        for cut in sorted(rng.sample(range(1, len(raw)), min(20, len(raw) - 1))):
            cases.append((path, raw[:cut], {}))  # truncated JSON
        for _ in range(20):  # random bytes
            cases.append((path, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))), {}))
        for body in (b"", b"null", b"[]", b"42", b'"str"', b"{}", b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000,
                     js(dict(base, extra_field=1)), js(dict(base, max_tokens=10**12)), js(dict(base, n=10**6)),
                     js(dict(base, stop=[""])), js(dict(base, stop=["x"] * 100)), js(dict(base, seed=2**64)),
                     "\ud800".encode("utf-8", "surrogatepass")):
            cases.append((path, body, {}))
        cases.append((path, js(base), {"content-type": "text/plain"}))
        cases.append((path, b"x" * (2 << 20), {}))  # over the body limit: 413
    p = "/v1/completions"
    for prompt in ("", [], [[]], [-1], [10**9], [[1, 2], []], ["a", ""], "x " * 20000, ["y " * 9000],
                   [0] * 9000, list(range(50)) + [2**40]):
        cases.append((p, js(dict(comp, prompt=prompt)), {}))
    q = "/v1/chat/completions"
    for msgs in ([{"role": "user"}], [{"role": "user", "content": None}], [{"content": "x"}],
                 [{"role": "tool", "content": "x", "tool_call_id": "1"}],
                 [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": "x", "extra": 1}],
                 [{"role": "user", "content": "z " * 20000}], "hi", [["user", "x"]]):
        cases.append((q, js(dict(chat, messages=msgs)), {}))
    for lp in (-1, 21, 10**9):
        cases.append((p, js(dict(comp, logprobs=lp)), {}))
        cases.append((q, js(dict(chat, logprobs=True, top_logprobs=lp)), {}))
    for rf in ({"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 5}},
               {"type": "text", "json_schema": {"name": "x"}},
               {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}):
        cases.append((q, js(dict(chat, response_format=rf)), {}))
    return cases


@pytest.mark.slow
def test_robustness_1000_malformed_requests_no_5xx(served):
    cases = _fuzz_cases(random.Random(0))
    assert len(cases) >= 1000
    statuses: list[int] = []

    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as ac:
            sem = asyncio.Semaphore(16)

            async def one(path, body, headers):
                async with sem:
                    r = await ac.post(path, content=body, headers={"content-type": "application/json", **headers})
                    if r.status_code >= 400:
                        err = r.json()["error"]  # always OpenAI's shape, one line, no traceback
                        assert set(err) == {"message", "type", "param", "code"}, r.text
                        assert "Traceback" not in r.text and "\n" not in err["message"]
                    statuses.append(r.status_code)

            await asyncio.wait_for(asyncio.gather(*(one(*c) for c in cases)), 240)
            for method, path in (("GET", "/v1/chat/completions"), ("PUT", "/v1/completions"), ("GET", "/x"),
                                 ("DELETE", "/v1/models"), ("POST", "/health"), ("GET", "/v1/models/nope")):
                statuses.append((await ac.request(method, path)).status_code)

    t = time.time()
    asyncio.run(main())
    fives = [s for s in statuses if s >= 500]
    assert not fives, fives
    assert sum(400 <= s < 500 for s in statuses) >= 1000, sorted(set(statuses))
    assert 413 in statuses and 404 in statuses and 405 in statuses
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
    m = wait_idle(served.url)
    assert m["forerun:kv_blocks_used"] == 0, m
    print(f"{len(statuses)} requests in {time.time() - t:.1f}s: " +
          ", ".join(f"{s}: {statuses.count(s)}" for s in sorted(set(statuses))))


@pytest.mark.slow
def test_64_streams_20_percent_disconnect(served, reference):
    """64 concurrent streaming clients; 13 (20%) hang up after their second chunk. The ones that hang up
    asked for 900 tokens with ignore_eos: unless their requests are aborted at once, they would still hold
    KV blocks long after the others finish. Every other stream must complete with LLM.generate's text."""
    n_clients, n_drop, max_tokens = 64, 13, 16
    drop = set(random.Random(1).sample(range(n_clients), n_drop))
    want = {p: reference(p, max_tokens).text for p in PROMPTS}
    results: dict[int, tuple[int, str, str | None]] = {}

    async def one(ac, i):
        p = PROMPTS[i % len(PROMPTS)]
        body = {"model": NAME, "prompt": p, "temperature": 0, "stream": True,
                "max_tokens": 900 if i in drop else max_tokens, "ignore_eos": i in drop}
        text, finish, chunks = [], None, 0
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                results[i] = (r.status_code, "", None)
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                chunks += 1
                text.append(chunk["choices"][0]["text"])
                finish = chunk["choices"][0]["finish_reason"] or finish
                if i in drop and chunks >= 2:
                    break  # leaving the `async with` closes the connection mid-stream
        results[i] = (r.status_code, "".join(text), finish)

    async def main():
        limits = httpx.Limits(max_connections=n_clients + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=served.url, timeout=120, limits=limits) as ac:
            await asyncio.wait_for(asyncio.gather(*(one(ac, i) for i in range(n_clients))), 180)

    before = metrics(served.url)
    t = time.time()
    asyncio.run(main())
    done_at = time.time()
    m = wait_idle(served.url, timeout=5)  # generating the dropped requests to the end would take minutes
    idle_after = time.time() - done_at
    assert len(results) == n_clients and all(s == 200 for s, _, _ in results.values())
    for i, (_, text, finish) in results.items():
        if i not in drop:
            assert text == want[PROMPTS[i % len(PROMPTS)]], i
            assert finish is not None
    assert m["forerun:kv_blocks_used"] == 0 and m["forerun:num_requests_running"] == 0, m
    key = "forerun:request_success_total{finished_reason=abort}"
    assert m.get(key, 0) - before.get(key, 0) == n_drop
    print(f"64 streams in {done_at - t:.1f}s, idle {idle_after:.2f}s later")


# ---------------------------------------------------------------------- tiny random model (fast, not slow)
@pytest.fixture(scope="module")
def tiny_engine():
    from tiny import hf_model, ours_from_hf, tiny_tokenizer

    model = ours_from_hf(hf_model("llama")).model
    return lambda **kw: Engine.from_model(model, tiny_tokenizer(), cache=CacheConfig(block_size=4, num_blocks=256),
                                          **kw)


def test_api_key_and_queue_full(tiny_engine):
    engine = tiny_engine(max_num_seqs=1)
    run = Running(build_app(engine, config=ServerConfig(model_names=("tiny",), api_key="s3cret", max_num_seqs=1,
                                                        max_queue=1)))
    try:
        body = {"model": "tiny", "prompt": "t5 t6", "max_tokens": 3}
        c = httpx.Client(base_url=run.url, timeout=30)
        assert c.post("/v1/completions", json=body).status_code == 401
        r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200  # health and metrics need no key
        oc = openai.OpenAI(base_url=run.url + "/v1", api_key="s3cret", max_retries=0)
        assert oc.completions.create(model="tiny", prompt="t5", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=run.url + "/v1", api_key="bad", max_retries=0).models.list()

        async def burst():
            h = {"Authorization": "Bearer s3cret"}
            async with httpx.AsyncClient(base_url=run.url, timeout=60, headers=h) as ac:
                long = dict(body, max_tokens=200, ignore_eos=True)
                return await asyncio.gather(*(ac.post("/v1/completions", json=long) for _ in range(6)))

        statuses = sorted(r.status_code for r in asyncio.run(burst()))
        assert statuses.count(200) >= 2 and 429 in statuses and all(s in (200, 429) for s in statuses), statuses
        assert wait_idle(run.url)["forerun:kv_blocks_used"] == 0
    finally:
        run.stop()


def test_engine_death_gives_503(tiny_engine):
    engine = tiny_engine()
    run = Running(build_app(engine, config=ServerConfig(model_names=("tiny",))))
    try:
        c = httpx.Client(base_url=run.url, timeout=30)
        assert c.post("/v1/completions", json={"prompt": "t5", "max_tokens": 2}).status_code == 200

        def broken():
            raise RuntimeError("simulated engine failure")

        engine.step = broken
        r = c.post("/v1/completions", json={"prompt": "t5", "max_tokens": 2})
        assert r.status_code == 503 and "Traceback" not in r.text, r.text
        deadline = time.time() + 10
        while c.get("/health").status_code != 503:
            assert time.time() < deadline
            time.sleep(0.05)
        assert c.post("/v1/completions", json={"prompt": "t5", "max_tokens": 2}).status_code == 503
    finally:
        run.stop()


def test_cli_usage_errors_are_one_line(capsys, tmp_path):
    assert serve_main([str(tmp_path / "missing-model"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("forerun serve: error:") and "Traceback" not in err and err.count("\n") == 1, err
    assert serve_main(["x", "--max-queue", "-1"]) == 2
    assert serve_main(["x", "--api-key", ""]) == 2
    assert serve_main(["x", "--join-wait", "0.3", "1.5"]) == 2
    assert serve_main(["x", "--join-wait", "-1", "4"]) == 2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random HF checkpoint directory that `forerun serve DIR` loads."""
    from tiny import hf_model, tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny-ckpt")
    hf_model("llama").save_pretrained(d, safe_serialization=True)
    tiny_tokenizer().save_pretrained(d)
    return d


def test_sigterm_aborts_inflight_and_exits_0(tiny_dir):
    """`forerun serve` as a process: SIGTERM mid-stream stops accepting, aborts the in-flight stream after
    --shutdown-timeout (0 here; it ends with finish_reason 'abort' and [DONE]) and exits with status 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "forerun.server.cli", str(tiny_dir), "--port", str(port),
                             "--shutdown-timeout", "0", "--log-level", "warning", "--kv-cache-gb", "0.01"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.2)
        lines, sent = [], False
        body = {"prompt": "t5 t6", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                if len(lines) == 3 and not sent:
                    proc.send_signal(signal.SIGTERM)
                    sent = True
        assert lines[-1] == "[DONE]"
        finishes = [json.loads(x)["choices"][0]["finish_reason"] for x in lines[:-1]]
        assert finishes[-1] == "abort" and len(lines) < 500, (finishes[-1], len(lines))
        assert proc.wait(timeout=60) == 0, proc.stdout.read().decode()
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_taken_port_is_reported_before_the_weights_load(tiny_dir, capsys, monkeypatch):
    """The port is bound before the engine is built: a taken one ends `forerun serve` at once, one line, status 1."""
    import forerun.engine.engine as engine_module

    def boom(*a, **k):
        raise AssertionError("the engine was built before the port was bound")

    monkeypatch.setattr(engine_module, "Engine", boom)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert serve_main([str(tiny_dir), "--host", "127.0.0.1", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"forerun serve: error: cannot listen on 127.0.0.1:{port}: ") and err.count("\n") == 1, err


@pytest.mark.slow
def test_response_format_json_schema_validates(served):
    """response_format json_schema through the server (structured output with n-gram speculation): the
    answer parses and validates against its schema (jsonschema), streamed or not."""
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    oc = client(served)
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Give me a person as JSON."}],
              max_completion_tokens=40, temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    r = oc.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop", r
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    streamed = "".join(c.choices[0].delta.content or "" for c in oc.chat.completions.create(stream=True, **kw))
    assert streamed == r.choices[0].message.content
    r2 = oc.chat.completions.create(**dict(kw, temperature=0.8, seed=5))
    if r2.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r2.choices[0].message.content), schema)
    with pytest.raises(openai.BadRequestError):  # a schema xgrammar cannot compile: 400, not 500
        oc.chat.completions.create(**dict(kw, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nonsense"}}}))


def test_response_format_maps_to_structured_output():
    """The mapping itself (no engine): json_schema / json_object become forerun.structured.StructuredOutput."""
    from forerun.server.params import plan_chat
    from forerun.server.protocol import ChatCompletionRequest
    from forerun.structured import StructuredOutput
    from tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "t5"}], "max_tokens": 4,
                                                "response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "x", "schema": schema}}})
    plan = plan_chat(req, tok, 64, None, structured=True)
    assert plan.params[0].structured_output == StructuredOutput(json_schema=schema)
    req2 = req.model_copy(update={"response_format": req.response_format.model_copy(update={"type": "json_object",
                                                                                         "json_schema": None})})
    assert plan_chat(req2, tok, 64, None, structured=True).params[0].structured_output == \
        StructuredOutput(json_object=True)
    from forerun.server.errors import APIError

    with pytest.raises(APIError) as e:
        plan_chat(req, tok, 64, None, structured=False)
    assert e.value.status == 400 and e.value.param == "response_format"


def test_client_gone_while_request_is_being_added_is_aborted(tiny_engine):
    """A client that hangs up while its request waits to enter the engine (the engine lock is held by a slow
    step) must not leave that request running: it is aborted at its first delta."""
    engine = tiny_engine()
    step = engine.step

    def slow_step():
        time.sleep(0.2)
        return step()

    engine.step = slow_step
    run = Running(build_app(engine, config=ServerConfig(model_names=("tiny",))))
    try:
        long = {"prompt": "t5 t6", "max_tokens": 300, "ignore_eos": True}

        async def main():
            async with httpx.AsyncClient(base_url=run.url, timeout=60) as ac:
                async with ac.stream("POST", "/v1/completions", json=dict(long, stream=True)) as r:
                    async for _ in r.aiter_lines():  # the engine is now busy with 0.2 s steps
                        break
                    for _ in range(3):  # each of these hangs up while its request waits for the engine lock
                        with pytest.raises(httpx.TimeoutException):
                            await ac.post("/v1/completions", json=long, timeout=0.05)
                # leaving the stream hangs up the first client too

        asyncio.run(main())
        m = wait_idle(run.url, timeout=10)  # unaborted, the four would run for 300 x 0.2 s
        assert m["forerun:kv_blocks_used"] == 0 and m["forerun:num_requests_running"] == 0, m
        assert m["forerun:num_requests_waiting"] == 0
    finally:
        run.stop()


@pytest.mark.parametrize("args, message", [
    (["--draft", "none", "--k", "4"], "--k does nothing"),
    (["--draft", "none", "--rule", "greedy"], "--rule need(s) a drafter"),
    (["--draft", "ngram", "--confidence", "0.5"], "--confidence does nothing with --draft ngram"),
    (["--draft", "no-such-draft"], "unknown draft model 'no-such-draft'"),
    (["--draft", "eagle:/nowhere"], "is not an EAGLE head folder"),
    (["--threads", "-1"], "--threads must be >= 0"),
    (["--kv-cache-gb", "inf"], "finite numbers"),
    (["--join-wait", "1", "inf"], "finite numbers"),
    (["--served-model-name", " "], "--served-model-name must not be empty"),
    (["--device", "bogus"], "--device 'bogus': not a device name"),
])
def test_cli_refuses_flags_that_would_do_nothing_or_break_late(capsys, args, message):
    """Judged before any weights load, one line, exit code 2 (a bad draft used to load the target first)."""
    assert serve_main(["x", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("forerun serve: error:"), err


def test_server_refuses_sampling_its_spec_would_ignore(tiny_engine):
    """rule 'greedy' would decode a sampled request greedily: the server answers 400 instead."""
    engine = tiny_engine(spec=SpecConfig(method="ngram", k=2, rule="greedy"))
    run = Running(build_app(engine, config=ServerConfig(model_names=("tiny",))))
    try:
        r = httpx.post(run.url + "/v1/completions", json={"prompt": "t5", "max_tokens": 2, "temperature": 0.7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
        r = httpx.post(run.url + "/v1/completions", json={"prompt": "t5", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        run.stop()
