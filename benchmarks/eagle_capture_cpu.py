"""EAGLE training data on the CPU, the distill recipe two ways on the same prompts (`forerun train-eagle --corpus
distill`): two passes (forerun's engine answers, then `data.extract` reads prompt + answer again for the features;
`--distill-passes 2`) against one (`capture.capture_distilled`: the features kept from the forwards that answer;
`--distill-passes 1`, the CPU's default since session 44). The target loaded as train-eagle loads it (int4 GGUF),
the same prompts from the offline corpus, the two taking turns round by round; per round and in all: answer
tokens, feature tokens, seconds
and feature tokens per minute, and whether the two gave the same answers and the same features bit for bit (the
CPU kernels' batch invariance says they should). Prints a table, writes JSON and a PNG plot.

    python benchmarks/eagle_capture_cpu.py [--model qwen2.5-coder-1.5b-instruct] [--rounds 2] [--prompts 32]
        [--batch 16] [--also-batch N] [--max-new 160] [--seq-len 384] [--threads 2] [--out benchmarks/results/eagle_capture_cpu.json]
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per round")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--also-batch", type=int, default=None, metavar="N",
                    help="also the one-pass recipe with N sequences at once (a third recipe in the rotation)")
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/eagle_capture_cpu.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from forerun.eagle import data as D
    from forerun.eagle.capture import capture_distilled
    from forerun.engine.llm import LLM
    from forerun.kernels import cbuild
    from forerun.models.hub import resolve_model
    from forerun.models.eagle_head import EagleConfig
    from forerun.models.loader import load_checkpoint
    from forerun.models.registry import load_model, parse_quantize

    ckpt = load_checkpoint(resolve_model(a.model))
    layout = parse_quantize("auto", ckpt.format, torch.device("cpu"))
    target, tok, _ = load_model(a.model, "cpu", torch.float32, pack_cpu=ckpt.config.tie_word_embeddings,
                                quantize=layout, progress=False)
    layers = D.feature_layers(target.config.num_layers, EagleConfig.for_target(target.config, version=3).aux_layers)
    llm = LLM.from_model(target, tok, device="cpu", max_num_seqs=a.batch)
    all_prompts = list(itertools.islice(D.distill_prompts(False), a.rounds * a.prompts))
    work = Path(tempfile.mkdtemp(prefix="eagle_capture_"))
    kw = dict(max_len=a.seq_len, seed=0, corpus="distill", quantize=layout, progress=False)
    recipes = ("two", "one") + (("wide",) if a.also_batch else ())
    names = {"two": "two-pass", "one": "one-pass", "wide": f"one-pass, batch {a.also_batch}"}
    rows, tot = [], {k: [0, 0, 0.0] for k in recipes}
    same_answers = same_features = True
    print(f"{a.model} ({layout}), {a.threads} threads, ISA {cbuild.isa()}, batch {a.batch}, {a.prompts} prompts a "
          f"round, max_new {a.max_new}, layers {list(layers)}")
    print("| round | recipe | answer tokens | feature tokens | s | feature tok/min |")
    print("| --- | --- | --- | --- | --- | --- |")
    try:
        for r in range(a.rounds):
            ps = all_prompts[r * a.prompts:(r + 1) * a.prompts]
            src = lambda heldout, fraction=0.05, seed=0, ps=ps: iter(ps)  # noqa: E731
            dirs = {k: work / f"{k}{r}" for k in recipes}
            order = recipes if r % 2 == 0 else recipes[::-1]
            for k in order:
                t0 = time.perf_counter()
                if k == "two":
                    n_ans = D.generate_distilled(llm, dirs[k], "train", 10 ** 9, max_new=a.max_new, chunk=2 * a.batch,
                                                 progress=False, prompts=src)
                    n_feat = D.extract(target, tok, dirs[k], layers, "train", 10 ** 9, **kw)
                else:
                    b = a.batch if k == "one" else a.also_batch
                    n_ans, n_feat = capture_distilled(target, tok, dirs[k], "train", 10 ** 9, 10 ** 9, layers,
                                                      batch=b, max_new=a.max_new, flush=2 * a.batch,
                                                      prompts=src, **kw)
                dt = time.perf_counter() - t0
                row = {"round": r, "recipe": names[k], "answer_tokens": n_ans,
                       "feature_tokens": n_feat, "seconds": round(dt, 1),
                       "feature_tokens_per_min": round(60 * n_feat / dt, 1)}
                rows.append(row)
                for i, v in enumerate((n_ans, n_feat, dt)):
                    tot[k][i] += v
                print(f"| {r} | {row['recipe']} | {n_ans} | {n_feat} | {dt:.1f} | {row['feature_tokens_per_min']} |",
                      flush=True)
            # the same answers (in another order: the one-pass recipe writes them as they finish) and features
            ra = {json.dumps(x["prompt"]): x for x in D.read_distilled(dirs["two"], "train")}
            fa = {tuple(s["tokens"].tolist()): s for s in D.load_split(dirs["two"], "train")}
            for k in recipes[1:]:
                rb = {json.dumps(x["prompt"]): x for x in D.read_distilled(dirs[k], "train")}
                same_answers &= ra.keys() == rb.keys() and all(ra[p]["answer_ids"] == rb[p]["answer_ids"] for p in ra)
                fb = {tuple(s["tokens"].tolist()): s for s in D.load_split(dirs[k], "train")}
                same_features &= fa.keys() == fb.keys() and all(
                    torch.equal(fa[t]["feats"][i], fb[t]["feats"][i]) for t in fa for i in layers)
            print(f"round {r}: same answers {same_answers}, same features {same_features}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {k: {"answer_tokens": v[0], "feature_tokens": v[1], "seconds": round(v[2], 1),
                   "feature_tokens_per_min": round(60 * v[1] / v[2], 1)} for k, v in tot.items()}
    ratio = summary["one"]["feature_tokens_per_min"] / summary["two"]["feature_tokens_per_min"]
    print(f"in all: two-pass {summary['two']['feature_tokens_per_min']} feature tok/min, one-pass "
          f"{summary['one']['feature_tokens_per_min']}: {ratio:.2f}x; same answers {same_answers}, same features "
          f"{same_features}")
    if a.also_batch:
        print(f"one-pass at batch {a.also_batch}: {summary['wide']['feature_tokens_per_min']} feature tok/min, "
              f"{summary['wide']['feature_tokens_per_min'] / summary['one']['feature_tokens_per_min']:.2f}x batch "
              f"{a.batch}")
    res = {"meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "model": a.model,
                    "layout": layout, "threads": a.threads, "isa": cbuild.isa(), "batch": a.batch,
                    "also_batch": a.also_batch, "prompts_per_round": a.prompts, "rounds": a.rounds, "max_new": a.max_new, "seq_len": a.seq_len,
                    "layers": list(layers), "cpu": cbuild.cpu_name(), "loadavg_at_end": os.getloadavg()},
           "rounds": rows, "summary": {"two_pass": summary["two"], "one_pass": summary["one"],
                                       "one_over_two": round(ratio, 3), "same_answers": same_answers,
                                       "same_features": same_features}}
    if a.also_batch:
        res["summary"]["one_pass_also_batch"] = summary["wide"]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    rounds = sorted({r["round"] for r in rows})
    names = list(dict.fromkeys(r["recipe"] for r in rows))
    w = 0.8 / len(names)
    for j, name in enumerate(names):
        ys = [next(r["feature_tokens_per_min"] for r in rows if r["round"] == k and r["recipe"] == name)
              for k in rounds]
        ax.bar([k + (j - (len(names) - 1) / 2) * w for k in rounds], ys, width=w, label=name)
    ax.set_xlabel("round (same prompts for both recipes)")
    ax.set_ylabel("feature tokens / minute")
    ax.set_xticks(rounds)
    ax.set_title("EAGLE distill data on the CPU: two passes vs one")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
