"""`forerun bench`: plain vs speculative decoding on the CPU with real GGUF models, and transformers'
assisted generation on the same weights as the peer, in one run. Writes JSON and a PNG plot.

``--quantize`` picks how forerun holds the GGUF weights (auto: kept quantized as int4, or int8 where the
C kernel cannot run (no gcc, no AVX2); none: widened to
fp32). ``--llamacpp`` adds llama.cpp peer rows (plain ``llama-completion`` and ``llama-speculative`` with the
same draft, prompts, chat template, threads and token budget), measured in the same run; the binaries come
from ``python benchmarks/llamacpp.py build`` (a benchmark-only build, never a runtime dependency).

Every configuration decodes the same prompts one at a time (batch 1, greedy), so tok/s are comparable
side by side, and every greedy speculative output is checked token-identical to plain decoding.
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .bench_prompts import CODE_PROMPTS
from .paths import cache_dir
from .usage import ArgumentParser, UsageError


DEFAULT_EAGLE_HEAD = "~/.cache/forerun/eagle/qwen1.5b"


def _configs(args) -> list[tuple[str, str, str, str | None]]:
    """(label, draft spec, k, EAGLE tree or None) for forerun runs."""
    out = [("plain", "none", "0", None)]
    ks = args.ks.split(",")
    for drafter in args.drafters.split(","):
        if drafter == "eagle":
            out += _eagle_configs(args)
            continue
        name = {"draft": args.draft, "early-exit": f"early-exit:{args.early_exit_layers}", "ngram": "ngram"}[drafter]
        for k in ks:
            out.append((f"{drafter} k={k}", name, k, None))
            if drafter == "draft":  # the same with the draft ranking part of the vocabulary
                out += [(f"draft k={k} vocab={n}", name, k, None) for n in filter(None, args.draft_vocabs.split(","))]
    return out


def _eagle_configs(args) -> list[tuple[str, str, str, str | None]]:
    """EAGLE rows: a chain per --eagle-ks and a dynamic tree per --eagle-trees (TOPK,STEPS,NODES;...), all with
    the head in --eagle-head; none (and a message saying why) when that folder holds no head."""
    head = eagle_head_dir(args)
    if head is None:
        return []
    spec = f"eagle:{head}"
    out = [(f"eagle k={k}", spec, k, None) for k in filter(None, args.eagle_ks.split(","))]
    for tree in filter(None, args.eagle_trees.split(";")):
        from .config import parse_eagle_tree_row

        shape, conf = parse_eagle_tree_row(tree)
        text = ",".join(map(str, shape))
        cut, row = ("", text) if conf is None else (f" p>={conf:g}", f"{text}@{conf:g}")  # (the cut rides along)
        out.append((f"eagle tree {text}{cut}", spec, "auto", row))
        if args.eagle_budget:
            out.append((f"eagle tree <={text}{cut} budget", spec, "auto", row))
    return out


def eagle_head_dir(args) -> Path | None:
    """The EAGLE head folder of --eagle-head, or None (with a message) when it holds no head."""
    d = Path(args.eagle_head).expanduser()
    if not (d / "config.json").exists() or not any(d.glob("*.safetensors")) and not any(d.glob("pytorch_model*.bin")):
        print(f"[bench] skipping the EAGLE rows: no EAGLE head in {d} (train one with `forerun train-eagle --target "
              f"{args.model} --out {d}`, or point --eagle-head at a head's folder)", file=sys.stderr)
        return None
    return d


def eagle_head_info(head_dir: Path) -> dict:
    """What the bench records about a head: its folder, family, draft vocabulary and, for heads trained by
    `forerun train-eagle`, the training wall time, data size and held-out acceptance (training_summary.json)."""
    info: dict = {"dir": str(head_dir)}
    try:
        cfg = json.loads((head_dir / "config.json").read_text())
    except (OSError, ValueError):
        return info
    info["draft_vocab_size"] = cfg.get("draft_vocab_size")
    info["intermediate_size"] = cfg.get("intermediate_size")
    summary = head_dir / "training_summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        keys = ("target", "version", "train_tokens", "heldout_tokens", "feature_seconds", "feature_seconds_note",
                "train_seconds", "total_seconds", "wall_seconds", "steps", "sequence_tokens", "acc_len",
                "acc_len_all", "untrained_acc_len", "step_acc", "sessions")
        info["training"] = {k: s[k] for k in keys if k in s}
    elif "forerun_training" in cfg:
        info["training"] = cfg["forerun_training"]
    else:
        info["training"] = None  # not trained by forerun train-eagle (a published head): nothing recorded
    return info


def run_forerun(args, prompts) -> tuple[list[dict], dict]:
    from .engine.llm import LLM
    from .models.registry import load_model
    from .sampling_params import SamplingParams

    t = time.perf_counter()
    target = load_model(args.model, quantize=args.quantize)
    from .config import SpecConfig
    from .engine.engine import draft_dtype, load_draft_model

    ddtype = draft_dtype(SpecConfig(), torch.device("cpu"), torch.float32)
    draft = load_draft_model(args.draft, "cpu", ddtype, quantize=args.quantize) if "draft" in args.drafters else None
    full_head = draft[0].lm_head if draft is not None else None
    print(f"[bench] loaded forerun models in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows, plain_ids = [], None
    for label, dname, k, tree in _configs(args):
        vocab = int(label.rpartition("vocab=")[2]) if " vocab=" in label else None
        conf = None
        if tree and dname.startswith("eagle:"):  # an EAGLE tree row: TOPK,STEPS,NODES[@C], C its confidence cut
            from .config import parse_eagle_tree_row

            shape, conf = parse_eagle_tree_row(tree)
            tree = ",".join(map(str, shape))
        spec = SpecConfig.from_flags(dname, k, conf if dname.startswith("eagle:") else 0.0,
                                     None if tree else "auto", tree=tree, draft_vocab=vocab)
        if spec.method == "draft":
            from dataclasses import replace
            spec = replace(spec, draft_model=(draft[0], draft[1]))
            draft[0].lm_head = full_head  # (a vocab= row replaces it in place; every row starts from the full head)
        llm = LLM.from_model(target[0], target[1], spec=spec, device="cpu",
                             enable_prefix_caching=getattr(args, "prefix_caching", False))
        if label.endswith(" budget"):  # the per-round tree budget from the engine's measured costs
            llm.engine.drafter.use_target_cost(llm.engine.k_policy.cost)
        elif tree:  # the fixed tree (the engine turns the budget on for every dynamic tree)
            llm.engine.drafter.budget = None
        # warm-up (with prefix caching on another prompt than the measured ones: the cache then holds the chat
        # template's system prefix for each, as llama.cpp's prompt-cache file does, run_llamacpp)
        warm = [PROMPT_CACHE_WARMUP] if getattr(args, "prefix_caching", False) else prompts[:1]
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=4), chat=True)
        outs, seconds = [], 0.0
        for p in tqdm(prompts, desc=label, file=sys.stderr):
            t = time.perf_counter()
            outs += llm.generate([p], sp, chat=True)
            seconds += time.perf_counter() - t
        agg = llm.aggregate_stats(outs)
        ids = [o.token_ids for o in outs]
        if plain_ids is None:
            plain_ids = ids
        tokens = sum(map(len, ids))
        # arrival to each first token (the prompts' forwards, the draft's read of them where it comes first), as
        # the llama.cpp rows' prompt_seconds are its "prompt eval" times
        prompt_sec = sum(o.metrics.time_to_first_token for o in outs)
        row = {"engine": "forerun", "config": label, "tokens": tokens, "seconds": round(seconds, 2),
               "tok_per_s": round(tokens / seconds, 3), "prompt_seconds": round(prompt_sec, 3),
               "identical_to_plain": ids == plain_ids, **agg.as_dict()}
        if vocab is not None:
            row["draft_vocab_tokens"] = len(draft[0].lm_head.ids)  # the first N ids and the special tokens
        if spec.method == "eagle":
            row["eagle_head"] = spec.eagle_head
            row["eagle_head_layout"] = llm.engine.drafter.head_layout
            budget = getattr(llm.engine.drafter, "budget", None)
            if budget is not None:
                row["eagle_budget_chosen"] = dict(sorted(budget.chosen.items(), key=lambda kv: -kv[1]))
                row["eagle_budget_calibration"] = round(budget.calibration, 3)
            if tree:
                row["eagle_tree"] = {"topk": spec.eagle_tree[0], "steps": spec.eagle_tree[1], "nodes": spec.eagle_tree[2],
                                     "confidence": spec.confidence_threshold}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
        _save(args, rows)
    plain_text = [target[1].decode(x, skip_special_tokens=True) for x in plain_ids]
    del target, draft
    gc.collect()
    return rows, {"plain_ids": plain_ids, "plain_text": plain_text}


# ---------------------------------------------------------------------- llama.cpp peer


# x86 ISA flags of /proc/cpuinfo -> llama.cpp's CMake switches (used where the native build is avoided)
_LLAMACPP_ISA = (("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("bmi2", "GGML_BMI2"), ("fma", "GGML_FMA"),
                 ("f16c", "GGML_F16C"), ("avx_vnni", "GGML_AVX_VNNI"), ("avx512f", "GGML_AVX512"),
                 ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
                 ("avx512_bf16", "GGML_AVX512_BF16"))


def llamacpp_build_config(cpu_flags: set[str] | None = None) -> tuple[str, list[str]]:
    """(build folder name, ISA CMake flags) of the benchmark's llama.cpp build on this CPU: native, except on a CPU
    with AMX, where the same ISA is listed without AMX. Why: llama.cpp's AMX matrix product
    (ggml_backend_amx_mul_mat) died with SIGSEGV on the Q4_K_M target at its first prompt here (llama-cpp-python
    0.3.36, 2 threads, 2026-12-03); `--no-repack` avoided it but decoded ~18 % slower than the build without AMX."""
    if cpu_flags is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
        line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        cpu_flags = set(line.partition(":")[2].split())
    if "amx_tile" not in cpu_flags:
        return "build", ["-DGGML_NATIVE=ON"]
    return "build_noamx", ["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if f in cpu_flags else 'OFF'}"
                                                   for f, opt in _LLAMACPP_ISA]


def llamacpp_dir() -> Path:
    import os

    return Path(os.environ.get("FORERUN_LLAMACPP_DIR", cache_dir() / "llamacpp"))


def llamacpp_built() -> Path | None:
    """The bin folder of this CPU's llama.cpp build when its two tools are there, else None."""
    d = llamacpp_dir() / llamacpp_build_config()[0] / "bin"
    return d if (d / "llama-completion").exists() and (d / "llama-speculative").exists() else None


def llamacpp_bin_dir() -> Path:
    d = llamacpp_built()
    if d is None:
        where = llamacpp_dir() / llamacpp_build_config()[0] / "bin"
        raise SystemExit(f"forerun bench: llama.cpp is not built in {where}; run `python benchmarks/llamacpp.py build`")
    return d


def _ms(pattern: str, text: str) -> float:
    import re

    m = re.search(pattern, text)
    if not m:
        raise RuntimeError(f"llama.cpp output lacks {pattern!r}:\n{text[-2000:]}")
    return float(m.group(1))


PROMPT_CACHE_WARMUP = "Say hello."  # the prompt that fills a prompt cache before the measured ones (not measured)


def llamacpp_timings(log: str, speculative: bool) -> dict:
    """One llama.cpp run's tokens and seconds from its log: prompt processing + decoding as it reports them (model
    loading excluded). llama-completion: "prompt eval time" and "eval time ... N runs" (the first new token comes
    out of the prompt pass: N + 1 tokens); llama-speculative: "encoded" / "decoded" and its draft counts."""
    if speculative:
        pre = _ms(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log)
        return {"tokens": int(_ms(r"decoded\s+(\d+) tokens", log)), "prompt_seconds": pre,
                "seconds": pre + _ms(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", log),
                "drafted": int(_ms(r"n_drafted\s*=\s*(\d+)", log)), "accepted": int(_ms(r"n_accept\s*=\s*(\d+)", log))}
    # "(?<!prompt )": the decode line, not "prompt eval time" (\b alone matched that one first, which counted the
    # prompt time twice and no decode time: llama.cpp plain rows before 2026-11-30 23:40)
    pre = _ms(r"prompt eval time =\s*([\d.]+) ms", log) / 1e3
    return {"tokens": int(_ms(r"(?<!prompt )\beval time =\s*[\d.]+ ms /\s*(\d+) runs", log)) + 1, "prompt_seconds": pre,
            "seconds": pre + _ms(r"(?<!prompt )\beval time =\s*([\d.]+) ms /\s*\d+ runs", log) / 1e3}


def run_llamacpp(args, prompts, plain_text, prompt_cache: str | None = None) -> list[dict]:
    """llama.cpp plain (llama-completion) and speculative (llama-speculative, same draft GGUF) on the same
    chat-templated prompts, greedy, same threads and max tokens. Time = prompt processing + decoding as
    llama.cpp reports it (model loading excluded, as forerun's rows exclude it).
    prompt_cache: a file path: also "llama.cpp plain, prompt cache" (llama-completion --prompt-cache: the prompt
    tokens that match the file's are not processed again; the file is written once, by a first untimed run on
    PROMPT_CACHE_WARMUP, so every measured prompt finds the chat template's system prefix there, as forerun's
    prefix-caching rows do after the same warm-up prompt)."""
    import subprocess
    import tempfile

    from .models.hub import resolve_model
    from .models.loader import load_checkpoint

    bdir = llamacpp_bin_dir()
    target, draft = str(resolve_model(args.model)), str(resolve_model(args.draft))
    tok = load_checkpoint(target).tokenizer()
    threads = str(args.threads or torch.get_num_threads())
    common = ["-n", str(args.max_tokens), "--temp", "0", "--top-k", "1", "-s", "0", "-c", "4096", "-t", threads,
              "-tb", threads]
    configs = [("llama.cpp plain", [str(bdir / "llama-completion"), "-m", target, "-no-cnv", "--no-display-prompt",
                                    "--simple-io", "--no-warmup", *common]),
               ("llama.cpp speculative", [str(bdir / "llama-speculative"), "-m", target, "-md", draft, "-td", threads,
                                          "-tbd", threads, "--spec-draft-n-max", str(args.llamacpp_draft_max), *common])]
    if prompt_cache is not None:
        cached = [*configs[0][1], "--prompt-cache", prompt_cache]
        if not Path(prompt_cache).exists():  # written by this first run (llama-completion keeps it after)
            text = tok.apply_chat_template([{"role": "user", "content": PROMPT_CACHE_WARMUP}], add_generation_prompt=True,
                                           tokenize=False)
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
                f.write(text)
            subprocess.run([*cached, "-f", f.name], capture_output=True, text=True, timeout=900, check=True)
            Path(f.name).unlink()
        configs.insert(1, ("llama.cpp plain, prompt cache", cached))
    rows = []
    for label, cmd in configs:
        tokens, seconds, prompt_sec, drafted, accepted, same = 0, 0.0, 0.0, 0, 0, 0
        for i, p in enumerate(tqdm(prompts, desc=label, file=sys.stderr)):
            text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
                f.write(text)
            out = subprocess.run([*cmd, "-f", f.name], capture_output=True, text=True, timeout=900)
            Path(f.name).unlink()
            log = out.stdout + out.stderr
            if out.returncode:
                raise RuntimeError(f"{label} failed ({out.returncode}):\n{log[-3000:]}")
            t = llamacpp_timings(log, "speculative" in label)
            n, sec, pre = t["tokens"], t["seconds"], t["prompt_seconds"]
            drafted += t.get("drafted", 0)
            accepted += t.get("accepted", 0)
            tokens += n
            seconds += sec
            prompt_sec += pre
            gen = out.stdout
            marker = "<|im_start|>assistant"  # llama-speculative echoes the prompt before the new text
            if "speculative" in label and marker in gen:
                gen = gen[gen.rindex(marker) + len(marker):]
            if plain_text is not None and i < len(plain_text):
                a, b = gen.strip(), plain_text[i].strip()
                same += int(a[: len(b)] == b[: len(a)] and min(len(a), len(b)) > 0)
        row = {"engine": "llama.cpp", "config": label, "tokens": tokens, "seconds": round(seconds, 2),
               "tok_per_s": round(tokens / seconds, 3), "prompt_seconds": round(prompt_sec, 3),
               "identical_to_plain": None, "text_matches_forerun_plain": f"{same}/{len(prompts)}", "cmd": " ".join(cmd)}
        if drafted:
            row["acceptance_rate"] = round(accepted / drafted, 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def run_transformers(args, prompts, plain_ids) -> list[dict]:
    """transformers generate and assisted generation on the same GGUF files (dequantised to fp32)."""
    import transformers

    from .models.hub import resolve_model

    def load(name):
        p = resolve_model(name)
        tok = transformers.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, trust_remote_code=False)
        model = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32,
                                                                  trust_remote_code=False)
        return model.eval(), tok

    t = time.perf_counter()
    target, tok = load(args.model)
    assistant, _ = load(args.draft)
    print(f"[bench] loaded transformers models in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    rows = []
    for label, extra in (("transformers generate", {}), ("transformers assisted", {"assistant_model": assistant})):
        ids_all, seconds = [], 0.0
        for p in tqdm(prompts, desc=label, file=sys.stderr):
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
            t = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(**ids, max_new_tokens=args.max_tokens, do_sample=False, **extra)
            seconds += time.perf_counter() - t
            ids_all.append(out[0, ids["input_ids"].shape[1]:].tolist())
        tokens = sum(map(len, ids_all))
        row = {"engine": "transformers", "config": label, "tokens": tokens, "seconds": round(seconds, 2),
               "tok_per_s": round(tokens / seconds, 3),
               "identical_to_plain": [x[: len(y)] for x, y in zip(ids_all, plain_ids)] == [y[: len(x)] for x, y in zip(ids_all, plain_ids)]}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def _save(args, rows) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plain = next((r["tok_per_s"] for r in rows if r["config"] == "plain"), None)
    assisted = next((r["tok_per_s"] for r in rows if r["config"] == "transformers assisted"), None)
    lcpp = next((r["tok_per_s"] for r in rows if r["config"] == "llama.cpp plain"), None)
    lcpp_spec = next((r["tok_per_s"] for r in rows if r["config"] == "llama.cpp speculative"), None)
    for r in rows:
        if plain:
            r["speedup_vs_plain"] = round(r["tok_per_s"] / plain, 3)
        if assisted:
            r["ratio_vs_transformers_assisted"] = round(r["tok_per_s"] / assisted, 3)
        if lcpp:
            r["ratio_vs_llamacpp_plain"] = round(r["tok_per_s"] / lcpp, 3)
        if lcpp_spec:
            r["ratio_vs_llamacpp_speculative"] = round(r["tok_per_s"] / lcpp_spec, 3)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.machine(),
            "cpu_threads": torch.get_num_threads(), "torch": torch.__version__, "model": args.model,
            "draft": args.draft, "early_exit_layers": args.early_exit_layers, "prompts": args.num_prompts,
            "max_tokens": args.max_tokens, "quantize": args.quantize, "batch": 1, "temperature": 0,
            "loadavg": [round(x, 2) for x in __import__("os").getloadavg()],
            "prefix_caching": getattr(args, "prefix_caching", False)}
    if getattr(args, "llamacpp", False):
        meta["llamacpp_bin"] = str(llamacpp_bin_dir())
        meta["llamacpp_isa"] = llamacpp_build_config()[1]
    if any(r.get("eagle_head") for r in rows):
        meta["eagle_head"] = eagle_head_info(Path(next(r["eagle_head"] for r in rows if r.get("eagle_head"))))
        plain_tps = next((r["tok_per_s"] for r in rows if r["config"] == "plain"), None)
        best_draft = max((r["tok_per_s"] for r in rows if r["config"].startswith("draft ")), default=None)
        if best_draft:
            for r in rows:
                if r.get("eagle_head"):
                    r["ratio_vs_best_draft_model"] = round(r["tok_per_s"] / best_draft, 3)
        meta["plain_tok_per_s"] = plain_tps
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))


def plot(json_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    rows = data["results"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
    labels = [r["config"] for r in rows]
    colors = [{"transformers": "tab:gray", "llama.cpp": "tab:orange"}.get(r["engine"], "tab:blue") for r in rows]
    a1.set_xlabel("tokens / s (batch 1, greedy, CPU)")
    a1.invert_yaxis()
    title = f"{data['meta']['model']} (+ {data['meta']['draft']})"
    tr = (data["meta"].get("eagle_head") or {}).get("training")
    if tr and "train_tokens" in tr:
        title += f"\nEAGLE head: {tr['train_tokens']} training tokens, {tr.get('train_seconds', 0) / 60:.0f} min training"
    a1.set_title(title, fontsize=9)
    colors = ["tab:green" if r.get("eagle_head") else c for r, c in zip(rows, colors)]
    a1.barh(labels, [r["tok_per_s"] for r in rows], color=colors)
    for r in rows:
        if r.get("per_position_acceptance"):
            a2.plot(range(1, len(r["per_position_acceptance"]) + 1), r["per_position_acceptance"], marker="o",
                    label=r["config"])
    a2.set_xlabel("draft position")
    a2.set_ylabel("acceptance rate")
    a2.set_ylim(0, 1)
    a2.legend(fontsize=7)
    a2.set_title("per-position acceptance")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


DRAFTERS = ("draft", "early-exit", "ngram", "eagle")


def _check_bench(args, ap) -> None:
    """Everything about the command line that can be judged before the models load (UsageError, one line): bad
    values, and flags for rows that will not run (they would be ignored)."""
    from .config import SpecConfig

    drafters = [d for d in args.drafters.split(",") if d]
    bad = [d for d in drafters if d not in DRAFTERS]
    if bad or len(set(drafters)) != len(drafters):
        raise UsageError(f"--drafters takes distinct names from {', '.join(DRAFTERS)}; got {args.drafters!r}")
    if not 1 <= args.num_prompts <= len(CODE_PROMPTS):
        raise UsageError(f"--num-prompts must be in [1, {len(CODE_PROMPTS)}] (the bench prompts), got {args.num_prompts}")
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.threads < 0:
        raise UsageError(f"--threads must be >= 0 (0 = torch's default), got {args.threads}")
    if args.early_exit_layers < 1:
        raise UsageError(f"--early-exit-layers must be >= 1, got {args.early_exit_layers}")
    if args.llamacpp_draft_max < 1:
        raise UsageError(f"--llamacpp-draft-max must be >= 1, got {args.llamacpp_draft_max}")
    for n in filter(None, args.draft_vocabs.split(",")):
        if not n.strip().isdigit() or int(n) < 1:
            raise UsageError(f"--draft-vocabs takes positive token counts, got {n!r}")
    try:
        for k in [k for k in args.ks.split(",") if k] + [k for k in args.eagle_ks.split(",") if k]:
            SpecConfig.from_flags("ngram", k, None, None)  # (validates k)
        if "eagle" in drafters:
            from .config import parse_eagle_tree_row

            for tree in filter(None, args.eagle_trees.split(";")):
                parse_eagle_tree_row(tree)
    except ValueError as e:
        raise UsageError(str(e).replace("--k ", "--ks / --eagle-ks: ")) from None
    unused = {"--early-exit-layers": ("early_exit_layers", "early-exit" in drafters),
              # (the draft model also drafts llama.cpp's speculative and transformers' assisted rows)
              "--draft": ("draft", "draft" in drafters or args.llamacpp or not args.no_transformers),
              "--ks": ("ks", any(d != "eagle" for d in drafters)),
              "--eagle-head": ("eagle_head", "eagle" in drafters), "--eagle-ks": ("eagle_ks", "eagle" in drafters),
              "--eagle-trees": ("eagle_trees", "eagle" in drafters),
              "--eagle-budget": ("eagle_budget", "eagle" in drafters),
              "--eagle-head-quantize": ("eagle_head_quantize", "eagle" in drafters),
              "--llamacpp-draft-max": ("llamacpp_draft_max", args.llamacpp),
              "--draft-vocabs": ("draft_vocabs", "draft" in drafters)}
    ignored = [flag for flag, (dest, used) in unused.items() if not used and getattr(args, dest) != ap.get_default(dest)]
    if ignored:
        raise UsageError(f"{', '.join(ignored)} do(es) nothing in this run: its rows are not requested "
                         f"(--drafters {args.drafters}{'' if args.llamacpp else ', no --llamacpp'})")
    if "eagle" in drafters and not (Path(args.eagle_head).expanduser() / "config.json").exists():
        raise UsageError(f"--drafters eagle: no EAGLE head in {args.eagle_head} (train one with forerun train-eagle, "
                         "or point --eagle-head at a head's folder)")


def main(argv=None) -> int:
    ap = ArgumentParser(prog="forerun bench", description=__doc__)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--drafters", default="draft,early-exit,ngram",
                    help="comma list of draft, early-exit, ngram, eagle (eagle: rows with the head in --eagle-head)")
    ap.add_argument("--early-exit-layers", type=int, default=8)
    ap.add_argument("--draft-vocabs", default="",
                    help="also draft-model rows whose draft ranks only the first N token ids (comma list of N)")
    ap.add_argument("--ks", default="2,4,6,auto")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                    help="forerun weights: auto = GGUF kept quantized (int4; int8 without gcc / AVX2); none = widened to fp32")
    ap.add_argument("--llamacpp", action="store_true", help="add llama.cpp plain and speculative peer rows")
    ap.add_argument("--llamacpp-draft-max", type=int, default=4, help="llama-speculative --spec-draft-n-max")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="forerun rows with enable_prefix_caching (without this flag the bench's rows run with it off, "
                         "the engine's default being on, so that they compare with llama.cpp's tools as they run by "
                         "default), and (with --llamacpp) a llama.cpp plain row with its --prompt-cache; both caches "
                         "hold the chat template's system prefix before the first prompt")
    ap.add_argument("--eagle-head", default=DEFAULT_EAGLE_HEAD,
                    help="EAGLE head folder for the eagle rows (forerun train-eagle output or a published head)")
    ap.add_argument("--eagle-ks", default="4,auto", help="EAGLE chain rows: comma list of k (or auto)")
    ap.add_argument("--eagle-trees", default="2,4,10@0.1",
                    help="EAGLE dynamic-tree rows: ';'-separated TOPK,STEPS,NODES shapes ('' for none); "
                         "TOPK,STEPS,NODES@C verifies only nodes of cumulative draft probability >= C (--confidence)")
    ap.add_argument("--eagle-budget", action="store_true",
                    help="also an EAGLE tree row per shape with the per-round budget (forerun/drafters/eagle_budget.py)")
    ap.add_argument("--eagle-head-quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                    help="the EAGLE head's linears (auto: the target's layout when it is quantized; none: fp32)")
    ap.add_argument("--out", default="benchmarks/results/cpu_pair.json")
    args = ap.parse_args(argv)
    _check_bench(args, ap)
    os.environ["FORERUN_EAGLE_QUANTIZE"] = args.eagle_head_quantize  # read by EagleDrafter
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = list(CODE_PROMPTS[: args.num_prompts])
    if args.llamacpp:
        llamacpp_bin_dir()  # fail before the long forerun part
    rows, info = run_forerun(args, prompts)
    if args.llamacpp:
        cache_file = None
        if args.prefix_caching:
            import tempfile

            cache_file = os.path.join(tempfile.mkdtemp(prefix="forerun_llamacpp_"), "prompt_cache.bin")
        rows += run_llamacpp(args, prompts, info["plain_text"], prompt_cache=cache_file)
        _save(args, rows)
    if not args.no_transformers:
        rows += run_transformers(args, prompts, info["plain_ids"])
    _save(args, rows)
    plot(Path(args.out), Path(args.out).with_suffix(".png"))
    print(f"\n{'config':28s} {'tok/s':>8s} {'speedup':>8s} {'vs l.cpp':>8s} {'accept':>7s} {'acc.len':>8s} "
          f"{'tok/round':>9s} {'identical':>9s}")
    for r in rows:
        print(f"{r['config']:28s} {r['tok_per_s']:8.2f} {r.get('speedup_vs_plain', 0):8.2f} "
              f"{r.get('ratio_vs_llamacpp_plain', 0):8.2f} {r.get('acceptance_rate', 0):7.3f} "
              f"{r.get('mean_accepted_length', 0):8.2f} {r.get('tokens_per_target_call', 0):9.2f} "
              f"{str(r.get('identical_to_plain')):>9s}")
    tr = (json.loads(Path(args.out).read_text())["meta"].get("eagle_head") or {}).get("training")
    if tr:
        print(f"EAGLE head: {json.dumps(tr)}")
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")
    return 0
