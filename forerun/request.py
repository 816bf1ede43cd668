"""Request state while it runs, and the RequestOutput a user gets back."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from .detokenizer import IncrementalDetokenizer
from .sampling_params import SamplingParams
from .stats import RequestStats


class FinishReason(str, Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller (Engine.abort, a closed stream, a client that went away)
    ERROR = "error"  # this request alone failed (Request.error says why); the others carry on


@dataclass
class Request:
    """One generation. Invariant between rounds: the target cache holds every token of `all_tokens`
    except the newest one, which is chosen but not yet fed to any model."""

    req_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    stop_token_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    detokenizer: IncrementalDetokenizer | None = None  # keeps `text` up to date token by token
    external_id: str = ""  # the caller's request id (Engine.add_request)
    coupled: bool = False  # seeded sampling through the position-keyed Gumbel coupling (engine/sampler.py)
    error: str | None = None  # why it finished with FinishReason.ERROR
    num_preemptions: int = 0  # times its KV blocks were taken back (it re-prefills prompt + output)
    arrival: float = 0.0  # time.monotonic() at add_request
    first_token_time: float | None = None  # time.monotonic() when its first output token was committed
    last_token_time: float | None = None  # ... its latest one
    finished_time: float | None = None  # ... when it finished (stop, length, abort or error)
    sent_tokens: int = 0  # output tokens already reported in a delta
    sent_text: int = 0  # characters of `text` already reported in a delta
    prompt_shared: int = 0  # prefix caching: its prompt's blocks were lent to the cache, 1: target pool, 2: draft's

    def metrics(self) -> "RequestMetrics":
        return RequestMetrics(self.arrival, self.first_token_time, self.last_token_time, self.finished_time)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def committed_prefix(self) -> list[int]:
        """The tokens whose keys and values the request's caches hold for certain between rounds: all committed ones
        but the newest (never fed), so nothing a rejected draft wrote (prefix caching registers only these)."""
        return self.all_tokens[: self.num_tokens - 1]

    @property
    def last_token(self) -> int:
        """The newest committed token (all_tokens[-1] without building the list)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)


@dataclass(frozen=True)
class RequestMetrics:
    """When a request's milestones happened, in time.monotonic() seconds (vLLM's RequestOutput.metrics): its arrival
    (add_request), its first output token committed (the prompt's forward included: time to first token), its
    latest token, its end. None: not reached yet."""

    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_seconds(self) -> float | None:
        """From the first output token to the latest: the time the tokens after the first took."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats
    logprobs: list[dict] | None = None
    metrics: RequestMetrics | None = None  # arrival, first / last token and finish times
