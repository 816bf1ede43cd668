"""Training data for EAGLE heads: an offline corpus and the target's teacher-forced hidden states, on disk.

Corpus: Python source files of the running interpreter's standard library and site-packages (they exist
on every machine that runs forerun, nothing is downloaded). Most samples are shaped like the chat turns a
code model answers: a user message asking for a function, written from the function's own name and
docstring, and an assistant message holding the function in a code block; the rest are raw file slices.
forerun's own files (benchmark prompts, tests) are never read. Files are split into training and held-out
sets by a hash of their path, so held-out text is from files the head never saw.

Corpus recipes (`corpus=`): "code" (the above) and "mix" (docs/eagle.md, session 3): the "code" samples
interleaved with samples closer to what the bench asks of an instruct model: chat turns whose answer is code
followed by prose (the function's whole docstring, as the explanation instruct models add after their code),
chat turns over other languages' source files found on the machine (C, C++, JavaScript, shell: a header or
source file shown in a fenced block), and prose from installed packages' documentation (.md / .rst), raw or
as an "explain" turn. Everything is read from disk (nothing downloaded, forerun's files never read).

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


_DOC_EXT = (".md", ".rst")
_LANG_EXT = {".c": "c", ".h": "c", ".cpp": "cpp", ".hpp": "cpp", ".js": "javascript", ".sh": "bash"}


def other_sources(exts, per_package: int = 150) -> list[Path]:
    """Files with one of `exts` under the stdlib and site-packages folders (forerun's excluded), at most
    `per_package` per top-level folder of a root (so one package's thousands of pages do not swamp the rest),
    sorted (deterministic)."""
    roots = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    picked: dict[tuple[str, str], list[Path]] = {}
    for root in sorted(r for r in roots if r and os.path.isdir(r)):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel = os.path.relpath(dirpath, root).split(os.sep)
            parts = rel[:2] if rel[0] == "site-packages" else rel[:1]
            for f in sorted(filenames):
                if f.endswith(tuple(exts)):
                    p = Path(dirpath, f).resolve()
                    if _FORERUN_ROOT in p.parents:
                        continue
                    bucket = picked.setdefault((root, "/".join(parts)), [])
                    if len(bucket) < per_package:
                        bucket.append(p)
    return sorted({p for b in picked.values() for p in b})


def _unit_hash(text: str) -> float:
    """A stable number in [0, 1] for a text (the held-out splits: a file by its path, a record by its content)."""
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def is_heldout(path: Path, fraction: float) -> bool:
    return _unit_hash(str(path)) < fraction


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
            doc_lines = doc.strip().splitlines()
            if not doc_lines:  # whitespace only (e.g. a lone form feed or \x1c)
                continue
            first = doc_lines[0].strip()
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
    ids: tuple[int, ...] | None = None  # token ids as they are (a distilled sample: prompt + the target's answer)


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


def _code_prose_samples(files: list[Path], rng: random.Random) -> Iterator[Sample]:
    """Chat turns: a request written from a documented function's name and first docstring line; the answer
    is the function in a code block followed by its whole docstring as prose (what instruct models write)."""
    asks = ("Write a Python function `{name}` that does this: {doc} Explain how it works.",
            "Implement `{name}` in Python ({doc}) and describe the code.", "{doc} Write `{name}` and explain it.",
            "Can you write a Python function named {name}? {doc}")
    for p in files:
        try:
            src = p.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        docs = {n.name: ast.get_docstring(n) for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(n)}
        for name, first, body in _functions(src):
            full = docs.get(name) or first
            if rng.random() < 0.5 or len(full) < 60:
                continue
            intro = rng.choice(("Here is a Python function `{n}`:", "Certainly! Here's `{n}`:",
                                "Sure. The function `{n}` can be written like this:", "")).format(n=name)
            answer = (intro + "\n\n" if intro else "") + f"```python\n{body}\n```\n\n{full.strip()}"
            yield Sample(None, [{"role": "user", "content": rng.choice(asks).format(name=name, doc=first)},
                                {"role": "assistant", "content": answer}])


def _lang_samples(files: list[Path], rng: random.Random) -> Iterator[Sample]:
    """Chat turns over C / C++ / JavaScript / shell files found on the machine: the file (a slice) in a fenced
    block of its language, asked for by its name."""
    for p in files:
        try:
            src = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(src.strip()) < 200:
            continue
        lang = _LANG_EXT[p.suffix]
        start = rng.randrange(max(1, len(src) - 2000))
        start = src.find("\n", start) + 1 if start else 0
        ask = rng.choice(("Write a {lang} file like `{name}`.", "Show me {lang} code for `{name}`.",
                          "Write the {lang} source `{name}`.")).format(lang=lang.capitalize(), name=p.name)
        answer = f"Here is `{p.name}`:\n\n```{lang}\n{src[start:start + 2000].rstrip()}\n```"
        yield Sample(None, [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}])


def _doc_samples(files: list[Path], rng: random.Random) -> Iterator[Sample]:
    """Prose from documentation files: a raw slice, or an "explain" turn answered by the slice."""
    for p in files:
        try:
            src = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(src.strip()) < 300:
            continue
        start = rng.randrange(max(1, len(src) - 2500))
        start = src.find("\n", start) + 1 if start else 0
        text = src[start:start + 2500]
        if rng.random() < 0.5:
            yield Sample(text, None)
        else:
            topic = p.stem if p.stem.lower() not in ("readme", "index", "changelog") else p.parent.name
            ask = rng.choice(("Explain {t}.", "What does the documentation of {t} say?", "Tell me about {t}."))
            yield Sample(None, [{"role": "user", "content": ask.format(t=topic)},
                                {"role": "assistant", "content": text.strip()}])


def _split_sources(heldout: bool, fraction: float, rng: random.Random) -> tuple[list[Path], list[Path], list[Path]]:
    """Python, other-language and documentation files of one split (by path hash), each shuffled by rng."""
    py = [p for p in python_sources() if is_heldout(p, fraction) == heldout]
    rng.shuffle(py)
    langs = [p for p in other_sources(tuple(_LANG_EXT)) if is_heldout(p, fraction) == heldout]
    docs = [p for p in other_sources(_DOC_EXT) if is_heldout(p, fraction) == heldout]
    rng.shuffle(langs)
    rng.shuffle(docs)
    return py, langs, docs


def mixed_samples(heldout: bool, fraction: float = 0.05, seed: int = 0) -> Iterator[Sample]:
    """The "mix" recipe: per round 3 "code" samples, 2 code-then-prose turns, 1 other-language turn, 1 docs
    sample (each source until it runs out). Held-out files by the same path hash as "code"."""
    rng = random.Random(seed + 1)
    py, langs, docs = _split_sources(heldout, fraction, rng)
    streams = [(corpus_samples(heldout, fraction, seed), 3), (_code_prose_samples(py, rng), 2),
               (_lang_samples(langs, rng), 1), (_doc_samples(docs, rng), 1)]
    while streams:
        alive = []
        for it, n in streams:
            try:
                for _ in range(n):
                    yield next(it)
                alive.append((it, n))
            except StopIteration:
                pass
        streams = alive


# -- your own data (`--dataset FILE`): chat records, prompt / response pairs, raw text ------------------------
# A JSON Lines file (one object per line; blank lines skipped) or a JSON file holding an array of objects. Records:
#   {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}   (OpenAI chat)
#   {"conversations": [{"from": "system" | "human" | "gpt", "value": "..."}, ...]}    (ShareGPT; role/content too)
#   {"prompt": "...", "response": "..."}   ("completion" or "output" for the response; the response is optional)
#   {"text": "..."}
# Used as they are (--corpus dataset: chat records through the target's chat template, text raw), or as
# instructions that the target answers itself (--corpus distill: the turns before the first assistant turn, or the
# prompt). Split into training and held-out records by a hash of each record (as the corpus files by their path).

_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
          "model": "assistant", "bot": "assistant"}
_RESPONSE_KEYS = ("response", "completion", "output")


def read_dataset(path: str | Path) -> list[dict]:
    """The records of a dataset file, normalized to {"messages": [...]}, {"prompt": str} or {"text": str}
    (a prompt with a response becomes a user + assistant chat). Raises ValueError naming the file, the line (or
    array index) and what is wrong, in one line."""
    path = Path(path).expanduser()
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--dataset {path}: cannot read it ({e.__class__.__name__}: {e})") from None
    items: list[tuple[str, object]] = []
    if raw.lstrip().startswith("["):
        try:
            arr = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"--dataset {path}: not valid JSON ({e})") from None
        items = [(f"item {i}", x) for i, x in enumerate(arr)]
    else:
        for n, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    items.append((f"line {n}", json.loads(line)))
                except ValueError as e:
                    raise ValueError(f"--dataset {path}:{n}: not a JSON object ({e})") from None
    out = [_normalize_record(x, f"--dataset {path} ({where})") for where, x in items]
    if not out:
        raise ValueError(f"--dataset {path}: no records")
    return out


def _normalize_record(x, where: str) -> dict:
    if not isinstance(x, dict):
        raise ValueError(f"{where}: a record is a JSON object, got {type(x).__name__}")
    turns = x.get("messages", x.get("conversations"))
    if turns is not None:
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'messages' / 'conversations' must be a non-empty list of turns")
        msgs = []
        for t in turns:
            role = t.get("role", t.get("from")) if isinstance(t, dict) else None
            content = t.get("content", t.get("value")) if isinstance(t, dict) else None
            if role not in _ROLES or not isinstance(content, str):
                raise ValueError(f"{where}: a turn needs a role ({', '.join(sorted(_ROLES))}) and text content, "
                                 f"got {json.dumps(t)[:80]}")
            msgs.append({"role": _ROLES[role], "content": content})
        return {"messages": msgs}
    if "prompt" in x:
        response = next((x[k] for k in _RESPONSE_KEYS if k in x), None)
        if not isinstance(x["prompt"], str) or (response is not None and not isinstance(response, str)):
            raise ValueError(f"{where}: 'prompt' and its response must be strings")
        if response is None:
            return {"prompt": x["prompt"]}
        return {"messages": [{"role": "user", "content": x["prompt"]}, {"role": "assistant", "content": response}]}
    if isinstance(x.get("text"), str):
        return {"text": x["text"]}
    raise ValueError(f"{where}: a record holds 'messages', 'conversations', 'prompt' or 'text'; "
                     f"got keys {sorted(x)[:6]}")


def dataset_id(records: list[dict]) -> str:
    """A short hash of a dataset's records (a feature folder records which file's records it holds)."""
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]


def _record_hash(rec: dict) -> float:
    return _unit_hash(json.dumps(rec, sort_keys=True))


def dataset_split(records: list[dict], heldout: bool, fraction: float = 0.05) -> list[dict]:
    """One split's records, in file order: held out where the record's hash falls below `fraction` (stable as the
    file grows); when none does, the record with the smallest hash, so that a small file still evaluates."""
    hs = [_record_hash(r) for r in records]
    held = {i for i, h in enumerate(hs) if h < fraction}
    if not held and len(records) > 1:
        held = {min(range(len(hs)), key=hs.__getitem__)}
    return [r for i, r in enumerate(records) if (i in held) == heldout]


def _record_prompt(rec: dict) -> str | list[dict] | None:
    """The instruction of a record for the target to answer: its prompt, or its turns before the first assistant
    turn (None: no user turn there)."""
    if "prompt" in rec:
        return rec["prompt"]
    if "messages" in rec:
        first = next((i for i, m in enumerate(rec["messages"]) if m["role"] == "assistant"), len(rec["messages"]))
        turns = rec["messages"][:first]
        return turns if any(m["role"] == "user" for m in turns) else None
    return None


def check_dataset(records: list[dict], corpus: str, path: str) -> str | None:
    """What stops `records` from serving `corpus` (one line), else None."""
    if corpus == "dataset":
        bad = next((i for i, r in enumerate(records) if "prompt" in r), None)
        if bad is not None:
            return (f"--dataset {path}: record {bad + 1} is a prompt without a response; --corpus distill has the "
                    "target answer prompts (or add a 'response')")
    elif corpus == "distill":
        bad = next((i for i, r in enumerate(records) if _record_prompt(r) is None), None)
        if bad is not None:
            return (f"--dataset {path}: record {bad + 1} has no instruction (a 'prompt', or a user turn before the "
                    "first assistant turn) for --corpus distill to answer")
    return None


def _holds_bench_prompt(texts: list[str], bench: tuple[str, ...]) -> bool:
    """_is_bench_like over a record's texts, those of 20 characters or more (every benchmark prompt is longer; a
    short turn such as "Yes." is part of one without being one)."""
    return any(_is_bench_like(t, bench) for t in texts if len(t.strip()) >= 20)


def dataset_samples(records: list[dict]):
    """A corpus recipe over a dataset's records as they are (chat through the template, text raw; never a record
    holding a benchmark prompt)."""
    bench = _bench_prompts()

    def samples(heldout: bool, fraction: float = 0.05, seed: int = 0) -> Iterator[Sample]:
        for r in dataset_split(records, heldout, fraction):
            if "messages" in r and not _holds_bench_prompt([m["content"] for m in r["messages"]], bench):
                yield Sample(None, r["messages"])
            elif "text" in r and not _holds_bench_prompt([r["text"]], bench):
                yield Sample(r["text"], None)
    return samples


def dataset_prompts(records: list[dict]):
    """A prompt stream (as `distill_prompts`) over a dataset's instructions (never a benchmark prompt)."""
    bench = _bench_prompts()

    def prompts(heldout: bool, fraction: float = 0.05, seed: int = 0) -> Iterator[str | list[dict]]:
        for r in dataset_split(records, heldout, fraction):
            p = _record_prompt(r)
            if p is not None and not _holds_bench_prompt([p] if isinstance(p, str) else [m["content"] for m in p],
                                                         bench):
                yield p
    return prompts


# -- self-distillation: the target's own greedy answers to instructions made from the offline corpus ---------

def _bench_prompts() -> tuple[str, ...]:
    from ..bench_prompts import CODE_PROMPTS

    return tuple(CODE_PROMPTS)


def _is_bench_like(prompt: str, bench: tuple[str, ...]) -> bool:
    """The guard that keeps benchmark prompts out of the training data (exact or contained, case-insensitive)."""
    low = prompt.lower()
    return any(b.lower() in low or low in b.lower() for b in bench)


# languages the distill prompts ask for besides Python (the tasks come from the corpus's Python functions)
OTHER_LANGUAGES = ("JavaScript", "TypeScript", "Java", "C", "C++", "C#", "Go", "Rust", "Ruby", "PHP", "Kotlin",
                   "Swift", "Bash")


def distill_prompts(heldout: bool, fraction: float = 0.05, seed: int = 0, max_body_lines: int = 24,
                    max_body_chars: int = 900) -> Iterator[str]:
    """Instructions for the target to answer, written from the offline corpus (never forerun's files, never a
    benchmark prompt; held-out files by the same path hash as the other corpora): per documented function one
    of "write a function that <doc>", the same in another language (`OTHER_LANGUAGES`, from the description or
    translating the source: a code model is asked for more than Python; session 45), "explain this function",
    "complete this code", "write a docstring for", "add type hints / tests"; every fourth round also a question
    about a documentation page or an other-language file. Deterministic for a seed."""
    rng = random.Random(seed + 7)
    bench = _bench_prompts()
    py, langs, docs = _split_sources(heldout, fraction, rng)
    writes = ("Write a Python function `{name}` that {doc}", "Write a Python function that {doc}",
              "Implement `{name}` in Python: {doc}", "Write a Python function `{name}`. {Doc}")
    other_writes = ("Write a {lang} function that {doc}", "Write a {lang} function `{name}` that {doc}",
                    "Implement `{name}` in {lang}: {doc}")
    n = 0
    for p in py:
        try:
            src = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        funcs = [f for f in _functions(src) if f[2].count("\n") < max_body_lines and len(f[2]) <= max_body_chars]
        if not funcs:
            continue
        name, first, body = rng.choice(funcs)
        doc = first.rstrip(".")
        doc_l = doc[:1].lower() + doc[1:]
        r = rng.random()
        if r < 0.25:
            prompt = rng.choice(writes).format(name=name, doc=doc_l + ".", Doc=doc + ".")
        elif r < 0.55:  # the same task in another language: from its description, or from the Python source
            lang = rng.choice(OTHER_LANGUAGES)
            if rng.random() < 0.5:
                prompt = rng.choice(other_writes).format(lang=lang, name=name, doc=doc_l + ".")
            else:
                prompt = rng.choice(("Translate this Python function to {lang}:", "Rewrite this function in {lang}:")
                                    ).format(lang=lang) + f"\n\n```python\n{body}\n```"
        elif r < 0.65:
            prompt = rng.choice(("Explain what this Python function does:", "Explain this function.",
                                 "What does this code do?")) + f"\n\n```python\n{body}\n```"
        elif r < 0.75:
            head = body.split('"""')[0].split("\'\'\'")[0].rstrip()
            prompt = f"Complete this Python function ({doc_l}):\n\n```python\n{head}\n```"
        elif r < 0.88:
            prompt = f"Write a docstring for this function:\n\n```python\n{_strip_docstring(body)}\n```"
        else:
            prompt = rng.choice(("Write unit tests for this function:", "Add type hints to this function:",
                                 "Rewrite this function to be more readable:")) + f"\n\n```python\n{body}\n```"
        n += 1
        if not _is_bench_like(prompt, bench):
            yield prompt
        if n % 4 == 0 and (docs or langs):
            if docs and (not langs or rng.random() < 0.6):
                d = docs.pop()
                topic = d.stem if d.stem.lower() not in ("readme", "index", "changelog") else d.parent.name
                q = rng.choice(("Explain {t} briefly.", "What is {t} used for?", "Give an example of using {t}."))
                q = q.format(t=topic)
            else:
                f = langs.pop()
                lang = _LANG_EXT[f.suffix]
                q = rng.choice(("Write a {lang} example in the style of `{n}`.",
                                "Write a small {lang} program like `{n}`.")).format(lang=lang.capitalize(), n=f.name)
            if not _is_bench_like(q, bench):
                yield q


def _strip_docstring(body: str) -> str:
    """The function without its docstring (for "write a docstring" prompts)."""
    for quote in ('"""', "'''"):
        a = body.find(quote)
        if a >= 0:
            b = body.find(quote, a + 3)
            if b >= 0:
                line_start = body.rfind("\n", 0, a) + 1
                line_end = body.find("\n", b + 3)
                return body[:line_start] + (body[line_end + 1:] if line_end >= 0 else "")
    return body


def distill_path(out_dir: str | Path, split: str) -> Path:
    return Path(out_dir) / "distill" / f"{split}.jsonl"


def read_distilled(out_dir: str | Path, split: str) -> list[dict]:
    """The cached answers of a split: [{'prompt', 'prompt_ids', 'answer_ids', 'finish'}] (a torn last line is
    dropped)."""
    f = distill_path(out_dir, split)
    rows = []
    if f.exists():
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                break
    return rows


def chat_prompt_ids(tok, prompt: str | list[dict]) -> list[int]:
    """A prompt (a user message's text, or chat turns) through the chat template, ready for the answer (as the
    engine's chat=True does for a text)."""
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def generate_distilled(llm, out_dir: str | Path, split: str, max_tokens: int, *, max_new: int = 160,
                       chunk: int = 32, heldout_fraction: float = 0.05, seed: int = 0, progress: bool = True,
                       deadline: float | None = None, prompts=None) -> int:
    """The target answers `distill_prompts` (or `prompts`, a stream of the same signature: a dataset's, texts or
    chat turns) greedily (chat template, `max_new` new tokens at most) through
    forerun's batched engine `llm` (an LLM: its max_num_seqs is the batch) until the split's cache holds
    `max_tokens` answer tokens (or time.time() passes `deadline`). Cached as JSON lines under
    out_dir/distill/<split>.jsonl, appended per chunk of prompts (resumable: a rerun skips the prompts already
    answered). Generation time is added up in out_dir/distill/<split>.stats.json. Returns the answer tokens
    cached."""
    import time
    from ..sampling_params import SamplingParams

    f = distill_path(out_dir, split)
    f.parent.mkdir(parents=True, exist_ok=True)
    rows = read_distilled(out_dir, split)
    if f.exists():  # rewrite without a torn line
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    have = sum(len(r["answer_ids"]) for r in rows)
    stats_f = f.with_suffix(".stats.json")
    stats = json.loads(stats_f.read_text()) if stats_f.exists() else {"seconds": 0.0, "runs": []}
    if have >= max_tokens:
        return have
    answered = {json.dumps(r["prompt"], sort_keys=True) for r in rows}
    # (the prompts not answered yet, in stream order: a dataset file that grew, or an installed package that added
    # corpus files, continues where it stands instead of skipping by count)
    stream = (p for p in (prompts or distill_prompts)(split == "heldout", heldout_fraction, seed)
              if json.dumps(p, sort_keys=True) not in answered)
    sp = SamplingParams(temperature=0, max_tokens=max_new)
    bar = tqdm(total=max_tokens, initial=have, desc=f"distill answers ({split})", unit="tok", disable=not progress)
    t0, have0 = time.perf_counter(), have
    while have < max_tokens and (deadline is None or time.time() < deadline):
        batch = [p for _, p in zip(range(chunk), stream)]
        if not batch:
            break
        outs = llm.generate([chat_prompt_ids(llm.tokenizer, p) for p in batch], sp)
        with f.open("a") as fh:
            for p, o in zip(batch, outs):
                fh.write(json.dumps({"prompt": p, "prompt_ids": list(o.prompt_token_ids),
                                     "answer_ids": list(o.token_ids), "finish": o.finish_reason}) + "\n")
        n = sum(len(o.token_ids) for o in outs)
        have += n
        bar.update(n)
        add_run(stats_f, stats, have, have0, time.perf_counter() - t0)
    bar.close()
    return have


def distilled_samples(out_dir: str | Path):
    """A corpus recipe over the cached answers of `out_dir` (prompt ids + answer ids, exactly the tokens the
    target produced: no re-tokenization)."""
    def samples(heldout: bool, fraction: float = 0.05, seed: int = 0) -> Iterator[Sample]:
        for r in read_distilled(out_dir, "heldout" if heldout else "train"):
            yield Sample(None, None, tuple(r["prompt_ids"]) + tuple(r["answer_ids"]))
    return samples


# distill: distilled_samples(folder); dataset: dataset_samples(read_dataset(file))
CORPORA = {"code": corpus_samples, "mix": mixed_samples, "distill": None, "dataset": None}


def encode(tok, sample: Sample, max_len: int) -> list[int]:
    if sample.ids is not None:
        return list(sample.ids)[:max_len]
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
            heldout_fraction: float = 0.05, progress: bool = True, deadline: float | None = None,
            corpus: str = "code", quantize: str = "none", samples=None) -> int:
    """Teacher-forced hidden states of `layers` for corpus samples of one split, until `max_tokens` tokens are
    on disk under out_dir/split/ (or time.time() passes `deadline`: what was extracted is written). Returns
    the tokens stored. Resumable (shards already written are kept). `corpus`: a recipe of CORPORA; `quantize`:
    the target's weight layout (recorded: features must come from the layout drafting runs against, and one
    folder never mixes two); `samples`: a recipe of the same signature instead of the corpus's (a dataset's:
    `corpus` then names it, e.g. "dataset:<the file's hash>"). The extraction wall time is added up
    across runs in out_dir/split/stats.json (`split_stats`)."""
    import time
    from ..config import CacheConfig
    from ..runtime.runner import Chunk, ModelRunner

    d, shards, done_samples, stored = open_split(out_dir, split, layers, max_len, seed, heldout_fraction, corpus,
                                                 quantize)
    if stored >= max_tokens:
        return stored
    t_start = time.perf_counter()
    stored0 = stored
    base = split_stats(out_dir, split)

    def record(now: int) -> None:  # after every shard too, so a killed run keeps its time
        add_run(d / "stats.json", base, now, stored0, time.perf_counter() - t_start)
    weight = model.model.norm.weight  # (its device and dtype: the activations')
    runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=max_len // 16 + 4), weight.device,
                         weight.dtype, max_batch_tokens=max_len, max_seqs=1)
    recipe = samples or (distilled_samples(out_dir) if corpus == "distill" else CORPORA[corpus])
    stream = recipe(split == "heldout", heldout_fraction, seed)
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
            write_shard(d, len(shards), buf_tok, buf_feat, offsets, n_samples)
            shards.append(None)
            record(stored)
            buf_tok, buf_feat, offsets, n_samples = [], {i: [] for i in layers}, [0], 0
            if stored >= max_tokens or late:
                break
    else:
        if len(offsets) > 1:
            write_shard(d, len(shards), buf_tok, buf_feat, offsets, n_samples)
    bar.close()
    record(stored)
    return stored


def open_split(out_dir: str | Path, split: str, layers: tuple[int, ...], max_len: int, seed: int,
               heldout_fraction: float, corpus: str, quantize: str) -> tuple[Path, list[Path], int, int]:
    """A split's feature folder, made or checked against the settings its features were made with (one folder
    never mixes two): (folder, its shards, the corpus samples they cover, the tokens they hold)."""
    d = Path(out_dir) / split
    d.mkdir(parents=True, exist_ok=True)
    meta_path = d / "meta.json"
    meta = {"layers": list(layers), "max_len": max_len, "seed": seed, "heldout_fraction": heldout_fraction,
            "corpus": corpus, "quantize": quantize}
    if meta_path.exists():
        old = {"corpus": "code", "quantize": "none", **json.loads(meta_path.read_text())}  # older folders
        if {k: old.get(k) for k in meta} != meta:
            raise ValueError(f"{d} holds features made with other settings {old}; use another --data folder")
    meta_path.write_text(json.dumps(meta))
    shards = sorted(d.glob("shard_*.pt"))
    heads = [torch.load(s, weights_only=True, mmap=True) for s in shards]  # (mapped: only the counts are read)
    return d, shards, sum(h["num_samples"] for h in heads), sum(int(h["offsets"][-1]) for h in heads)


def add_run(path: Path, base: dict, now: int, start: int, seconds: float, **extra) -> None:
    """Write a stats file: `base` (what earlier runs recorded) with this run added: `seconds` more, `now` tokens in
    all, and a "runs" entry for its `now - start` tokens (plus `extra`)."""
    run = {"tokens": now - start, "seconds": round(seconds, 1),
           "tok_per_s": round((now - start) / max(seconds, 1e-9), 1), **extra}
    path.write_text(json.dumps(dict(base, seconds=round(base.get("seconds", 0.0) + seconds, 1), tokens=now,
                                    runs=list(base.get("runs", [])) + [run])))


def split_stats(out_dir: str | Path, split: str) -> dict:
    """{'seconds': extraction wall time summed over runs, 'tokens': tokens on disk, optional 'note'} ({} if none)."""
    f = Path(out_dir) / split / "stats.json"
    return json.loads(f.read_text()) if f.exists() else {}


def write_shard(d: Path, i: int, toks, feats, offsets, n_samples) -> None:
    data = {"tokens": torch.cat(toks), "offsets": torch.tensor(offsets, dtype=torch.int64),
            "num_samples": n_samples, "feats": {str(k): torch.cat(v) for k, v in feats.items()}}
    tmp = d / f".shard_{i:05d}.tmp"
    torch.save(data, tmp)
    os.replace(tmp, d / f"shard_{i:05d}.pt")


def load_split(out_dir: str | Path, split: str) -> list[dict]:
    """Every sequence of a split: [{'tokens': [T] long, 'feats': {layer: [T, H] bf16}}]. The features stay mapped
    from their shards (file-backed pages the kernel can drop and read again), not copied into the process: 1.1M
    feature tokens of a 1.5B model's three layers are ~10 GB, which on a 24 GB machine next to the trainer made it
    thrash (session 48: steps 1.1 -> 8 s)."""
    seqs = []
    for s in sorted((Path(out_dir) / split).glob("shard_*.pt")):
        data = torch.load(s, weights_only=True, mmap=True)
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
