"""OpenAI request -> what the engine runs: prompt token ids and one SamplingParams per choice.

Every parameter is checked here, before anything reaches the engine, and every refusal is an `APIError` 400
naming the parameter: out-of-range values, parameters forerun does not implement set to a non-neutral value
(penalties, logit_bias, echo, tools, ...), prompts too long for the context (with the context length in the
message, as OpenAI and vLLM word it). Nothing is silently ignored or clamped.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..sampling_params import SamplingParams
from .errors import APIError, bad_request
from .protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat, _SamplingFields

MAX_CHOICES = 64  # prompts x n per HTTP request
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_STOP = 16
MAX_STOP_TOKEN_IDS = 256
INT32_MAX = 2**31 - 1


@dataclass
class Plan:
    """What one HTTP request asks of the engine. Choice i belongs to prompt i // n."""

    prompts: list[list[int]]  # token ids per prompt
    params: list[SamplingParams]  # per choice: len(prompts) * n
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None  # top logprobs per token (0 = only the sampled token's); None = no logprobs


def _range(value, name: str, lo, hi, lo_open: bool = False) -> None:
    if value is None:
        return
    if (value <= lo if lo_open else value < lo) or value > hi:
        left = "(" if lo_open else "["
        raise bad_request(f"{name} must be in {left}{lo}, {hi}], got {value}", name, "invalid_value")


def _unsupported(name: str, why: str = "is not supported by forerun") -> APIError:
    return bad_request(f"{name} {why}", name, "unsupported_parameter")


def _structured_output(rf: ResponseFormat | None, supported: bool):
    """response_format -> SamplingParams.structured_output (forerun/structured.py). `supported`: the engine
    applies it (an engine may say it does not: `supports_structured_output = False`); otherwise a 400, never
    an unconstrained answer."""
    if rf is None or rf.type == "text":
        if rf is not None and rf.json_schema is not None:
            raise bad_request("response_format.json_schema is only allowed with type 'json_schema'", "response_format")
        return None
    if not supported or "structured_output" not in {f.name for f in dataclasses.fields(SamplingParams)}:
        raise _unsupported("response_format", f"type {rf.type!r} is not supported by this engine "
                           "(no structured output)")
    from ..structured import StructuredOutput

    if rf.type == "json_object":
        return StructuredOutput(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("response_format type 'json_schema' needs json_schema.schema", "response_format.json_schema")
    try:
        return StructuredOutput(json_schema=rf.json_schema.schema_)
    except (ValueError, TypeError) as e:
        msg = str(e).splitlines()[0] if str(e) else "invalid JSON schema"
        raise bad_request(f"response_format.json_schema.schema: {msg}", "response_format.json_schema.schema",
                          "invalid_schema") from None


def _common(req: _SamplingFields, logprobs: int | None, structured: bool) -> dict:
    """Sampling keyword arguments shared by both endpoints (max_tokens and the seed are set per choice)."""
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise bad_request(f"n must be in [1, {MAX_CHOICES}], got {req.n}", "n", "invalid_value")
    _range(req.temperature, "temperature", 0.0, 2.0)
    _range(req.top_p, "top_p", 0.0, 1.0, lo_open=True)
    _range(req.min_p, "min_p", 0.0, 1.0)
    if req.top_k is not None and not -1 <= req.top_k <= INT32_MAX:
        raise bad_request(f"top_k must be -1 (off), 0 (off) or a positive count, got {req.top_k}", "top_k",
                          "invalid_value")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise bad_request("seed must be a 64-bit signed integer", "seed", "invalid_value")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        _range(v, name, -2.0, 2.0)
        if v:
            raise _unsupported(name, "is not supported by forerun (only 0)")
    if req.repetition_penalty is not None and req.repetition_penalty != 1.0:
        raise _unsupported("repetition_penalty", "is not supported by forerun (only 1.0)")
    if req.logit_bias:
        raise _unsupported("logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise bad_request(f"stop: at most {MAX_STOP} sequences, got {len(stop)}", "stop", "invalid_value")
    if any(not s for s in stop):
        raise bad_request("stop sequences must be non-empty strings", "stop", "invalid_value")
    stop_ids = list(req.stop_token_ids or [])
    if len(stop_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t <= INT32_MAX for t in stop_ids):
        raise bad_request(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids >= 0", "stop_token_ids", "invalid_value")
    kw = dict(temperature=1.0 if req.temperature is None else float(req.temperature),
              top_p=1.0 if req.top_p is None else float(req.top_p),
              top_k=0 if req.top_k is None else req.top_k,
              min_p=0.0 if req.min_p is None else float(req.min_p),
              stop=tuple(stop), stop_token_ids=tuple(stop_ids), ignore_eos=bool(req.ignore_eos), logprobs=logprobs)
    so = _structured_output(req.response_format, structured)
    if so is not None:
        kw["structured_output"] = so
    return kw


def _seed(seed: int | None, i: int) -> int | None:
    """Choice i of n uses seed + i (wrapped to int64): reproducible, yet the n samples differ."""
    if seed is None:
        return None
    return (seed + i + 2**63) % 2**64 - 2**63


def _max_tokens(requested: int | None, name: str, prompt_len: int, max_model_len: int, default: int | None,
                prompt_name: str) -> int:
    if prompt_len >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your "
                          f"{prompt_name} has {prompt_len} tokens, which leaves no room for a completion. Please "
                          f"reduce the length of the {prompt_name}.", prompt_name, "context_length_exceeded")
    if requested is None:
        return max_model_len - prompt_len if default is None else min(default, max_model_len - prompt_len)
    if requested < 1:
        raise bad_request(f"{name} must be >= 1, got {requested}", name, "invalid_value")
    if prompt_len + requested > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{prompt_len + requested} tokens ({prompt_len} in the {prompt_name}, {requested} in the "
                          f"completion). Please reduce the length of the {prompt_name} or completion.",
                          name, "context_length_exceeded")
    return requested


def _build(prompts: list[list[int]], req: _SamplingFields, common: dict, requested: int | None, name: str,
           max_model_len: int, default_max: int | None, prompt_name: str, logprobs: int | None) -> Plan:
    n = req.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices per request (prompts x n), got {len(prompts) * n}", "n")
    params = []
    for p, ids in enumerate(prompts):
        if not ids:
            raise bad_request(f"the {prompt_name} is empty", prompt_name, "empty_prompt")
        mt = _max_tokens(requested, name, len(ids), max_model_len, default_max, prompt_name)
        for i in range(n):
            try:
                params.append(SamplingParams(**common, max_tokens=mt, seed=_seed(req.seed, p * n + i)))
            except (ValueError, TypeError) as e:
                raise bad_request(str(e).splitlines()[0] if str(e) else "invalid sampling parameters") from None
    so = req.stream_options
    return Plan(prompts, params, n, bool(req.stream), bool(so and so.include_usage),
                bool(so and so.continuous_usage_stats), logprobs)


def plan_completion(req: CompletionRequest, tokenizer, max_model_len: int, default_max_tokens: int = 16,
                    structured: bool = False) -> Plan:
    """/v1/completions. max_tokens defaults to 16 as in OpenAI's API."""
    if req.echo:
        raise _unsupported("echo")
    if req.suffix:
        raise _unsupported("suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise _unsupported("best_of", "other than n is not supported by forerun")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs", "invalid_value")
    common = _common(req, req.logprobs, structured)
    p = req.prompt
    if isinstance(p, str):
        prompts = [tokenizer.encode(p)]
    elif not p:
        raise bad_request("prompt must not be an empty list", "prompt", "empty_prompt")
    elif isinstance(p[0], str):
        prompts = [tokenizer.encode(s) for s in p]
    elif isinstance(p[0], int):
        prompts = [list(p)]
    else:
        prompts = [list(x) for x in p]
    for ids in prompts:
        if ids and (min(ids) < 0 or max(ids) > INT32_MAX):
            raise bad_request("prompt token ids must be >= 0", "prompt", "invalid_value")
    return _build(prompts, req, common, req.max_tokens, "max_tokens", max_model_len, default_max_tokens,
                  "prompt", req.logprobs)


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template expects them: text parts joined, 'developer' read as 'system'."""
    if not req.messages:
        raise bad_request("messages must not be empty", "messages", "empty_prompt")
    out = []
    for i, m in enumerate(req.messages):
        if m.role == "tool" or m.tool_calls or m.tool_call_id is not None:
            raise _unsupported(f"messages.{i}", "(tool calls and tool messages) is not supported by forerun")
        if m.content is None:
            raise bad_request(f"messages.{i}.content must be a string or a list of text parts", f"messages.{i}.content")
        text = m.content if isinstance(m.content, str) else "\n".join(part.text for part in m.content)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def apply_chat_template(tokenizer, messages: list[dict]) -> list[int]:
    """The model's own chat template (from its tokenizer / GGUF metadata), generation prompt appended."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages", "no_chat_template")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # jinja2 TemplateError / raise_exception in the template: a message-order problem
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise bad_request(f"the chat template rejected the messages: {msg}", "messages", "invalid_messages") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def plan_chat(req: ChatCompletionRequest, tokenizer, max_model_len: int, default_max_tokens: int | None,
              structured: bool = False) -> Plan:
    """/v1/chat/completions. max_completion_tokens (or the deprecated max_tokens) defaults to the rest of the
    context, capped by the server's default_max_tokens."""
    if req.tools or req.functions:
        raise _unsupported("tools", "(function calling) is not supported by forerun")
    for name in ("tool_choice", "function_call"):
        if getattr(req, name) not in (None, "none"):
            raise _unsupported(name, "(function calling) is not supported by forerun")
    if req.store:
        raise _unsupported("store")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", "top_logprobs",
                              "invalid_value")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    common = _common(req, logprobs, structured)
    ids = apply_chat_template(tokenizer, chat_messages(req))
    if req.max_completion_tokens is not None:
        requested, name = req.max_completion_tokens, "max_completion_tokens"
    else:
        requested, name = req.max_tokens, "max_tokens"
    return _build([ids], req, common, requested, name, max_model_len, default_max_tokens, "messages", logprobs)
