"""Self-distillation with the features captured as the target answers (`forerun train-eagle --corpus distill`).

The distill recipe needs, per prompt, the target's greedy answer and then the target's hidden states over prompt +
answer. Done in two passes (the engine answers, `data.extract` reads the text again) the target runs every token
twice. Here the forwards that generate the answer are the ones whose hidden states are kept: a prompt's rows come
from its prefill, an answer token's from the decode step that feeds it (the last one fed once more, as extraction
reads it too). Up to `batch` sequences decode together, a finished one's place taken by the next prompt in the
same forward (continuous batching over `ModelRunner`, the engine's runtime, greedy as the engine's temperature 0).

On the CPU a row's bits do not depend on the rows beside it (the C kernels' batch invariance), so the answers are
the engine's and the features are `data.extract`'s bit for bit (tests/test_eagle_capture.py). The cache layout is
the two-pass one: answers appended to `distill/<split>.jsonl`, then their features written as a shard of the
split's folder, in the same order, so a run stopped between the two is caught up by `data.extract` (it skips the
samples the shards cover) and every later run goes on from there.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import data as D


@dataclass
class _Seq:
    prompt: object  # the prompt as the stream gave it (text or chat turns), written to the cache
    ids: list[int]  # prompt ids, then the answer's as they come
    n_prompt: int
    feats: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> [n, H] bf16 pieces
    fed: int = 0  # tokens fed to the target so far
    finish: str | None = None  # "stop" / "length" once the answer is complete


def capture_distilled(model, tok, out_dir: str | Path, split: str, answer_tokens: int, feature_tokens: int,
                      layers: tuple[int, ...], *, max_len: int = 512, min_len: int = 24, batch: int = 16,
                      max_new: int = 160, flush: int = 32, heldout_fraction: float = 0.05, seed: int = 0,
                      corpus: str = "distill", quantize: str = "none", prompts=None, progress: bool = True,
                      deadline: float | None = None) -> tuple[int, int]:
    """Answer prompts of `prompts` (default `data.distill_prompts`) greedily with the target `model` (chat
    template, at most `max_new` new tokens, `batch` sequences at a time) until the split's cache holds
    `answer_tokens` answer tokens or its feature folder `feature_tokens` tokens (or time.time() passes
    `deadline`), keeping the hidden states of `layers` over prompt + answer as `data.extract` would store them
    (the first `max_len` tokens; samples shorter than `min_len` counted, not stored). Answers and features are
    written every `flush` finished prompts. Returns (answer tokens, feature tokens) in the cache."""
    from ..config import CacheConfig
    from ..runtime.runner import Chunk, ModelRunner

    d, shards, done_samples, stored = D.open_split(out_dir, split, layers, max_len, seed, heldout_fraction, corpus,
                                                   quantize)
    f = D.distill_path(out_dir, split)
    f.parent.mkdir(parents=True, exist_ok=True)
    rows = D.read_distilled(out_dir, split)
    if f.exists():  # rewrite without a torn line
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if done_samples < len(rows):  # answers whose features a stopped run did not write: read them now
        stored = D.extract(model, tok, out_dir, layers, split, feature_tokens, max_len=max_len, min_len=min_len,
                           seed=seed, heldout_fraction=heldout_fraction, progress=progress, corpus=corpus,
                           quantize=quantize)
        shards = sorted(d.glob("shard_*.pt"))
    n_shards = len(shards)  # the next shard's number
    have = sum(len(r["answer_ids"]) for r in rows)
    if have >= answer_tokens or stored >= feature_tokens:
        return have, stored
    answered = {json.dumps(r["prompt"], sort_keys=True) for r in rows}
    stream = (p for p in (prompts or D.distill_prompts)(split == "heldout", heldout_fraction, seed)
              if json.dumps(p, sort_keys=True) not in answered)
    stops = set(model.config.eos_token_ids)
    if getattr(tok, "eos_token_id", None) is not None:
        stops.add(tok.eos_token_id)
    weight = model.model.norm.weight  # (its device and dtype: the activations')
    longest = max_len + max_new + 1  # a sequence's tokens at most (prompts of more than max_len are not taken)
    runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=batch * (longest // 16 + 2) + 4), weight.device,
                         weight.dtype, max_batch_tokens=batch * (max_len + 1), max_seqs=batch)
    stats_f = f.with_suffix(".stats.json")
    stats = json.loads(stats_f.read_text()) if stats_f.exists() else {}
    fstats = D.split_stats(out_dir, split)
    bar = tqdm(total=answer_tokens, initial=have, desc=f"distill answers + features ({split})", unit="tok",
               disable=not progress)
    t0, have0, stored0 = time.perf_counter(), have, stored
    active: dict[int, _Seq] = {}
    done: list[_Seq] = []
    free_ids = list(range(batch))
    exhausted, skipped = False, 0

    def write(seqs: list[_Seq]) -> None:
        nonlocal have, stored, n_shards
        with f.open("a") as fh:
            for s in seqs:
                fh.write(json.dumps({"prompt": s.prompt, "prompt_ids": s.ids[:s.n_prompt],
                                     "answer_ids": s.ids[s.n_prompt:], "finish": s.finish}) + "\n")
        kept = [s for s in seqs if min(len(s.ids), max_len) >= min_len]
        if kept:
            feats = {i: [torch.cat(s.feats[i])[:max_len] for s in kept] for i in layers}
            toks = [torch.tensor(s.ids[:max_len], dtype=torch.int32) for s in kept]
            offsets = [0]
            for t in toks:
                offsets.append(offsets[-1] + len(t))
            D.write_shard(d, n_shards, toks, feats, offsets, len(seqs))
            n_shards += 1
            stored += offsets[-1]
        have += sum(len(s.ids) - s.n_prompt for s in seqs)
        D.add_run(stats_f, stats, have, have0, time.perf_counter() - t0, features_captured=stored - stored0)
        # the features cost no pass of their own: their folder's time stays what extraction took
        (d / "stats.json").write_text(json.dumps(dict(fstats, tokens=stored, captured=fstats.get("captured", 0)
                                                      + stored - stored0, note="features captured during distillation"
                                                      " cost no extraction time")))

    try:
        while active or not exhausted:
            late = deadline is not None and time.time() >= deadline
            # (budgets count what is written: a chunk in flight may pass them by a little, as the engine path does)
            full = have + sum(len(s.ids) - s.n_prompt for s in done) >= answer_tokens or stored >= feature_tokens
            chunks = []
            while free_ids and not exhausted and not late and not full:
                p = next(stream, None)
                if p is None:
                    exhausted = True
                    break
                ids = D.chat_prompt_ids(tok, p)
                if len(ids) > max_len:  # its features would hold none of the answer: not answered (nor cached)
                    skipped += 1
                    continue
                sid = free_ids.pop()
                active[sid] = _Seq(p, list(ids), len(ids), {i: [] for i in layers})
                runner.kv.add_sequence(sid)
            if late or full:
                exhausted = True  # (the sequences in flight finish)
            if not active:
                break
            for sid, s in active.items():  # each sequence's unfed tokens (a prompt, or its newest token)
                chunks.append(Chunk(sid, s.ids[s.fed:], logits="none" if s.finish else "last"))
            out, starts = runner.forward(chunks, hidden_layers=layers)
            row = 0
            for c, st in zip(chunks, starts):
                sid = c.seq_id
                s, n = active[sid], len(c.token_ids)
                for i in layers:
                    s.feats[i].append(out.hidden_states[i][row:row + n].to("cpu", torch.bfloat16))
                row += n
                s.fed += n
                if s.finish is None:
                    t = int(out.logits[st].argmax())
                    s.ids.append(t)
                    bar.update(1)
                    if t in stops:
                        s.finish = "stop"
                    elif len(s.ids) - s.n_prompt >= max_new:
                        s.finish = "length"
                elif s.fed == len(s.ids):  # its last token fed: complete
                    done.append(active.pop(sid))
                    runner.kv.free(sid)
                    free_ids.append(sid)
            if len(done) >= flush or (done and not active):
                write(done)
                done = []
    finally:
        bar.close()
        for sid in list(active):
            runner.kv.free(sid)
    if skipped and progress:
        print(f"[train-eagle] {skipped} prompts of more than {max_len} tokens (--seq-len) not answered", flush=True)
    return have, stored
