"""Incremental detokenisation: the text of a growing list of token ids without decoding all of it each time.

Decoding every output token's whole prefix costs O(n) per token, O(n^2) per request, and at large batches
with long outputs the host's decoding outgrows the device's step. Here each new token decodes only a short
window. Tokenizers do not decode slices independently (SentencePiece drops a leading space at the start of a
decode, byte-level BPE splits a character's UTF-8 bytes over tokens), so the window starts at an earlier
token, `prefix`, and the new text is decode(ids[prefix:]) minus decode(ids[prefix:read]), the part of the
window already shown; while the window ends inside a character (U+FFFD at the end), nothing is emitted.

The result equals the full decode for the tokenizers used here (tested at every step on the real Qwen2.5 and
SmolLM2 tokenizers with multi-byte text and arbitrary ids). It can differ where a decoder rewrites text it
already produced, e.g. SentencePiece byte-fallback bytes that later turn out to form invalid UTF-8 (then the
bytes already shown become U+FFFD). So the engine uses this text only while a request runs (stop strings,
streaming) and replaces it with the full decode, `final()`, when the request finishes: a request's final
text is always tokenizer.decode(all its ids), cut at the first stop string.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix = 0  # first id of the decode window
        self.read = 0  # ids before this one are in `text`

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        """Append one id; returns the text that became final (possibly empty)."""
        self.ids.append(token_id)
        shown = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        if len(window) <= len(shown) or window.endswith("\ufffd"):
            return ""  # nothing new yet (a partial character, or a special token that decodes to nothing)
        if not window.startswith(shown):  # the tokenizer rewrote the shown part (e.g. clean-up of spaces): resync
            full = self.final()
            delta, self.text = full[len(self.text) :], full
            self.prefix, self.read = len(self.ids) - 1, len(self.ids)
            return delta
        delta = window[len(shown) :]
        self.text += delta
        self.prefix, self.read = self.read, len(self.ids)
        return delta

    def final(self) -> str:
        return self._decode(self.ids)
