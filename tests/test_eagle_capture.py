"""Distillation with the features captured as the target answers (forerun/eagle/capture.py): the answers are the
engine's greedy answers, the features are those a second pass (`data.extract`) stores, bit for bit, and a run
stopped between writing answers and their features is caught up on the next."""
from __future__ import annotations

import itertools
import json
import shutil

import torch

from forerun.eagle import capture as C
from forerun.eagle import data as D
from forerun.models.cpu_linear import pack_linears
from forerun.sampling_params import SamplingParams

from test_eagle_train_distill import _fake_prompts
from tiny import chat_tokenizer, hf_model, sharpen, tiny_llm


def _tiny(monkeypatch, seqs: int):
    """The tiny sharpened qwen2 behind an engine of `seqs` sequences, its chat tokenizer, the fake prompt stream.
    Its linears packed for oneDNN as `build_model` packs every float32 CPU model (models/cpu_linear.py): the bit
    equality checked here rests on the products' batch invariance, which the packed products give on every CPU
    (a one-row product runs as two rows), while torch's plain fp32 `linear` gives it on some only (on an AMD EPYC,
    session 49, a row's bits depended on how many rows were multiplied with it, one row or 2-40)."""
    if monkeypatch is not None:
        monkeypatch.setattr(D, "distill_prompts", _fake_prompts)
    tok = chat_tokenizer()
    llm = tiny_llm(sharpen(hf_model("qwen2", seed=3), 4.0), tokenizer=tok, max_num_seqs=seqs)
    assert pack_linears(llm.model) > 0
    return llm, tok


def _shards(folder, split="train"):
    return [torch.load(s, weights_only=True) for s in sorted((folder / split).glob("shard_*.pt"))]


def _same_features(a, b, split="train"):
    """The two folders' features, joined over their shards (they may be cut into shards differently)."""
    sa, sb = D.load_split(a, split), D.load_split(b, split)
    assert len(sa) == len(sb) and len(sa) > 0
    for x, y in zip(sa, sb):
        assert torch.equal(x["tokens"], y["tokens"])
        assert x["feats"].keys() == y["feats"].keys()
        for k in x["feats"]:
            assert torch.equal(x["feats"][k], y["feats"][k]), k
    counts = [sum(s["num_samples"] for s in _shards(f, split)) for f in (a, b)]
    assert counts[0] == counts[1]


def _extracted_copy(src, dst, model, tok, layers, **kw):
    """The two-pass recipe's features for the answers cached in src: the answers copied to dst, then extracted."""
    (dst / "distill").mkdir(parents=True)
    for f in (src / "distill").glob("*.jsonl"):
        shutil.copy(f, dst / "distill" / f.name)
    D.extract(model, tok, dst, layers, "train", 10 ** 6, progress=False, corpus="distill", **kw)


def test_captured_answers_are_greedy_and_features_equal_a_second_pass(tmp_path, monkeypatch):
    llm, tok = _tiny(monkeypatch, 3)
    model, layers = llm.model, (0, 2)
    a = tmp_path / "a"
    # max_len 40: the longest samples (prompt ~30 + 12 new tokens) are cut, as extraction cuts them
    kw = dict(max_len=40, min_len=2)
    have, stored = C.capture_distilled(model, tok, a, "train", 60, 10 ** 6, layers, batch=3, max_new=12, flush=4,
                                       progress=False, **kw)
    rows = D.read_distilled(a, "train")
    assert have >= 60 and have == sum(len(r["answer_ids"]) for r in rows)
    assert stored == sum(min(40, len(r["prompt_ids"]) + len(r["answer_ids"])) for r in rows)
    assert any(len(r["prompt_ids"]) + len(r["answer_ids"]) > 40 for r in rows)  # (the cut is exercised)
    # the answers: the engine's greedy answers to the chat-templated prompts (written as they finish: the first
    # prompts of the stream, in another order)
    assert sorted(r["prompt"] for r in rows) == sorted(itertools.islice(_fake_prompts(False), len(rows)))
    ref = llm.generate([r["prompt"] for r in rows], SamplingParams(temperature=0, max_tokens=12), chat=True)
    assert [r["answer_ids"] for r in rows] == [o.token_ids for o in ref]
    assert [r["prompt_ids"] for r in rows] == [o.prompt_token_ids for o in ref]
    assert [r["finish"] for r in rows] == [o.finish_reason for o in ref]
    # the features: what a second pass over the same answers stores, bit for bit
    b = tmp_path / "b"
    _extracted_copy(a, b, model, tok, layers, **kw)
    _same_features(a, b)
    stats = json.loads((a / "train" / "stats.json").read_text())
    assert stats["captured"] == stored and stats.get("seconds", 0.0) == 0.0
    # a full cache: nothing more is generated
    before = D.distill_path(a, "train").read_text()
    assert C.capture_distilled(model, tok, a, "train", 60, 10 ** 6, layers, batch=3, max_new=12, progress=False,
                               **kw) == (have, stored)
    assert D.distill_path(a, "train").read_text() == before


def test_a_stopped_capture_is_caught_up_and_continued(tmp_path, monkeypatch):
    llm, tok = _tiny(monkeypatch, 2)
    model, layers = llm.model, (1, 2)
    a = tmp_path / "a"
    kw = dict(max_len=64, min_len=2)
    have, _ = C.capture_distilled(model, tok, a, "train", 30, 10 ** 6, layers, batch=2, max_new=8, flush=3,
                                  progress=False, **kw)
    n_rows = len(D.read_distilled(a, "train"))
    shards = sorted((a / "train").glob("shard_*.pt"))
    assert len(shards) >= 2
    shards[-1].unlink()  # stopped after appending the last answers, before their features
    with D.distill_path(a, "train").open("a") as fh:
        fh.write('{"prompt": "t9')  # and a torn line
    have2, stored2 = C.capture_distilled(model, tok, a, "train", have + 20, 10 ** 6, layers, batch=2, max_new=8,
                                         flush=3, progress=False, **kw)
    rows = D.read_distilled(a, "train")
    assert len(rows) > n_rows and have2 >= have + 20
    assert len({json.dumps(r["prompt"]) for r in rows}) == len(rows)  # no prompt answered twice
    b = tmp_path / "b"
    _extracted_copy(a, b, model, tok, layers, **kw)
    _same_features(a, b)
    assert stored2 == sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in rows)
    # the feature budget stops it too
    c = tmp_path / "c"
    _, stored3 = C.capture_distilled(model, tok, c, "train", 10 ** 6, 50, layers, batch=2, max_new=8, flush=1,
                                     progress=False, **kw)
    assert 50 <= stored3 < 50 + 2 * (64 + 8)


def test_prompts_longer_than_the_sample_length_are_not_answered(tmp_path):
    llm, tok = _tiny(None, 2)
    prompts = ["t1 " * 60, "t2 t3 t4", "t5 " * 70, "t6 t7"]
    have, stored = C.capture_distilled(llm.model, tok, tmp_path, "train", 10 ** 6, 10 ** 6, (0, 2), max_len=32,
                                       min_len=2, batch=2, max_new=4, progress=False,
                                       prompts=lambda heldout, fraction, seed: iter(prompts))
    rows = D.read_distilled(tmp_path, "train")
    assert [r["prompt"] for r in rows] != [] and {r["prompt"] for r in rows} == {"t2 t3 t4", "t6 t7"}
