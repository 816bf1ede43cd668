"""forerun vs llama.cpp on the CPU with the configurations interleaved prompt by prompt, so that every row sees
the same machine: per prompt, forerun plain, forerun draft k, llama.cpp plain, llama.cpp speculative (same GGUF
files, chat template, greedy, threads, token budget as `forerun bench --llamacpp`, whose helpers it uses).

Why: on this shared host the memory bandwidth available to one VM moves by 2x within minutes (other tenants;
invisible in the load average), and `forerun bench` measures its rows one after the other, minutes apart: its
llama.cpp plain row measured 39.7 and 82.6 tok/s in two runs 10 minutes apart, 30-34 tok/s standalone in between.
Interleaving makes the ratios meaningful. Writes JSON (per-prompt times too) and a PNG. Each row also splits its time
into the prompts (forerun: arrival to the first token, `RequestOutput.metrics`; llama.cpp: its "prompt eval" /
"encoded" time) and the decoding of the tokens after each first one.

    python benchmarks/peer_interleaved.py [--threads 2] [--num-prompts 20] [--k 4] [--also-k auto]
        [--eagle ~/.cache/forerun/eagle/qwen1.5b --eagle-k 2,auto] [--prefix-caching] [--out ...]

--prefix-caching adds rows where both engines keep what they computed of earlier prompts: forerun with
`enable_prefix_caching` (target and draft caches), llama.cpp plain with `--prompt-cache` (its speculative tool has
none). Both caches are filled by one untimed prompt (bench.PROMPT_CACHE_WARMUP), so every measured prompt finds the
chat template's system prefix in them (24 of ~46 tokens on the bench prompts).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", default="4")
    ap.add_argument("--also-k", default="", help="comma list of more draft k rows (e.g. auto), interleaved too")
    ap.add_argument("--eagle", default=None, metavar="DIR", help="also rows with this EAGLE head (forerun train-eagle)")
    ap.add_argument("--eagle-k", default="2,auto", help="comma list of k for the --eagle rows")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--llamacpp-draft-max", type=int, default=4)
    ap.add_argument("--prefix-caching", action="store_true",
                    help="also rows with prefix caching: forerun plain and each draft k (enable_prefix_caching) and "
                         "llama.cpp plain (--prompt-cache), both caches filled by one untimed warm-up prompt")
    ap.add_argument("--out", default="benchmarks/results/cpu_quant_llamacpp_interleaved.json")
    ap.add_argument("--replot", metavar="JSON", help="only draw the PNG of an earlier run's JSON")
    a = ap.parse_args()
    if a.replot:
        print(plot(a.replot))
        return 0
    torch.set_num_threads(a.threads)
    from forerun import bench
    from forerun.bench_prompts import CODE_PROMPTS
    from forerun.config import SpecConfig
    from forerun.engine.engine import draft_dtype, load_draft_model
    from forerun.engine.llm import LLM
    from forerun.kernels import cbuild
    from forerun.models import quant
    from forerun.models.registry import load_model
    from forerun.sampling_params import SamplingParams

    load_start = os.getloadavg()
    prompts = list(CODE_PROMPTS[: a.num_prompts])
    target = load_model(a.model, quantize=a.quantize, progress=False)
    ddt = draft_dtype(SpecConfig(), torch.device("cpu"), torch.float32)
    # as the engine loads a --draft model (its 8-bit GGUF matrices int4 too, quant.DRAFT_INT4_OTHERS); runs before
    # 2026-12-04 loaded it as a target (load_model), with a 2x slower 8-bit head
    draft = load_draft_model(a.draft, "cpu", ddt, quantize=a.quantize)
    layout = getattr(target[0], "quantization", a.quantize)
    plain = LLM.from_model(target[0], target[1], device="cpu", enable_prefix_caching=False)
    spec = replace(SpecConfig.from_flags(a.draft, a.k, 0.0, "auto"), draft_model=(draft[0], draft[1]))
    spec_llm = LLM.from_model(target[0], target[1], spec=spec, device="cpu", enable_prefix_caching=False)
    more = []  # (name, llm) of the --also-k rows
    for k in [x for x in a.also_k.split(",") if x]:
        s2 = replace(SpecConfig.from_flags(a.draft, k, 0.0, "auto"), draft_model=(draft[0], draft[1]))
        more.append((f"forerun draft k={k}", LLM.from_model(target[0], target[1], spec=s2, device="cpu",
                                                            enable_prefix_caching=False)))
    for k in [x for x in a.eagle_k.split(",") if x] if a.eagle else []:
        s2 = SpecConfig.from_flags(f"eagle:{os.path.expanduser(a.eagle)}", k, 0.0, "auto")
        more.append((f"forerun EAGLE k={k}", LLM.from_model(target[0], target[1], spec=s2, device="cpu",
                                                            enable_prefix_caching=False)))
    if a.prefix_caching:  # the same models again, with prefix caching (warmed up below on another prompt)
        cached = [("forerun plain, prefix cache", LLM.from_model(target[0], target[1], device="cpu",
                                                                 enable_prefix_caching=True))]
        for k in [a.k, *[x for x in a.also_k.split(",") if x]]:
            s2 = replace(SpecConfig.from_flags(a.draft, k, 0.0, "auto"), draft_model=(draft[0], draft[1]))
            cached.append((f"forerun draft k={k}, prefix cache", LLM.from_model(target[0], target[1], spec=s2,
                                                                                 device="cpu", enable_prefix_caching=True)))
        for _, llm in cached:  # what llama.cpp's prompt cache file is written from (bench.run_llamacpp)
            llm.generate([bench.PROMPT_CACHE_WARMUP], SamplingParams(temperature=0, max_tokens=4), chat=True)
        more += cached
    cache_file = None
    if a.prefix_caching:
        import tempfile

        cache_file = os.path.join(tempfile.mkdtemp(prefix="forerun_llamacpp_"), "prompt_cache.bin")
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    for llm in (plain, spec_llm, *[m for n, m in more if "prefix cache" not in n]):
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), chat=True)  # warm-up
    bargs = argparse.Namespace(model=a.model, draft=a.draft, threads=a.threads, max_tokens=a.max_tokens,
                               llamacpp_draft_max=a.llamacpp_draft_max)
    names = ["forerun plain", f"forerun draft k={a.k}", *[n for n, _ in more], "llama.cpp plain",
             *(["llama.cpp plain, prompt cache"] if a.prefix_caching else []), "llama.cpp speculative"]
    per = {n: [] for n in names}  # (tokens, seconds, prompt seconds, decode seconds) per prompt
    cached_at = {n: [] for n in names}  # forerun rows: prompt tokens found in the prefix cache, per prompt
    identical = 0
    for i, p in enumerate(prompts):
        outs = {}
        for n, llm in ((names[0], plain), (names[1], spec_llm), *more):
            t = time.perf_counter()
            o = llm.generate([p], sp, chat=True)[0]
            sec, m = time.perf_counter() - t, o.metrics
            # prompt: arrival to the first token (the prompt's forward, the draft's too); decode: the tokens after it
            per[n].append((len(o.token_ids), sec, m.time_to_first_token, m.decode_seconds))
            cached_at[n].append(o.stats.cached_tokens)
            outs[n] = o
        identical += all(outs[names[0]].token_ids == o.token_ids for n, o in outs.items() if n != names[0])
        text = target[1].decode(outs[names[0]].token_ids, skip_special_tokens=True)
        for row in bench.run_llamacpp(bargs, [p], [text], prompt_cache=cache_file):
            per[row["config"]].append((row["tokens"], row["seconds"], row["prompt_seconds"],
                                       row["seconds"] - row["prompt_seconds"]))
        print(f"[{i + 1}/{len(prompts)}] " + ", ".join(f"{n} {per[n][-1][0] / per[n][-1][1]:.1f}" for n in names),
              file=sys.stderr, flush=True)
    rows = []
    for n in names:
        tok, sec = sum(x[0] for x in per[n]), sum(x[1] for x in per[n])
        pre, dec = sum(x[2] for x in per[n]), sum(x[3] for x in per[n])
        rows.append({"config": n, "tokens": tok, "seconds": round(sec, 2), "tok_per_s": round(tok / sec, 3),
                     "prompt_seconds": round(pre, 3), "decode_seconds": round(dec, 3),
                     "decode_tok_per_s": round((tok - len(per[n])) / dec, 3),  # the tokens after each first one
                     "per_prompt_tok_per_s": [round(x[0] / x[1], 2) for x in per[n]]})
        if any(cached_at[n]):
            rows[-1]["cached_prompt_tokens"] = cached_at[n]
    base = {r["config"]: r for r in rows}
    for r in rows:
        r["vs_forerun_plain"] = round(r["tok_per_s"] / base[names[0]]["tok_per_s"], 3)
        r["vs_llamacpp_plain"] = round(r["tok_per_s"] / base["llama.cpp plain"]["tok_per_s"], 3)
        r["decode_vs_llamacpp_plain"] = round(r["decode_tok_per_s"] / base["llama.cpp plain"]["decode_tok_per_s"], 3)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "model": a.model, "draft": a.draft,
            "threads": a.threads, "prompts": len(prompts), "max_tokens": a.max_tokens, "quantize": a.quantize,
            "layout": layout, "int4_others": quant.INT4_OTHERS, "int8_kernel": type(quant.int8_linear(torch.zeros(64, 64))).__name__,
            "draft_int4_others": quant.DRAFT_INT4_OTHERS, "cpu": cbuild.cpu_name(), "c_kernels_isa": cbuild.isa(),
            "k": a.k, "eagle": a.eagle, "llamacpp": bench.llamacpp_bin_dir().as_posix(),
            "spec_identical_to_plain": f"{identical}/{len(prompts)}", "prefix_caching": a.prefix_caching,
            "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "order": "per prompt: " + ", ".join(names)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    for r in rows:
        print(f"{r['config']:26s} {r['tok_per_s']:7.2f} tok/s  {r['vs_forerun_plain']:.2f}x forerun plain  "
              f"{r['vs_llamacpp_plain']:.2f}x llama.cpp plain | prompts {r['prompt_seconds']:6.2f} s, decoding "
              f"{r['decode_tok_per_s']:6.2f} tok/s ({r['decode_vs_llamacpp_plain']:.2f}x llama.cpp plain's)")
    plot(a.out)
    print(f"spec identical to plain: {meta['spec_identical_to_plain']}; wrote {a.out} and its PNG")
    return 0


def plot(json_path: str) -> str:
    """Bars of tok/s per configuration (forerun blue, llama.cpp orange), labelled x llama.cpp plain; PNG beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    rows, meta = data["results"], data["meta"]
    split = all("decode_tok_per_s" in r for r in rows)  # runs since session 62: decoding alone beside the total
    fig, ax = plt.subplots(figsize=(9 if split else 8, (0.7 if split else 0.5) * len(rows) + 1.4))
    y = list(range(len(rows)))
    h = 0.4 if split else 0.8
    colors = ["tab:orange" if r["config"].startswith("llama.cpp") else "tab:blue" for r in rows]
    bars = ax.barh([i - (h / 2 if split else 0) for i in y], [r["tok_per_s"] for r in rows], height=h, color=colors,
                   label="prompt + decoding")
    for b, r in zip(bars, rows):
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {r['vs_llamacpp_plain']:.2f}x llama.cpp plain",
                va="center", fontsize=8)
    if split:
        dec = ax.barh([i + h / 2 for i in y], [r["decode_tok_per_s"] for r in rows], height=h, color=colors, alpha=0.45,
                      label="decoding alone (tokens after the first)")
        for b, r in zip(dec, rows):
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2,
                    f" {r['decode_vs_llamacpp_plain']:.2f}x llama.cpp plain's decoding", va="center", fontsize=7)
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(y, [r["config"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"tok/s, prompts interleaved ({meta['prompts']} prompts, {meta['max_tokens']} tokens, greedy, "
                  f"{meta['threads']} threads)")
    ax.set_title(f"{meta['model']} + {meta['draft']} draft, {meta.get('date', '')}", fontsize=9)
    ax.set_xlim(0, 1.45 * max(r.get("decode_tok_per_s", r["tok_per_s"]) for r in rows))
    fig.tight_layout()
    png = str(Path(json_path).with_suffix(".png"))
    fig.savefig(png, dpi=110)
    return png


if __name__ == "__main__":
    raise SystemExit(main())
