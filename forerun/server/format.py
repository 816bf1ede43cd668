"""OpenAI response and stream-chunk bodies for /v1/completions and /v1/chat/completions.

Logprobs come from the engine per token as {"token_id", "logprob", "top": {token_id: logprob}}; here they
become OpenAI's two shapes (the legacy completions arrays, and chat's content list with bytes). Token text
is the token decoded on its own (as vLLM does), cached per id.
"""
from __future__ import annotations

import time
from functools import lru_cache

from .errors import finite
from .runs import Choice, Run


class TokenText:
    def __init__(self, tokenizer) -> None:
        self._decode = lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t]))

    def __call__(self, token_id: int) -> str:
        return self._decode(int(token_id))


class _Formatter:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, token_text: TokenText, top_n: int | None) -> None:
        self.id, self.model, self.tok, self.top_n = response_id, model, token_text, top_n
        self.created = int(time.time())

    def _top(self, entry: dict) -> list[tuple[int, float]]:
        top = sorted(((int(t), float(lp)) for t, lp in (entry.get("top") or {}).items()), key=lambda x: -x[1])
        return top[: self.top_n or 0]

    def envelope(self, obj: str, choices: list, usage: dict | None = None, with_usage_key: bool = False) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or with_usage_key:
            out["usage"] = usage
        return out


class CompletionFormatter(_Formatter):
    object_name = "text_completion"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._offsets: dict[int, int] = {}

    def logprobs(self, c: Choice, entries: list[dict] | None) -> dict | None:
        if self.top_n is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offsets.get(c.index, 0)
        for e in entries or []:
            s = self.tok(e["token_id"])
            out["tokens"].append(s)
            out["token_logprobs"].append(finite(float(e["logprob"])))
            out["top_logprobs"].append({self.tok(t): finite(lp) for t, lp in self._top(e)})
            out["text_offset"].append(offset)
            offset += len(s)
        self._offsets[c.index] = offset
        return out

    def chunks(self, c: Choice, d) -> list[dict]:
        """Stream chunks for one delta of one choice (none when it carries nothing to show)."""
        finish = c.finish_reason if d is None or d.finished else None
        text = "" if d is None else d.text
        entries = None if d is None else d.logprobs
        if not text and finish is None and not entries:
            return []
        choice = {"index": c.index, "text": text, "logprobs": self.logprobs(c, entries), "finish_reason": finish}
        return [self.envelope(self.object_name, [choice])]

    def response(self, run: Run) -> dict:
        self._offsets.clear()
        choices = [{"index": c.index, "text": c.text, "logprobs": self.logprobs(c, c.logprobs),
                    "finish_reason": c.finish_reason} for c in run.choices]
        return self.envelope(self.object_name, choices, run.usage())


class ChatFormatter(_Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._started: set[int] = set()

    def _entry(self, t: int, lp: float) -> dict:
        s = self.tok(t)
        return {"token": s, "logprob": finite(lp), "bytes": list(s.encode("utf-8"))}

    def logprobs(self, entries: list[dict] | None) -> dict | None:
        if self.top_n is None:
            return None
        content = []
        for e in entries or []:
            item = self._entry(e["token_id"], float(e["logprob"]))
            item["top_logprobs"] = [self._entry(t, lp) for t, lp in self._top(e)]
            content.append(item)
        return {"content": content}

    def chunks(self, c: Choice, d) -> list[dict]:
        out = []
        if c.index not in self._started:  # OpenAI's first chunk per choice: the role
            self._started.add(c.index)
            out.append(self.envelope(self.chunk_object_name, [
                {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]))
        finish = c.finish_reason if d is None or d.finished else None
        text = "" if d is None else d.text
        entries = None if d is None else d.logprobs
        if text or finish is not None or entries:
            out.append(self.envelope(self.chunk_object_name, [
                {"index": c.index, "delta": {"content": text} if text else {}, "logprobs": self.logprobs(entries),
                 "finish_reason": finish}]))
        return out

    def response(self, run: Run) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.logprobs(c.logprobs), "finish_reason": c.finish_reason} for c in run.choices]
        return self.envelope(self.object_name, choices, run.usage())
