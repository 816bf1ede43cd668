"""forerun generate | models pull/list | bench."""
from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def _print_stats(label: str, outputs, seconds: float, file=sys.stderr) -> dict:
    from .stats import aggregate

    agg = aggregate([o.stats for o in outputs])
    toks = sum(len(o.token_ids) for o in outputs)
    d = {"run": label, "tokens": toks, "seconds": round(seconds, 3), "tok_per_s": round(toks / seconds, 2), **agg.as_dict()}
    print(json.dumps(d), file=file)
    return d


def cmd_generate(a) -> int:
    import torch

    from .config import SpecConfig
    from .engine.llm import LLM
    from .sampling_params import SamplingParams

    if a.threads:
        torch.set_num_threads(a.threads)
    spec = SpecConfig.from_flags(a.draft, a.k, a.confidence, a.rule, tree=a.tree)
    params = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=a.seed,
                            max_tokens=a.max_tokens, stop=tuple(a.stop or ()), ignore_eos=a.ignore_eos)
    t = time.perf_counter()
    llm = LLM(a.model, spec=spec, device=a.device)
    print(f"[forerun] loaded {a.model} (+ {spec.method}) in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    chat = not a.raw
    if a.compare_plain and spec.enabled:
        plain = LLM.from_model(llm.model, llm.tokenizer, device=a.device)
        llm.generate(a.prompt[:1], SamplingParams(max_tokens=2, temperature=0), chat=chat)  # warm-up
        t = time.perf_counter()
        base = plain.generate(a.prompt, params, chat=chat)
        base_s = time.perf_counter() - t
    t = time.perf_counter()
    outs = llm.generate(a.prompt, params, chat=chat, progress=a.progress)
    spec_s = time.perf_counter() - t
    for o in outs:
        print(o.text)
        print("-" * 40, file=sys.stderr)
    if a.stats:
        s = _print_stats(f"speculative ({spec.method}, k={a.k})" if spec.enabled else "plain", outs, spec_s)
        if a.compare_plain and spec.enabled:
            b = _print_stats("plain", base, base_s)
            same = all(x.token_ids == y.token_ids for x, y in zip(outs, base))
            print(json.dumps({"speedup": round(s["tok_per_s"] / b["tok_per_s"], 3),
                              "identical_to_plain": same if params.temperature == 0 else "n/a (sampling)"}), file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser (forerun.bench)
        from .bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:2] == ["models", "pull"]:
        from .models import hub

        return hub.main_pull(argv[2:])
    p = argparse.ArgumentParser(prog="forerun", description="speculative-decoding inference engine")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompt", nargs="+")
    g.add_argument("--model", default=DEFAULT_MODEL, help="model name (see `forerun models list`), .gguf file or HF dir")
    g.add_argument("--draft", default=DEFAULT_DRAFT, help="MODEL | early-exit:N | ngram | none")
    g.add_argument("--k", default="auto", help="drafts per round, or 'auto' (adaptive)")
    g.add_argument("--rule", default="auto", choices=["auto", "greedy", "rejection", "penalty", "typical"])
    g.add_argument("--tree", default=None, help="tree drafting with the draft model: children per depth, e.g. 2,2,1")
    g.add_argument("--confidence", type=float, default=0.0, help="stop a draft when its top probability is below this")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=96)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--stats", action="store_true", help="print speculation statistics as JSON on stderr")
    g.add_argument("--compare-plain", action="store_true", help="also run plain decoding and report the speedup")
    g.add_argument("--progress", action="store_true")
    g.add_argument("--device", default=None)
    g.add_argument("--threads", type=int, default=0)

    m = sub.add_parser("models", help="pull or list the known real models")
    msub = m.add_subparsers(dest="mcmd", required=True)
    mp = msub.add_parser("pull", help="download, verify and cache models (NAME... | all)")
    mp.add_argument("rest", nargs=argparse.REMAINDER)
    msub.add_parser("list")

    b = sub.add_parser("bench", help="CPU benchmark: plain vs speculative vs transformers assisted generation")
    b.add_argument("rest", nargs=argparse.REMAINDER)

    a = p.parse_args(argv)
    if a.cmd == "generate":
        return cmd_generate(a)
    if a.cmd == "models":
        from .models import hub

        return hub.main_pull(a.rest) if a.mcmd == "pull" else hub.main_list([])
    if a.cmd == "bench":
        from .bench import main as bench_main

        return bench_main(a.rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
