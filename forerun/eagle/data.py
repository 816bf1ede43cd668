"""Training data for EAGLE heads: an offline corpus and the target's teacher-forced hidden states, on disk.

Corpus: Python source files of the running interpreter's standard library and site-packages (they exist
on every machine that runs forerun, nothing is downloaded). Most samples are shaped like the chat turns a
code model answers: a user message asking for a function, written from the function's own name and
docstring, and an assistant message holding the function in a code block; the rest are raw file slices.
forerun's own files (benchmark prompts, tests) are never read. Files are split into training and held-out
sets by a hash of their path, so held-out text is from files the head never saw.

Features: one target forward per sample (`ModelRunner.forward(..., hidden_layers=...)`), storing, per
token, the outputs of the head's feature layers and of the last layer (the teacher's logits are
lm_head(norm(last)), recomputed at training time), in bfloat16 shards of about `shard_tokens` tokens.
Extraction is resumable: a shard is written atomically and its samples are skipped on a rerun.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from tqdm.auto import tqdm

_FORERUN_ROOT = Path(__file__).resolve().parents[2]


def python_sources() -> list[Path]:
    """Every .py file under the stdlib and site-packages folders, sorted (deterministic), forerun's excluded."""
    roots = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    files: set[Path] = set()
    for root in sorted(r for r in roots if r and os.path.isdir(r)):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for f in filenames:
                if f.endswith(".py"):
                    p = Path(dirpath, f).resolve()
                    if _FORERUN_ROOT not in p.parents:
                        files.add(p)
    return sorted(files)


def is_heldout(path: Path, fraction: float) -> bool:
    h = int(hashlib.sha1(str(path).encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def _functions(source: str) -> Iterator[tuple[str, str, str]]:
    """(name, first docstring line, source) of documented top-level functions and methods."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if not doc or node.end_lineno is None:
                continue
            first = doc.strip().splitlines()[0].strip()
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            body = "\n".join(lines[start:node.end_lineno])
            indent = len(body) - len(body.lstrip())
            body = "\n".join(line[indent:] if line[:indent].isspace() else line for line in body.splitlines())
            if 3 <= body.count("\n") <= 60:
                yield node.name, first, body


@dataclass(frozen=True)
class Sample:
    text: str | None  # raw text, or None for a chat sample
    messages: list[dict] | None


def corpus_samples(heldout: bool, fraction: float = 0.05, seed: int = 0, chat_share: float = 0.75
                   ) -> Iterator[Sample]:
    """An endless-enough deterministic stream: files shuffled by `seed`; from each file its documented
    functions as chat samples (a `chat_share` of them) and a raw slice of the file."""
    files = [p for p in python_sources() if is_heldout(p, fraction) == heldout]
    rng = random.Random(seed)
    rng.shuffle(files)
    asks = ("Write a Python function `{name}`: {doc}", "Implement `{name}` in Python. {doc}",
            "Write a function named {name} that does the following: {doc}", "{doc} Write it as `{name}` in Python.")
    for p in files:
        try:
            src = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not src.strip():
            continue
        for name, doc, body in _functions(src):
            if rng.random() < chat_share:
                ask = rng.choice(asks).format(name=name, doc=doc)
                answer = f"```python\n{body}\n```"
                if rng.random() < 0.5:
                    answer = f"Here is `{name}`:\n\n{answer}"
                yield Sample(None, [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}])
        start = rng.randrange(max(1, len(src) - 3000))
        yield Sample(src[start:start + 3000], None)


def encode(tok, sample: Sample, max_len: int) -> list[int]:
    if sample.messages is not None and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(sample.messages, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        text = sample.text if sample.text is not None else "\n".join(m["content"] for m in sample.messages)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    return list(ids)[:max_len]


def feature_layers(num_layers: int, head_layers: tuple[int, ...]) -> tuple[int, ...]:
    """The head's layers plus the last one (the teacher), sorted, unique."""
    return tuple(sorted(set(head_layers) | {num_layers - 1}))


def extract(model, tok, out_dir: str | Path, layers: tuple[int, ...], split: str, max_tokens: int,
            max_len: int = 512, min_len: int = 24, shard_tokens: int = 16384, seed: int = 0,
            heldout_fraction: float = 0.05, progress: bool = True, deadline: float | None = None) -> int:
    """Teacher-forced hidden states of `layers` for corpus samples of one split, until `max_tokens` tokens are
    on disk under out_dir/split/ (or time.time() passes `deadline`: what was extracted is written). Returns
    the tokens stored. Resumable (shards already written are kept). The extraction wall time is added up
    across runs in out_dir/split/stats.json (`split_stats`)."""
    import time
    from ..config import CacheConfig
    from ..runtime.runner import Chunk, ModelRunner

    d = Path(out_dir) / split
    d.mkdir(parents=True, exist_ok=True)
    meta_path = d / "meta.json"
    meta = {"layers": list(layers), "max_len": max_len, "seed": seed, "heldout_fraction": heldout_fraction}
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if {k: old.get(k) for k in meta} != meta:
            raise ValueError(f"{d} holds features made with other settings {old}; use another --data folder")
    meta_path.write_text(json.dumps(meta))
    shards = sorted(d.glob("shard_*.pt"))
    done_samples = sum(torch.load(s, weights_only=True)["num_samples"] for s in shards)
    stored = sum(int(torch.load(s, weights_only=True)["offsets"][-1]) for s in shards)
    if stored >= max_tokens:
        return stored
    t_start = time.perf_counter()
    weight = model.model.embed_tokens.weight
    runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=max_len // 16 + 4), weight.device,
                         weight.dtype, max_batch_tokens=max_len, max_seqs=1)
    stream = corpus_samples(split == "heldout", heldout_fraction, seed)
    buf_tok, buf_feat, offsets, n_samples, index = [], {i: [] for i in layers}, [0], 0, 0
    bar = tqdm(total=max_tokens, initial=stored, desc=f"target features ({split})", unit="tok", disable=not progress)
    for sample in stream:
        ids = encode(tok, sample, max_len)
        index += 1
        if index <= done_samples:
            continue
        n_samples += 1
        if len(ids) < min_len:
            continue
        runner.kv.add_sequence(0)
        try:
            out, _ = runner.forward([Chunk(0, ids, logits="none")], hidden_layers=layers)
        finally:
            runner.kv.free(0)
        buf_tok.append(torch.tensor(ids, dtype=torch.int32))
        for i in layers:
            buf_feat[i].append(out.hidden_states[i].to("cpu", torch.bfloat16))
        offsets.append(offsets[-1] + len(ids))
        bar.update(len(ids))
        stored += len(ids)
        late = deadline is not None and time.time() >= deadline
        if offsets[-1] >= shard_tokens or stored >= max_tokens or late:
            _write_shard(d, len(shards), buf_tok, buf_feat, offsets, n_samples)
            shards.append(None)
            buf_tok, buf_feat, offsets, n_samples = [], {i: [] for i in layers}, [0], 0
            if stored >= max_tokens or late:
                break
    else:
        if len(offsets) > 1:
            _write_shard(d, len(shards), buf_tok, buf_feat, offsets, n_samples)
    bar.close()
    st = split_stats(out_dir, split)
    st["seconds"] = round(st.get("seconds", 0.0) + time.perf_counter() - t_start, 1)
    st["tokens"] = stored
    (d / "stats.json").write_text(json.dumps(st))
    return stored


def split_stats(out_dir: str | Path, split: str) -> dict:
    """{'seconds': extraction wall time summed over runs, 'tokens': tokens on disk, optional 'note'} ({} if none)."""
    f = Path(out_dir) / split / "stats.json"
    return json.loads(f.read_text()) if f.exists() else {}


def _write_shard(d: Path, i: int, toks, feats, offsets, n_samples) -> None:
    data = {"tokens": torch.cat(toks), "offsets": torch.tensor(offsets, dtype=torch.int64),
            "num_samples": n_samples, "feats": {str(k): torch.cat(v) for k, v in feats.items()}}
    tmp = d / f".shard_{i:05d}.tmp"
    torch.save(data, tmp)
    os.replace(tmp, d / f"shard_{i:05d}.pt")


def load_split(out_dir: str | Path, split: str) -> list[dict]:
    """Every sequence of a split: [{'tokens': [T] long, 'feats': {layer: [T, H] bf16}}]."""
    seqs = []
    for s in sorted((Path(out_dir) / split).glob("shard_*.pt")):
        data = torch.load(s, weights_only=True)
        off = data["offsets"].tolist()
        for a, b in zip(off, off[1:]):
            seqs.append({"tokens": data["tokens"][a:b].long(),
                         "feats": {int(k): v[a:b] for k, v in data["feats"].items()}})
    return seqs


def token_counts(out_dir: str | Path, vocab_size: int) -> torch.Tensor:
    """How often each token occurs in the training split (for the reduced draft vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in sorted((Path(out_dir) / "train").glob("shard_*.pt")):
        counts += torch.bincount(torch.load(s, weights_only=True)["tokens"].long(), minlength=vocab_size)
    return counts


if __name__ == "__main__":  # pragma: no cover - a peek at the corpus
    for k, s in zip(range(int(sys.argv[1]) if len(sys.argv) > 1 else 3), corpus_samples(False)):
        print(s)
