"""LLM: the offline API (generate a list of prompts, stream one) as a thin wrapper over the online Engine.

Thread safety: one LLM may be shared between threads. Every engine call (adding requests, one step) holds the
LLM's lock; each caller steps the engine until its own requests are finished, so concurrent callers share
rounds (continuous batching) and each gets exactly its own outputs. A stream held open and a generate
running at the same time share the engine the same way (no lock is held across a yield).
"""
from __future__ import annotations

import threading
from typing import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from ..config import CacheConfig, SpecConfig
from ..request import FinishReason, Request, RequestOutput
from ..sampling_params import SamplingParams
from ..stats import RequestStats, aggregate
from .engine import Engine


class RequestError(RuntimeError):
    """A request finished with an error (e.g. it could never fit the KV pool); the others kept their outputs."""


class LLM:
    def __init__(self, model: str, *, spec: SpecConfig | None = None, device: str | None = None,
                 dtype: torch.dtype | None = None, cache: CacheConfig | None = None, max_num_seqs: int = 64,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 8192, seed: int = 0,
                 check_invariants: bool = False, cuda_graphs: bool = True, overlap: bool = True,
                 overlap_spec: bool = True, mixed_prefill: bool = False,
                 draft_cache: CacheConfig | None = None, quantize: str | None = None,
                 join_wait: tuple[float, int] | None = None, enable_prefix_caching: bool = True,
                 _loaded=None) -> None:
        """overlap: with CUDA graphs, run plain decoding steps overlapped with the host's commits (engine/overlap.py);
        overlap_spec: speculative rounds too (engine/overlap_spec.py; CUDA graphs, greedy, a separate draft model);
        mixed_prefill: True mixes new prompts into the running requests' rounds; False (default) reads them in rounds
        of their own while the others run such sessions (Engine); join_wait=(ratio, steps): Engine's;
        enable_prefix_caching: prompts reuse the keys and values of earlier requests' equal prefixes (Engine)."""
        self.engine = Engine(model, spec=spec, device=device, dtype=dtype, cache=cache, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, seed=seed,
                             check_invariants=check_invariants, cuda_graphs=cuda_graphs, overlap=overlap,
                             overlap_spec=overlap_spec, mixed_prefill=mixed_prefill, draft_cache=draft_cache,
                             quantize=quantize, join_wait=join_wait, enable_prefix_caching=enable_prefix_caching,
                             _loaded=_loaded)
        self._lock = threading.RLock()

    @classmethod
    def from_model(cls, model, tokenizer, **kw) -> "LLM":
        """Wrap an already built model (tests, benchmarks)."""
        return cls("<in-memory>", _loaded=(model, tokenizer, None), **kw)

    # the engine's parts, for callers that look inside (tests, benchmarks)
    model = property(lambda self: self.engine.model)
    tokenizer = property(lambda self: self.engine.tokenizer)
    runner = property(lambda self: self.engine.runner)
    drafter = property(lambda self: self.engine.drafter)
    spec = property(lambda self: self.engine.spec)
    device = property(lambda self: self.engine.device)
    max_num_seqs = property(lambda self: self.engine.max_num_seqs)

    @property
    def overlap(self) -> bool:
        return self.engine.overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self.engine.overlap = value

    # -- requests --------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Engine.reset_prefix_cache: forget every pool's cached prefixes (held blocks stay until released)."""
        with self._lock:
            return self.engine.reset_prefix_cache()

    def _requests(self, prompts, sampling_params, chat) -> list[Request]:
        """Tokenize and validate every request before any is queued (a bad one raises, nothing runs)."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts: a string, a list of token ids, or a list of those; got {type(prompts).__name__}")
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        with self._lock:
            return [self.engine.make_request(p, sp, chat=chat) for p, sp in zip(prompts, plist)]

    def _submit(self, requests: list[Request]) -> None:
        with self._lock:
            for r in requests:
                self.engine.enqueue(r)

    def _abort_unfinished(self, requests: list[Request]) -> None:
        with self._lock:
            for r in requests:
                if not r.finished:
                    self.engine.abort(r.external_id)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 chat: bool = False, progress: bool = False, raise_on_error: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (a string, or a list of token ids); returns outputs in prompt order.
        A request that fails on its own (finish_reason 'error') does not take the others down: with
        raise_on_error (default) a RequestError naming it is raised after all have finished; else its output
        carries finish_reason 'error'."""
        requests = self._requests(prompts, sampling_params, chat)
        bar = tqdm(total=sum(r.params.max_tokens for r in requests), disable=not progress, unit="tok")
        self._submit(requests)
        shown = 0
        try:
            while True:
                with self._lock:
                    if all(r.finished for r in requests):
                        break
                    if not self.engine.has_unfinished():
                        raise RuntimeError("the engine has nothing left to run but a request is unfinished")
                    self.engine.step()
                now = sum(len(r.output_token_ids) for r in requests)
                bar.update(now - shown)
                shown = now
        finally:
            bar.close()
            self._abort_unfinished(requests)
        outs = [self._output(r) for r in requests]
        failed = [r for r in requests if r.finish_reason == FinishReason.ERROR]
        if failed and raise_on_error:
            err = RequestError("; ".join(r.error or f"request {r.external_id} failed" for r in failed))
            err.outputs = outs  # the others' outputs are kept
            raise err
        return outs

    def stream(self, prompt, sampling_params: SamplingParams | None = None, *, chat: bool = False) -> Iterator[str]:
        """Yield the text of one request as it grows. Text that a stop string could still cut is held back, so
        the pieces always join to the final text. Closing the iterator early aborts the request."""
        (req,) = self._requests([prompt], sampling_params, chat)
        self._submit([req])
        shown = 0
        try:
            while True:
                with self._lock:
                    if not req.finished:
                        self.engine.step()
                    end = self.engine.visible_text_end(req)
                if end > shown:
                    yield req.text[shown:end]
                    shown = end
                if req.finished:
                    break
            if req.finish_reason == FinishReason.ERROR:
                raise RequestError(req.error)
        finally:
            self._abort_unfinished([req])

    @staticmethod
    def _output(r: Request) -> RequestOutput:
        return RequestOutput(r.req_id, r.prompt, r.prompt_token_ids, r.text, list(r.output_token_ids),
                             r.finish_reason.value, r.stats, r.logprobs if r.params.logprobs is not None else None,
                             r.metrics())

    @staticmethod
    def aggregate_stats(outputs: list[RequestOutput]) -> RequestStats:
        return aggregate([o.stats for o in outputs])
