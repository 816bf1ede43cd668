"""Training an EAGLE head on your own data (`forerun train-eagle --dataset FILE`, forerun/eagle/data.py): the
record formats (OpenAI chat, ShareGPT, prompt / response, text; JSON Lines or a JSON array), one-line errors, the
held-out split by record hash, the benchmark guard, the target answering a dataset's prompts (--corpus distill),
and the CLI end to end on a tiny model."""
from __future__ import annotations

import json

import pytest
import torch

from forerun.eagle import data as D
from forerun.sampling_params import SamplingParams

from tiny import chat_tokenizer, hf_model, sharpen, tiny_llm


def _words(i: int, n: int = 12, base: int = 5) -> str:
    return " ".join(f"t{base + (i * 7 + j) % 40}" for j in range(n + i % 4))


def _write(path, records, as_array: bool = False) -> str:
    if as_array:
        path.write_text(json.dumps(records))
    else:
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_read_dataset_formats(tmp_path):
    recs = [
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                      {"role": "assistant", "content": "a"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "r"}]},
        {"conversations": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "r2"}]},
        {"prompt": "p", "response": "x"}, {"prompt": "p", "completion": "y"}, {"prompt": "p", "output": "z"},
        {"prompt": "only"}, {"text": "raw"},
    ]
    want = [
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                      {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]},
        {"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "r2"}]},
        {"messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "z"}]},
        {"prompt": "only"}, {"text": "raw"},
    ]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in recs[:4]) + "\n\n   \n" +
                     "\n".join(json.dumps(r) for r in recs[4:]) + "\n")  # blank lines are skipped
    assert D.read_dataset(jsonl) == want
    assert D.read_dataset(_write(tmp_path / "d.json", recs, as_array=True)) == want
    # what each corpus can use
    assert "record 7 is a prompt without a response" in D.check_dataset(want, "dataset", "F")
    assert "record 8 has no instruction" in D.check_dataset(want, "distill", "F")
    assert D.check_dataset(want[:6] + want[7:], "dataset", "F") is None
    assert D.check_dataset(want[:7], "distill", "F") is None
    # the instructions --corpus distill answers: the turns before the first assistant turn, or the prompt
    assert D._record_prompt(want[0]) == want[0]["messages"][:2] and D._record_prompt(want[6]) == "only"
    assert D._record_prompt({"messages": [{"role": "system", "content": "s"},
                                          {"role": "assistant", "content": "a"}]}) is None


@pytest.mark.parametrize("content, message", [
    ('{"text": "a"}\n{"text": \n', "d.jsonl:2: not a JSON object"),
    ('[1, 2]', "(item 0): a record is a JSON object, got int"),
    ('[{"text": "a"}', "not valid JSON"),
    ('{"messages": []}\n', "(line 1): 'messages' / 'conversations' must be a non-empty list"),
    ('{"messages": [{"role": "robot", "content": "x"}]}\n', "(line 1): a turn needs a role"),
    ('{"conversations": [{"from": "human", "value": 3}]}\n', "(line 1): a turn needs a role"),
    ('{"prompt": "p", "response": 5}\n', "'prompt' and its response must be strings"),
    ('{"question": "q"}\n', "(line 1): a record holds 'messages', 'conversations', 'prompt' or 'text'"),
    ('\n\n', "no records"),
])
def test_read_dataset_errors_are_one_line(tmp_path, content, message):
    f = tmp_path / "d.jsonl"
    f.write_text(content)
    with pytest.raises(ValueError) as e:
        D.read_dataset(f)
    assert message in str(e.value) and "\n" not in str(e.value) and str(f) in str(e.value)


def test_dataset_split_is_stable_disjoint_and_never_empty():
    recs = [{"text": _words(i)} for i in range(400)]
    train, held = D.dataset_split(recs, False), D.dataset_split(recs, True)
    assert len(train) + len(held) == 400 and not [r for r in held if r in train]
    assert 8 <= len(held) <= 40  # ~5 % (20 expected)
    assert train == [r for r in recs if r in train]  # file order
    more = recs + [{"text": _words(i, 20)} for i in range(400, 600)]
    assert [r for r in D.dataset_split(more, True) if r in recs] == held  # a file that grows keeps its split
    few = recs[:3]
    if not [r for r in few if D._record_hash(r) < 0.05]:
        assert len(D.dataset_split(few, True)) == 1 and len(D.dataset_split(few, False)) == 2
    assert D.dataset_split(recs[:1], True) == [] and D.dataset_split(recs[:1], False) == recs[:1]


def test_dataset_streams_leave_out_benchmark_prompts():
    from forerun.bench_prompts import CODE_PROMPTS

    bench = {"messages": [{"role": "user", "content": "Please: " + CODE_PROMPTS[2]},
                          {"role": "assistant", "content": "Yes."}]}
    short = {"messages": [{"role": "user", "content": "Write it"}, {"role": "assistant", "content": "Python"}]}
    recs = [bench, short, {"prompt": CODE_PROMPTS[0]}, {"text": CODE_PROMPTS[5] + " and more"},
            {"prompt": "Sort a list of tuples by their second item."}] * 30
    samples = list(D.dataset_samples(recs)(False)) + list(D.dataset_samples(recs)(True))
    # short turns are not bench prompts (though "Python" is part of most of them)
    assert samples and all(s.messages == short["messages"] for s in samples)
    prompts = list(D.dataset_prompts(recs)(False)) + list(D.dataset_prompts(recs)(True))
    assert prompts and set(map(json.dumps, prompts)) == {json.dumps(short["messages"][:1]),
                                                          json.dumps("Sort a list of tuples by their second item.")}


def test_generate_distilled_answers_a_datasets_prompts(tmp_path):
    """The target's greedy answers to a dataset's instructions (texts and multi-turn chats with a system turn),
    the engine's answers to the chat-templated turns; a rerun after the file grew answers only the new ones."""
    hf = sharpen(hf_model("qwen2", seed=3), 4.0)
    tok = chat_tokenizer()
    llm = tiny_llm(hf, tokenizer=tok, max_num_seqs=3)
    recs = []
    for i in range(40):
        if i % 3 == 0:
            recs.append({"prompt": _words(i)})
        else:
            recs.append({"messages": [{"role": "system", "content": _words(i, 4, 60)},
                                      {"role": "user", "content": _words(i)},
                                      {"role": "assistant", "content": _words(i, 6, 70)}]})
    prompts = D.dataset_prompts(recs)
    want = list(prompts(False))
    n = D.generate_distilled(llm, tmp_path, "train", 10 ** 6, max_new=5, chunk=4, progress=False, prompts=prompts)
    rows = D.read_distilled(tmp_path, "train")
    assert [r["prompt"] for r in rows] == want and n == sum(len(r["answer_ids"]) for r in rows)
    ids = [D.chat_prompt_ids(tok, p) for p in want]
    assert [r["prompt_ids"] for r in rows] == ids
    msgs = rows[1]["prompt"]
    assert isinstance(msgs, list) and msgs[0]["role"] == "system"  # the system turn reaches the template
    assert ids[1] == tok(f"t2 {msgs[0]['content']} t3 t2 {msgs[1]['content']} t3 t4")["input_ids"]
    ref = llm.generate(ids, SamplingParams(temperature=0, max_tokens=5))
    assert [r["answer_ids"] for r in rows] == [o.token_ids for o in ref]
    # the file grows: only the new records' prompts are answered, after the ones cached
    more = recs + [{"prompt": _words(i, 10, 20)} for i in range(40, 52)]
    D.generate_distilled(llm, tmp_path, "train", 10 ** 6, max_new=5, chunk=4, progress=False,
                         prompts=D.dataset_prompts(more))
    rows2 = D.read_distilled(tmp_path, "train")
    assert rows2[:len(rows)] == rows
    assert [r["prompt"] for r in rows2[len(rows):]] == [p for p in D.dataset_prompts(more)(False) if p not in want]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    hf_model("qwen2", seed=3).save_pretrained(d)
    chat_tokenizer().save_pretrained(d)
    return d


def _cli_setup(tmp_path, monkeypatch):
    hf = sharpen(hf_model("qwen2", seed=3), 4.0)
    model_dir = tmp_path / "model"
    hf.save_pretrained(model_dir)
    chat_tokenizer().save_pretrained(model_dir)
    from forerun.models import loader

    monkeypatch.setattr(loader, "_dir_tokenizer", lambda d: chat_tokenizer())  # the word-level one (AutoTokenizer: qwen2's)
    return ["--target", str(model_dir), "--seq-len", "48", "--draft-vocab", "64", "--intermediate", "64",
            "--ttt", "2", "--accum", "1", "--eval-every", "2", "--eval-k", "2", "--save-every", "2", "--quiet",
            "--quantize", "none", "--device", "cpu", "--steps", "2"]


def test_train_eagle_on_a_dataset_cli(tmp_path, monkeypatch):
    """--dataset FILE end to end: its chat records as they are (the default corpus with --dataset), then as
    instructions the target answers (--corpus distill); the feature folder names the file's records."""
    from forerun.eagle import train as T

    common = _cli_setup(tmp_path, monkeypatch)
    recs = [{"conversations": [{"from": "human", "value": _words(i, 24)}, {"from": "gpt", "value": _words(i, 20, 50)}]}
            for i in range(60)]
    f = _write(tmp_path / "chats.jsonl", recs)
    data = tmp_path / "d"
    assert T.main(common + ["--out", str(tmp_path / "h"), "--data", str(data), "--dataset", f,
                            "--train-tokens", "300", "--heldout-tokens", "40"]) == 0
    meta = json.loads((data / "train" / "meta.json").read_text())
    records = D.read_dataset(f)
    assert meta["corpus"] == f"dataset:{D.dataset_id(records)}"
    tok = chat_tokenizer()
    first = D.load_split(data, "train")[0]["tokens"].tolist()
    train_recs = D.dataset_split(records, False)
    assert first == D.encode(tok, D.Sample(None, train_recs[0]["messages"]), 48)  # the record itself, templated
    summary = json.loads((tmp_path / "h" / "training_summary.json").read_text())
    assert summary["sessions"][-1]["corpus"] == "dataset" and summary["sessions"][-1]["dataset"] == f
    # another file into the same folder is refused (one line, exit 2)
    g = _write(tmp_path / "other.jsonl", recs[:30])
    assert T.main(common + ["--out", str(tmp_path / "h2"), "--data", str(data), "--dataset", g,
                            "--train-tokens", "600", "--heldout-tokens", "40"]) == 2
    # --corpus distill: the target answers the records' user turns (their responses are not used)
    dd = tmp_path / "dd"
    assert T.main(common + ["--out", str(tmp_path / "h3"), "--data", str(dd), "--dataset", f, "--corpus",
                            "distill", "--train-tokens", "60", "--heldout-tokens", "20", "--distill-max-new", "5",
                            "--distill-batch", "3"]) == 0
    rows = D.read_distilled(dd, "train")
    assert rows and [r["prompt"] for r in rows] == [r["messages"][:1] for r in train_recs[:len(rows)]]


@pytest.mark.parametrize("args, message", [
    (["--dataset", "{missing}"], "no such file"),
    (["--dataset", "{chats}", "--corpus", "mix"], "--dataset replaces the built-in corpus"),
    (["--corpus", "dataset"], "--corpus dataset needs --dataset FILE"),
    (["--dataset", "{prompts}"], "is a prompt without a response; --corpus distill"),
    (["--dataset", "{texts}", "--corpus", "distill"], "has no instruction"),
    (["--dataset", "{broken}"], ":2: not a JSON object"),
])
def test_train_eagle_dataset_errors(tmp_path, tiny_model_dir, capsys, args, message):
    """Refused before anything loads: one line on stderr, exit code 2."""
    from forerun.eagle import train as T

    files = {"missing": str(tmp_path / "nope.jsonl"),
             "chats": _write(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "a"}]}]),
             "prompts": _write(tmp_path / "p.jsonl", [{"prompt": "a"}]),
             "texts": _write(tmp_path / "t.jsonl", [{"text": "a"}])}
    (tmp_path / "b.jsonl").write_text('{"text": "a"}\n{oops\n')
    files["broken"] = str(tmp_path / "b.jsonl")
    args = [a.format(**files) for a in args]
    assert T.main(["--target", str(tiny_model_dir), "--out", str(tmp_path / "o")] + args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
