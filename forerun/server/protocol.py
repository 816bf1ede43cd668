"""Request bodies of the OpenAI API that `forerun serve` accepts, as strict pydantic models.

Strict on purpose: a wrong type is a 400, never a silent coercion ("5" is not 5), NaN/Infinity are refused,
and a field nobody here implements is refused by name instead of ignored (OpenAI answers unknown fields
with 400 "Unrecognized request argument" too). Fields that exist in OpenAI's API but that forerun cannot
honour (penalties, logit_bias, echo, tools, ...) are declared so that their neutral values pass and any
other value gets a 400 that names them (see `params.py`). Responses are plain dicts built in `app.py`.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage on every chunk


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # optional as in vLLM: the served model when left out
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # extra body (vLLM / SGLang names)
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both accepted
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    store: bool | None = None
