"""AsyncEngine: the Engine's step loop in a background thread, requests as async iterators of deltas.

The event loop never runs a model: `generate()` validates and queues through a worker thread, the loop
thread steps the engine whenever it has work and hands each delta to its request's asyncio.Queue
(call_soon_threadsafe). Closing or cancelling a request's iterator (a client that went away) queues an
abort that the loop thread carries out before its next step, so the request's KV blocks (target and
draft) come back within one step. If a step raises, the engine is dead: every open iterator and every later
call raises EngineDeadError (a server's /health turns 503).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from typing import AsyncIterator

from ..sampling_params import SamplingParams
from .engine import Engine, EngineStats, RequestDelta


class EngineDeadError(RuntimeError):
    """The engine's step loop raised; no request can be served any more."""


_DEAD = object()


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # held for every engine call: a step, an add, an abort
        self._wake = threading.Event()
        self._aborts: collections.deque[str] = collections.deque()
        # validated requests waiting for the loop thread to queue them: an add never waits for the engine lock,
        # which the loop takes back step after step (a lock is not fair: adds starved behind a busy loop)
        self._adds: collections.deque = collections.deque()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="forerun-engine", daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def dead(self) -> bool:
        return self.error is not None

    async def shutdown(self, abort_running: bool = True) -> None:
        """Stop the loop: abort what is running (or, abort_running=False, finish it first)."""
        if self._thread is None:
            return
        if not abort_running:
            while self.engine.has_unfinished() and not self.dead:
                await asyncio.sleep(0.02)
        with self._lock:
            for rid in list(self.engine.requests):
                self._abort_locked(rid)
        self._stop = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None
        self._fail_adds(EngineDeadError("the engine was shut down"))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # -- the loop thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            try:
                with self._lock:
                    self._drain_adds()
                    while self._aborts:
                        self._abort_locked(self._aborts.popleft())
                    busy = self.engine.has_unfinished()
                    deltas = self.engine.step() if busy else []
            except BaseException as e:  # noqa: BLE001 - the loop must report any failure to every waiter
                self.error = e
                self._fail_adds(EngineDeadError(f"the engine loop died: {e!r}"))
                for loop, q in list(self._queues.values()):
                    loop.call_soon_threadsafe(q.put_nowait, _DEAD)
                return
            for d in deltas:
                self._deliver(d)
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    def _drain_adds(self) -> None:
        while self._adds:
            r, loop, q, done = self._adds.popleft()
            self._queues[r.external_id] = (loop, q)
            try:
                done.set_result(self.engine.enqueue(r))
            except BaseException as e:  # noqa: BLE001 - the adder gets it (a duplicate id)
                self._queues.pop(r.external_id, None)
                done.set_exception(e)

    def _fail_adds(self, error: BaseException) -> None:
        while self._adds:
            self._adds.popleft()[3].set_exception(error)

    def _deliver(self, d: RequestDelta) -> None:
        entry = self._queues.get(d.request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, d)

    def _abort_locked(self, request_id: str) -> bool:
        r = self.engine.requests.get(request_id)
        ok = self.engine.abort(request_id)
        if ok and r is not None:
            self._deliver(self.engine.finish_abort_delta(r))
        return ok

    # -- requests ------------------------------------------------------------------------------------
    async def add(self, prompt, params: SamplingParams | None = None, request_id: str | None = None, *,
                  chat: bool = False) -> tuple[str, asyncio.Queue]:
        """Validate and queue (ValueError / TypeError for a bad request); returns its id and delta queue."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        fut = loop.run_in_executor(None, self._add_and_register, prompt, params, request_id, chat, loop, q)
        try:
            rid = await asyncio.shield(fut)
        except asyncio.CancelledError:  # the caller left while the add was waiting: undo it when it lands
            def undo(f) -> None:
                if not f.cancelled() and f.exception() is None:
                    self._queues.pop(f.result(), None)
                    self._aborts.append(f.result())
                    self._wake.set()

            fut.add_done_callback(undo)
            raise
        self._wake.set()
        return rid, q

    def _add_and_register(self, prompt, params, request_id, chat, loop, q) -> str:
        if self.is_running and not self._stop:  # validated here, queued by the loop thread before its next step
            if self.dead:
                raise EngineDeadError(f"the engine loop died: {self.error!r}")
            r = self.engine.make_request(prompt, params, request_id, chat=chat)
            done: concurrent.futures.Future = concurrent.futures.Future()
            self._adds.append((r, loop, q, done))
            self._wake.set()
            if self.dead or not self.is_running:  # the loop ended meanwhile: nobody will drain it
                self._fail_adds(EngineDeadError(f"the engine loop died: {self.error!r}"))
            return done.result()
        with self._lock:
            if self.dead:
                raise EngineDeadError(f"the engine loop died: {self.error!r}")
            r = self.engine.make_request(prompt, params, request_id, chat=chat)
            self._queues[r.external_id] = (loop, q)
            try:
                return self.engine.enqueue(r)
            except BaseException:
                self._queues.pop(r.external_id, None)
                raise

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None, *,
                       chat: bool = False) -> AsyncIterator[RequestDelta]:
        """Deltas of one request until it finishes. Leaving the iterator early aborts the request."""
        rid, q = await self.add(prompt, params, request_id, chat=chat)
        finished = False
        try:
            while True:
                d = await q.get()
                if d is _DEAD:
                    raise EngineDeadError(f"the engine loop died: {self.error!r}")
                finished = d.finished
                yield d
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self._aborts.append(rid)
                self._wake.set()

    async def abort(self, request_id: str) -> bool:
        loop = asyncio.get_running_loop()

        def run() -> bool:
            with self._lock:
                return self._abort_locked(str(request_id))

        return await loop.run_in_executor(None, run)
