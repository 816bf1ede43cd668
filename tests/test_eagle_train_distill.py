"""Self-distillation for EAGLE training (forerun/eagle/data.py, `forerun train-eagle --corpus distill`):
prompts from the offline corpus (never a bench prompt), the target's greedy answers through forerun's engine,
cached and resumable, features over prompt + answer, extra feature folders in training and evaluation."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from forerun.eagle import data as D
from forerun.sampling_params import SamplingParams

from tiny import chat_tokenizer, hf_model, sharpen, tiny_llm


def _fake_prompts(heldout, fraction=0.05, seed=0):
    base = 50 if heldout else 5
    for i in itertools.count():
        yield " ".join(f"t{base + (i * 7 + j) % 40}" for j in range(20 + i % 4))


def test_distill_prompts_kinds_split_and_no_bench_prompts():
    from forerun.bench_prompts import CODE_PROMPTS

    train = list(itertools.islice(D.distill_prompts(False), 80))
    held = list(itertools.islice(D.distill_prompts(True), 20))
    assert len(train) == 80 and len(held) == 20
    assert not set(train) & set(held)  # held-out prompts come from other files
    for kind in ("Write a Python function", "Explain", "Complete this Python function", "Write a docstring"):
        assert any(p.startswith(kind) or kind in p for p in train), kind
    other = [p for p in train if any(f"in {lang}" in p or f"to {lang}:" in p or f"a {lang} function" in p
                                     for lang in D.OTHER_LANGUAGES)]
    assert len(other) >= 10 and len({p.split(":")[0] for p in other}) >= 5  # the same tasks in other languages
    assert not any(D._is_bench_like(p, CODE_PROMPTS) for p in train + held)
    assert D._is_bench_like(CODE_PROMPTS[3], CODE_PROMPTS)  # the guard itself
    assert train == list(itertools.islice(D.distill_prompts(False), 80))  # deterministic


def test_generate_distilled_is_greedy_resumable_and_extracts(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "distill_prompts", _fake_prompts)
    hf = sharpen(hf_model("qwen2", seed=3), 4.0)
    tok = chat_tokenizer()
    llm = tiny_llm(hf, tokenizer=tok, max_num_seqs=3)
    n = D.generate_distilled(llm, tmp_path, "train", 20, max_new=6, chunk=4, progress=False)
    rows = D.read_distilled(tmp_path, "train")
    assert n >= 20 and len(rows) % 4 == 0 and n == sum(len(r["answer_ids"]) for r in rows)
    # the answers are the engine's greedy answers to the chat-templated prompt
    ref = llm.generate([r["prompt"] for r in rows], SamplingParams(temperature=0, max_tokens=6), chat=True)
    assert [r["answer_ids"] for r in rows] == [o.token_ids for o in ref]
    assert [r["prompt_ids"] for r in rows] == [o.prompt_token_ids for o in ref]
    # resumable: a torn last line is dropped, a rerun continues with the next prompts
    with D.distill_path(tmp_path, "train").open("a") as f:
        f.write('{"prompt": "t9')
    n2 = D.generate_distilled(llm, tmp_path, "train", n + 10, max_new=6, chunk=4, progress=False)
    rows2 = D.read_distilled(tmp_path, "train")
    assert rows2[:len(rows)] == rows and n2 >= n + 10
    assert [r["prompt"] for r in rows2] == list(itertools.islice(_fake_prompts(False), len(rows2)))
    stats = json.loads(D.distill_path(tmp_path, "train").with_suffix(".stats.json").read_text())
    assert stats["tokens"] == n2 and len(stats["runs"]) == 2
    # features over prompt + answer, token for token
    layers = (0, 2)
    stored = D.extract(llm.model, tok, tmp_path, layers, "train", 10 ** 6, max_len=64, min_len=2, progress=False,
                       corpus="distill")
    seqs = D.load_split(tmp_path, "train")
    assert stored == sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in rows2)
    assert [s["tokens"].tolist() for s in seqs] == [r["prompt_ids"] + r["answer_ids"] for r in rows2]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_train_eagle_distill_cli_with_extra_data(tmp_path, monkeypatch, device):
    """End to end on a tiny HF folder: generation, features, an extra feature folder (its train split joins,
    its held-out split is evaluated under 'extra'), a checkpoint and the summary; on the CPU and, where there is
    one, on a GPU (`--device cuda`: bf16 training by default)."""
    from forerun.eagle import train as T

    monkeypatch.setattr(D, "distill_prompts", _fake_prompts)
    hf = sharpen(hf_model("qwen2", seed=3), 4.0)
    model_dir = tmp_path / "model"
    hf.save_pretrained(model_dir)
    chat_tokenizer().save_pretrained(model_dir)
    from forerun.models import loader

    monkeypatch.setattr(loader, "_dir_tokenizer", lambda d: chat_tokenizer())  # the word-level one (AutoTokenizer: qwen2's)
    common = ["--target", str(model_dir), "--seq-len", "48", "--draft-vocab", "64", "--intermediate", "64",
              "--ttt", "2", "--accum", "1", "--eval-every", "2", "--eval-k", "2", "--save-every", "2", "--quiet",
              "--quantize", "none", "--device", device]
    # an extra folder made by the distill recipe too (a tiny model has no use for the mix corpus)
    extra = tmp_path / "extra"
    # (the two-pass recipe: the engine answers, extraction reads prompt + answer again)
    assert T.main(common + ["--out", str(tmp_path / "h0"), "--data", str(extra), "--corpus", "distill",
                            "--train-tokens", "60", "--heldout-tokens", "30", "--distill-max-new", "5",
                            "--distill-batch", "2", "--steps", "1", "--distill-passes", "2"]) == 0
    assert sum(len(r["answer_ids"]) for r in D.read_distilled(extra, "train")) >= 60  # answers to --train-tokens
    out = tmp_path / "head"
    assert T.main(common + ["--out", str(out), "--data", str(tmp_path / "d"), "--corpus", "distill",
                            "--train-tokens", "80", "--heldout-tokens", "30", "--distill-max-new", "6",
                            "--distill-batch", "3", "--steps", "4", "--extra-data", str(extra),
                            "--distill-passes", "1"]) == 0
    rows = D.read_distilled(tmp_path / "d", "train")  # (one pass: answers until the features hold --train-tokens)
    assert sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in rows) >= 80 and D.read_distilled(tmp_path / "d",
                                                                                                       "heldout")
    assert json.loads((tmp_path / "d" / "train" / "stats.json").read_text())["captured"] >= 80
    state = torch.load(out / "train_state.pt", weights_only=True)
    assert state["step"] == 4
    last = state["history"][-1]
    assert set(last["extra"]) == {"extra"} and last["extra"]["extra"]["acc_len"] >= 1.0
    assert json.loads((out / "training_summary.json").read_text())["steps"] == 4
    # resuming with a cache that is already full generates nothing more
    before = D.distill_path(tmp_path / "d", "train").read_text()
    assert T.main(common + ["--out", str(out), "--data", str(tmp_path / "d"), "--corpus", "distill",
                            "--train-tokens", "80", "--heldout-tokens", "30", "--distill-max-new", "6",
                            "--distill-batch", "3", "--steps", "5", "--resume", "--extra-data", str(extra)]) == 0
    assert D.distill_path(tmp_path / "d", "train").read_text() == before
    # --restart-schedule: a fresh warmup + cosine at --lr from the resumed step (5) to --steps (7)
    assert T.main(common + ["--out", str(out), "--data", str(tmp_path / "d"), "--corpus", "distill",
                            "--train-tokens", "80", "--heldout-tokens", "30", "--distill-max-new", "6",
                            "--distill-batch", "3", "--steps", "7", "--resume", "--restart-schedule", "--lr", "1e-3",
                            "--extra-data", str(extra)]) == 0
    group = torch.load(out / "train_state.pt", weights_only=True)["optimizer"]["param_groups"][0]
    assert group["initial_lr"] == 1e-3
    assert abs(group["lr"] - 1e-4) < 1e-10  # span 2, warmup 1: the cosine's end (0.1 x lr) after 2 steps


def test_functions_skips_whitespace_only_docstrings():
    """A docstring of whitespace that survives cleaning (a no-break space line) raised IndexError mid-generation."""
    src = ('def f(x):\n    """\n    \xa0\n    """\n    a = 1\n    b = 2\n    return x\n\n'
           'def g(x):\n    """Doc."""\n    a = 1\n    b = 2\n    return x\n')
    assert [name for name, *_ in D._functions(src)] == ["g"]
