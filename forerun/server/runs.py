"""One HTTP request's choices inside the engine: start them, merge their deltas, abort them.

Each choice's `AsyncEngine.generate` iterator is driven by its own task (a pump) that pushes deltas into one
queue. Cancelling a pump cancels its iterator, which aborts the request in the engine at once (its KV blocks
come back); `close()` does only that and is synchronous, so it still works from a `finally` under a
cancelled scope (a client that went away mid-stream).

A pump is cancelled only once its request has produced a delta: before that, `generate` may still be
adding the request in a worker thread, and cancelling it there would leave the request running with
nobody to abort it. A pump closed that early stops (and so aborts) at its first delta instead.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..sampling_params import SamplingParams
from ..stats import RequestStats, aggregate

_END = object()  # the iterator ended
_ABORTED = object()  # aborted by the server (shutdown deadline)


@dataclass
class Choice:
    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    text: str = ""
    num_output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[dict] = field(default_factory=list)
    first_token_at: float | None = None
    started: bool = False  # its request has produced a delta (it is in the engine: cancelling aborts it)
    ended: bool = False  # no more items will come for it
    stop: bool = False  # closed before it started: stop at the first delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Run:
    """The choices of one HTTP request. Usage: `await start()` (engine validation errors surface here, before
    any response is sent), then `async for choice, delta in deltas()`, and `close()` in a finally."""

    def __init__(self, aeng, prompts: list[list[int]], params: list[SamplingParams], n: int, request_id: str,
                 arrival: float, on_finish=None) -> None:
        self.aeng, self.arrival, self.on_finish, self.n = aeng, arrival, on_finish, n
        self.choices = [Choice(i, i // n, f"{request_id}-{i}", prompts[i // n], p) for i, p in enumerate(params)]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pumps: list[asyncio.Task] = []
        self._buffered: list[tuple[Choice, Any]] = []
        self.closed = False

    async def _pump(self, c: Choice) -> None:
        agen = self.aeng.generate(c.prompt_ids, c.params, request_id=c.request_id)
        try:
            async for d in agen:
                c.started = True
                if c.first_token_at is None and d.new_token_ids:  # stamped on arrival, not when read
                    c.first_token_at = time.perf_counter()
                if c.stop:
                    break  # the finally's aclose aborts the request
                self.queue.put_nowait((c, d))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the reader, which maps it to a status
            self.queue.put_nowait((c, e))
        else:
            self.queue.put_nowait((c, _END))
        finally:
            await agen.aclose()

    async def start(self) -> None:
        """Launch every choice and wait for each one's first item; raises the first error (ValueError for a
        request the engine refuses, EngineDeadError, ...)."""
        self.pumps = [asyncio.create_task(self._pump(c)) for c in self.choices]
        pending = {c.index for c in self.choices}
        while pending:
            c, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            self._buffered.append((c, item))
            pending.discard(c.index)

    def _apply(self, c: Choice, d) -> None:
        c.text += d.text
        c.num_output_tokens = d.num_output_tokens
        c.stats = d.stats
        if d.logprobs:
            c.logprobs.extend(d.logprobs)
        if d.finished:
            self._finish(c, d.finish_reason or "stop", d.error)

    def _finish(self, c: Choice, reason: str, error: str | None = None) -> None:
        if c.finished:
            return
        c.finish_reason, c.error = reason, error
        if self.on_finish is not None:
            self.on_finish(self, c, time.perf_counter())

    async def _items(self):
        while self._buffered:
            yield self._buffered.pop(0)
        while True:
            yield await self.queue.get()

    async def deltas(self) -> AsyncIterator[tuple[Choice, Any]]:
        """(choice, RequestDelta) in arrival order until every choice has ended. A choice whose iterator fails
        yields (choice, exception) and is finished with reason 'error'; one that ends without a finishing
        delta (aborted at the shutdown deadline) yields (choice, None) and is finished with reason 'abort'."""
        live = len(self.choices)
        async for c, item in self._items():
            if c.ended:
                continue
            if item is _END or item is _ABORTED:
                c.ended = True
                live -= 1
                if not c.finished:
                    self._finish(c, "abort")
                    yield c, None
            elif isinstance(item, BaseException):
                c.ended = True
                live -= 1
                self._finish(c, "error", str(item) or type(item).__name__)
                yield c, item
            else:
                self._apply(c, item)
                yield c, item
            if not live:
                return

    def _halt(self, c: Choice, t: asyncio.Task) -> None:
        if t.done():
            return
        if c.started:
            t.cancel()
        else:
            c.stop = True

    def abort(self) -> None:
        """Abort every unfinished choice now (server shutdown); each ends with finish_reason 'abort'."""
        for c, t in zip(self.choices, self.pumps):
            if not c.finished and not c.ended:
                self._halt(c, t)
                self.queue.put_nowait((c, _ABORTED))

    def close(self) -> None:
        """Stop whatever still runs (its engine requests are aborted); idempotent, synchronous."""
        if self.closed:
            return
        self.closed = True
        for c, t in zip(self.choices, self.pumps):
            self._halt(c, t)
            if not c.finished:
                self._finish(c, "abort")

    async def wait_closed(self, timeout: float = 5.0) -> None:
        """After close(): wait until the pumps (and so the aborts) are done."""
        if self.pumps:
            await asyncio.wait(self.pumps, timeout=timeout)

    # -- results -----------------------------------------------------------------------------------------
    def usage(self) -> dict:
        """OpenAI usage (each prompt counted once, every choice's output; prompt_tokens_details.cached_tokens: its tokens
        read from the prefix cache) plus the speculation statistics of
        all choices together (forerun/stats.py: drafted, accepted, acceptance_rate, mean_accepted_length, ...)."""
        prompt = sum(len(c.prompt_ids) for c in self.choices if c.index % self.n == 0)
        completion = sum(c.num_output_tokens for c in self.choices)
        spec = aggregate([c.stats for c in self.choices]).as_dict()
        cached = sum(c.stats.cached_tokens for c in self.choices if c.index % self.n == 0)  # (--enable-prefix-caching)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}, "speculation": spec}
