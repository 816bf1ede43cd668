"""The FastAPI app of `forerun serve`: OpenAI routes over an AsyncEngine, /health, /metrics.

`build_app(engine)` wires the pieces: a pure-ASGI gate in front of everything (API key, body size limit,
503 while draining, error counting), body parsing and parameter checks (protocol.py, params.py: every
refusal a 400 in OpenAI's error shape), the engine run of each request (runs.py) raced against the client's
disconnect, and the response bodies (format.py). Nothing the client sends can produce a 5xx: the only 5xx
answers are 503 (engine dead, shutting down) and 500 for a bug, without a traceback.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.responses import Response, StreamingResponse

from ..engine.async_engine import AsyncEngine, EngineDeadError
from .errors import APIError, dumps, from_validation_error, install_handlers, json_response
from .format import ChatFormatter, CompletionFormatter, TokenText
from .metrics import ServerMetrics
from .params import Plan, plan_chat, plan_completion
from .protocol import ChatCompletionRequest, CompletionRequest
from .runs import Run

log = logging.getLogger("forerun.server")

THREAD_BODY_BYTES = 32 << 10  # tokenise bodies larger than this in a worker thread, off the event loop


@dataclass
class ServerConfig:
    """model_names: the ids /v1/models lists and requests may name (the first is the default).
    max_queue: requests waiting beyond the running batch (max_num_seqs); more get 429.
    default_max_tokens: chat requests without max_(completion_)tokens get min(this, room left in the context)
    (None: the room left); completions default to 16 as in OpenAI's API.
    drain_seconds: on shutdown, how long in-flight requests may still run before they are aborted."""

    model_names: tuple[str, ...] = ("forerun",)
    api_key: str | None = None
    max_num_seqs: int = 64
    max_queue: int = 256
    max_body_bytes: int = 8 << 20
    default_max_tokens: int | None = 1024
    drain_seconds: float = 30.0


class _ClientGone(Exception):
    pass


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _race(request: Request, coro):
    """Run coro until it finishes or the client disconnects (then cancel it and raise _ClientGone)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _ClientGone()
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends: finished, client gone (Starlette cancels the
    body before or while it runs), or server shutdown. The body generator's own finally is not enough: a
    generator cancelled before its first step, or while parked at a yield, never runs it."""

    def __init__(self, content, on_close, **kw) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Gate:
    """Pure ASGI middleware, before any body is read: API key on /v1/* (constant-time compare), 503 on new
    /v1 requests while draining, request body size limit (413), and error counting for /metrics."""

    def __init__(self, app, server: "Server") -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        srv = self.server

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                srv.metrics.error(message["status"])
            await send(message)

        path = scope.get("path", "")
        if path.startswith("/v1/"):
            key = srv.config.api_key
            if key is not None and not self._authorized(scope, key):
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", None,
                               "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await err.response()(scope, receive, counted_send)
            if srv.draining and scope.get("method") == "POST":
                err = APIError(503, "the server is shutting down", None, "shutting_down")
                return await err.response()(scope, receive, counted_send)
        limit = srv.config.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > limit
                except ValueError:
                    too_big = False  # h11/httptools refuse a malformed length before we get here
                if too_big:
                    err = APIError(413, f"request body larger than {limit} bytes", None, "body_too_large")
                    return await err.response()(scope, receive, counted_send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise APIError(413, f"request body larger than {limit} bytes", None, "body_too_large")
            return message

        await self.app(scope, limited_receive, counted_send)

    @staticmethod
    def _authorized(scope, key: str) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(token.strip().encode("utf-8"), key.encode("utf-8"))
        return False


class Server:
    """State shared by the routes: the engine, its tokenizer, the metrics, the requests in flight."""

    def __init__(self, engine, aeng: AsyncEngine | None, config: ServerConfig) -> None:
        self.engine, self.config = engine, config
        self.aeng = aeng or AsyncEngine(engine)
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.max_model_len)
        # response_format needs an engine that applies SamplingParams.structured_output (forerun/structured.py)
        self.structured = bool(getattr(engine, "supports_structured_output", True))
        self.token_text = TokenText(self.tokenizer)
        self.metrics = ServerMetrics(self.aeng.stats, config.model_names[0])
        self.inflight = 0  # engine requests (choices) admitted and not yet closed
        self.runs: set[Run] = set()
        self.draining = False
        self.started = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- admission ---------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.config.model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def admit(self, n: int) -> None:
        if self.aeng.dead:
            raise APIError(503, "the engine loop has stopped; restart the server", None, "engine_dead")
        if self.draining:
            raise APIError(503, "the server is shutting down", None, "shutting_down")
        capacity = self.config.max_num_seqs + self.config.max_queue
        if n > capacity:
            raise APIError(400, f"this request asks for {n} sequences (prompts x n); the server holds at most "
                           f"{capacity}", "n", "too_many_sequences")
        if self.inflight + n > capacity:
            raise APIError(429, f"the server's queue is full ({capacity} requests); retry later", None, "queue_full",
                           headers={"Retry-After": "1"})
        self.inflight += n

    def _on_finish(self, run: Run, c, now: float) -> None:
        self.metrics.finished(c.finish_reason, len(c.prompt_ids), c.num_output_tokens, run.arrival,
                              c.first_token_at, now)

    # -- shutdown ----------------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Stop accepting (503), let in-flight requests run for drain_seconds, then abort what is left."""
        if self.draining:
            return
        self.draining = True
        log.info("draining: %d request(s) in flight, abort after %.1fs", len(self.runs), self.config.drain_seconds)
        if self.loop is not None:
            self.loop.call_later(self.config.drain_seconds, self.abort_all)

    def abort_all(self) -> None:
        for run in list(self.runs):
            run.abort()

    # -- one request -------------------------------------------------------------------------------------
    async def serve(self, request: Request, plan: Plan, fmt, arrival: float, request_id: str) -> Response:
        check = getattr(getattr(self.engine, "spec", None), "check_sampling", None)
        for params in plan.params if check is not None else ():
            try:  # e.g. rule 'greedy' would decode a sampled request greedily: refused, not ignored
                check(params)
            except ValueError as e:
                raise APIError(400, str(e).splitlines()[0], "temperature", "unsupported_by_server_config") from None
        self.admit(len(plan.params))
        run = Run(self.aeng, plan.prompts, plan.params, plan.n, request_id, arrival, self._on_finish)
        self.runs.add(run)
        handed_to_stream = False
        try:
            try:
                await _race(request, run.start())
            except ValueError as e:  # the engine refused the request (too long for the KV pool, bad ids, ...)
                msg = str(e).splitlines()[0] if str(e) else "invalid request"
                raise APIError(400, msg, None, "invalid_request") from None
            except EngineDeadError:
                raise APIError(503, "the engine loop has stopped; restart the server", None, "engine_dead") from None
            if plan.stream:
                handed_to_stream = True
                return _SSEResponse(self._sse(run, plan, fmt), lambda: self._close(run), media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            await _race(request, self._collect(run))
            bad = [c for c in run.choices if c.finish_reason == "error"]
            if bad:
                dead = self.aeng.dead
                raise APIError(503 if dead else 500, f"generation failed: {bad[0].error}", None,
                               "engine_dead" if dead else "generation_error")
            return json_response(fmt.response(run))
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the run is closed below
        finally:
            if not handed_to_stream:
                self._close(run)

    def _close(self, run: Run) -> None:
        if not run.closed:
            run.close()
            self.inflight -= len(run.choices)
            self.runs.discard(run)

    async def _collect(self, run: Run) -> None:
        async for _ in run.deltas():
            pass

    async def _sse(self, run: Run, plan: Plan, fmt):
        """SSE body. If the client goes away, Starlette cancels this generator: the finally closes the run,
        which aborts its engine requests at once."""
        try:
            async for c, d in run.deltas():
                if isinstance(d, BaseException):
                    dead = self.aeng.dead or isinstance(d, EngineDeadError)
                    err = APIError(503 if dead else 500, f"generation failed: {c.error}", None,
                                   "engine_dead" if dead else "generation_error")
                    yield f"data: {dumps(err.body())}\n\n"
                    continue
                for chunk in fmt.chunks(c, d):
                    if plan.include_usage or plan.continuous_usage:
                        chunk["usage"] = run.usage() if plan.continuous_usage else None
                    yield f"data: {dumps(chunk)}\n\n"
            if plan.include_usage:
                yield f"data: {dumps(fmt.envelope(fmt.chunk_object_name or fmt.object_name, [], run.usage()))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self._close(run)


async def _parse(request: Request, model_cls):
    body = await request.body()
    try:
        return model_cls.model_validate_json(body or b"null"), len(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    except (ValueError, RecursionError):
        raise APIError(400, "the body is not valid JSON", None, "invalid_json") from None


def build_app(engine, aeng: AsyncEngine | None = None, config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app serving `engine` (an Engine; its AsyncEngine is made here unless given). The lifespan
    starts the engine loop and shuts it down (aborting what still runs)."""
    config = config or ServerConfig(model_names=(getattr(engine, "model_name", None) or "forerun",),
                                    max_num_seqs=getattr(engine, "max_num_seqs", 64))
    srv = Server(engine, aeng, config)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        srv.loop = asyncio.get_running_loop()
        if not srv.aeng.is_running:
            await srv.aeng.start()
        try:
            yield
        finally:
            srv.draining = True
            srv.abort_all()
            await srv.aeng.shutdown(abort_running=True)

    app = FastAPI(title="forerun", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv
    install_handlers(app)
    app.add_middleware(Gate, server=srv)

    @app.get("/health")
    async def health() -> Response:
        if srv.aeng.dead:
            return APIError(503, "the engine loop has stopped", None, "engine_dead").response()
        if srv.draining:
            return APIError(503, "the server is shutting down", None, "shutting_down").response()
        return json_response({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": srv.started, "owned_by": "forerun",
                "max_model_len": srv.max_model_len}

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card(n) for n in config.model_names]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> Response:
        srv.check_model(name)
        return json_response(model_card(name))

    async def plan_for(fn, size: int, *args) -> Plan:
        if size > THREAD_BODY_BYTES:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req, size = await _parse(request, CompletionRequest)
        srv.check_model(req.model)
        plan = await plan_for(plan_completion, size, req, srv.tokenizer, srv.max_model_len, 16, srv.structured)
        rid = f"cmpl-{uuid.uuid4().hex}"
        fmt = CompletionFormatter(rid, req.model or config.model_names[0], srv.token_text, plan.logprobs)
        return await srv.serve(request, plan, fmt, arrival, rid)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req, size = await _parse(request, ChatCompletionRequest)
        srv.check_model(req.model)
        plan = await plan_for(plan_chat, size, req, srv.tokenizer, srv.max_model_len, config.default_max_tokens,
                              srv.structured)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormatter(rid, req.model or config.model_names[0], srv.token_text, plan.logprobs)
        return await srv.serve(request, plan, fmt, arrival, rid)

    return app
