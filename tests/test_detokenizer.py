"""Incremental detokenisation (forerun/detokenizer.py) against decoding everything each time."""
from __future__ import annotations

import pytest
import torch

from forerun.detokenizer import IncrementalDetokenizer
from tiny import tiny_tokenizer

SAMPLE = ("def naïve_sum(xs):\n    \"\"\"Σ of a list — über-fast 🚀\"\"\"\n    return sum(xs)  # 合計\n\n"
          "Café, résumé, 東京, Ελληνικά, emoji: 🤖👍🏽, tabs\tand  double  spaces. ")


def check_incremental(tok, ids, skip_special_tokens=True):
    """At every step the incremental text is a prefix of the full decode; at the end it is all of it."""
    det = IncrementalDetokenizer(tok, skip_special_tokens)
    pieces = []
    for i, t in enumerate(ids):
        pieces.append(det.add(t))
        full = tok.decode(ids[: i + 1], skip_special_tokens=skip_special_tokens)
        assert full.startswith(det.text), (i, det.text[-20:], full[-20:])
        assert "".join(pieces) == det.text
    assert det.text == det.final() == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_tiny_tokenizer_random_ids():
    tok = tiny_tokenizer()
    g = torch.Generator().manual_seed(0)
    check_incremental(tok, torch.randint(0, 97, (200,), generator=g).tolist())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"])
def test_real_tokenizers_multibyte_text(name):
    """Byte-level BPE (Qwen2.5) splits characters' UTF-8 bytes over tokens; SmolLM2's tokenizer too. Includes
    the special tokens of a chat template (skipped in the text)."""
    from forerun.models.hub import resolve_model
    from forerun.models.loader import load_checkpoint

    tok = load_checkpoint(resolve_model(name)).tokenizer()
    ids = tok.encode(SAMPLE, add_special_tokens=False)
    check_incremental(tok, ids)
    chat = tok.apply_chat_template([{"role": "user", "content": SAMPLE}], add_generation_prompt=True, tokenize=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    check_incremental(tok, chat + ids)
    g = torch.Generator().manual_seed(1)
    check_incremental(tok, torch.randint(0, len(tok), (300,), generator=g).tolist())  # arbitrary ids, odd bytes
