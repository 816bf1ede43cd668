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

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

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
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats
    logprobs: list[dict] | None = None
