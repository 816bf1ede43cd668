"""SamplingParams: what a user asks of one request, validated on creation (vLLM-style)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .structured import StructuredOutput  # issue 14 (structured-output helper)

INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 1 << 20  # top-n logprobs beyond any vocabulary are refused


def _int(name: str, v, low: int, high: int = INT64_MAX) -> None:
    """v must be a whole number (not a bool, not a float) in [low, high]: the engine keeps these in int64."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if not low <= int(v) <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {v}")


def _number(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"{name} must be a number, got {v!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 or -1 = off). top_p: nucleus mass (1.0 = off).
    min_p: drop tokens whose probability is below min_p * max probability (0 = off).
    seed: per-request RNG seed (None = drawn from the engine's generator).
    max_tokens: number of new tokens at most. stop: strings that end the output (not included).
    stop_token_ids: extra token ids that end the output (the EOS token is added unless ignore_eos).
    logprobs: None, or n >= 0 to return the logprob of each emitted token and the top-n logprobs.
    forced_tokens: golden tokens: the first len(forced_tokens) output tokens are these, whatever the model
    would pick (replaying a transcript, teacher-forced scoring: with logprobs each gets the target's logprob
    at its position); generation continues freely after them, within max_tokens. With speculation a draft is
    accepted iff it equals the forced token (the verifier's golden override).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    structured_output: StructuredOutput | None = None  # constrain the output (JSON schema, regex, ...): forerun/structured.py
    forced_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Every value is checked here, with a message naming the field, so a bad one never reaches the
        # tensors (where 2**70 overflows an int64 deep inside generate).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if self.stop is None:
            object.__setattr__(self, "stop", ())
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        for t in ids:
            _int("stop_token_ids entry", t, 0)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        _number("temperature", self.temperature)
        if not (self.temperature >= 0.0) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        _int("top_k", self.top_k, -1)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _number("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _number("min_p", self.min_p)
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _int("seed", self.seed, -INT64_MAX - 1)
        _int("max_tokens", self.max_tokens, 1)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        forced = () if self.forced_tokens is None else self.forced_tokens
        if isinstance(forced, (str, bytes)):
            raise ValueError("forced_tokens must be a list of token ids, got a string")
        for t in forced:
            _int("forced_tokens entry", t, 0)
        object.__setattr__(self, "forced_tokens", tuple(int(t) for t in forced))
        if self.forced_tokens and self.structured_output is not None:
            raise ValueError("forced_tokens and structured_output cannot be combined (a forced token may break the grammar)")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError("structured_output must be a forerun.structured.StructuredOutput, got "
                             f"{type(self.structured_output).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
