"""forerun generate | models pull/list/verify | bench | serve.

Every error is one line on stderr, "forerun: error: ...": exit code 2 for a usage error (a bad flag value,
a flag that would do nothing in the chosen mode, an unknown model, a draft that does not fit the target),
found before any weights load; exit code 1 for a failure while running. `--debug` shows the traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .config import CONFIDENCE_HELP, VERIFY_RULES
from .usage import ArgumentParser, UsageError  # noqa: F401 - UsageError is part of this module's interface

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return " | ".join(lines) if lines else ""


def _fail(message: str, code: int) -> int:
    print(f"forerun: error: {_one_line(message)}", file=sys.stderr)
    return code


# SamplingParams / SpecConfig field -> the flag that sets it, so a refused value names the flag
_FLAG_OF = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
            "min_p": "--min-p", "seed": "--seed", "stop": "--stop", "confidence_threshold": "--confidence",
            "rule": "--rule", "tree": "--tree"}


def _flagged(msg: str) -> str:
    for field, flag in _FLAG_OF.items():
        if msg.startswith(field + " ") or msg.startswith(f"{field}:"):
            return flag + msg[len(field):]
    return msg


def _print_stats(label: str, outputs, seconds: float, file=None) -> dict:
    from .stats import aggregate

    agg = aggregate([o.stats for o in outputs])
    toks = sum(len(o.token_ids) for o in outputs)
    d = {"run": label, "tokens": toks, "seconds": round(seconds, 3), "tok_per_s": round(toks / seconds, 2), **agg.as_dict()}
    print(json.dumps(d), file=file or sys.stderr)  # (looked up now: a captured stderr is honoured)
    return d


def spec_label(spec) -> str:
    """How the stats line names the speculation: the tree's shape for a tree, k (or adaptive) for a chain."""
    from .config import tree_label

    if not spec.enabled:
        return "plain"
    if spec.tree is not None:
        return f"speculative ({spec.method}, {tree_label(spec.tree)})"
    if spec.eagle_tree is not None:  # (its k is not used: the tree's shape and confidence cut set the drafts)
        cut = f", confidence {spec.confidence_threshold:g}" if spec.confidence_threshold > 0 else ""
        return f"speculative (eagle, tree {','.join(map(str, spec.eagle_tree))}{cut})"
    k = f"k=auto (adaptive, k_max {spec.k_max})" if spec.adaptive else f"k={spec.k}"
    return f"speculative ({spec.method}, {k})"


def _check_generate(a):
    """Everything about the command line that can be judged without loading weights -> (spec, params).
    Raises UsageError (one line) for anything wrong."""
    from .config import SpecConfig
    from .models import hub
    from .sampling_params import SamplingParams

    try:
        params = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=a.seed,
                                max_tokens=a.max_tokens, stop=tuple(a.stop or ()), ignore_eos=a.ignore_eos)
    except ValueError as e:
        raise UsageError(_flagged(str(e))) from None
    if params.temperature == 0:  # greedy: the sampling flags would be ignored
        given = [f for f, v, off in (("--top-k", a.top_k, 0), ("--top-p", a.top_p, 1.0), ("--min-p", a.min_p, 0.0),
                                     ("--seed", a.seed, None)) if v != off]
        if given:
            raise UsageError(f"{', '.join(given)} do(es) nothing at --temperature 0 (greedy decoding); "
                             "pass --temperature T > 0 to sample")
    if a.threads < 0:
        raise UsageError(f"--threads must be >= 0 (0 = torch's default), got {a.threads}")
    if any(not p for p in a.prompt):
        raise UsageError("a prompt is empty")
    from .devices import device_problem

    problem = device_problem(a.device)
    if problem:
        raise UsageError(problem)
    # the model: a known name, or a path that exists (nothing is downloaded or loaded for a bad one)
    problem = hub.model_problem(a.model)
    if problem:
        raise UsageError(problem)
    draft = a.draft
    if draft is None:
        from .models.compat import default_draft_for

        draft = default_draft_for(a.model)
        if draft == "ngram" and a.tree is not None:
            raise UsageError("--tree needs a draft model, and this model has no known compatible draft: "
                             "pass --draft MODEL")
        a.draft_note = f"default for {a.model}"
    if draft == "none" and a.k is not None:
        raise UsageError("--k does nothing with --draft none (no speculation)")
    if a.compare_plain and draft == "none":
        raise UsageError("--compare-plain does nothing with --draft none (both runs would be plain)")
    try:
        spec = SpecConfig.from_flags(draft, a.k, a.confidence, a.rule, tree=a.tree, draft_vocab=a.draft_vocab)
        spec.check_sampling(params)
    except ValueError as e:
        raise UsageError(_flagged(str(e))) from None
    if spec.method == "draft":
        problem = hub.model_problem(draft, "draft model", "early-exit:N, ngram, eagle:DIR, none")
        if problem:
            raise UsageError(problem)
        _check_pair(a.model, draft)
    if spec.method == "eagle":
        head = os.path.expanduser(spec.eagle_head)
        if not os.path.isdir(head):
            raise UsageError(f"--draft eagle:DIR: no such folder {spec.eagle_head!r} (train one with forerun train-eagle)")
        if not os.path.isfile(os.path.join(head, "config.json")):
            raise UsageError(f"--draft eagle:DIR: {spec.eagle_head!r} is not an EAGLE head folder (no config.json; "
                             "train one with forerun train-eagle)")
    if a.compare_plain and not spec.enabled:
        raise UsageError("--compare-plain does nothing with --k 0 (both runs would be plain)")
    return spec, params


def _check_pair(model: str, draft: str) -> None:
    """Refuse a draft whose tokenizer/vocabulary differ from the target's before either loads. Both GGUF:
    their headers' token lists are compared (< 1 s); otherwise the target's tokenizer is built (no weights)."""
    from .models.compat import check_draft_compatible, read_gguf_vocab
    from .models.hub import resolve_model

    try:
        tpath = resolve_model(model)
        tokens = rows = None
        if tpath.is_file():
            try:
                tokens, rows = read_gguf_vocab(tpath)
            except ValueError:
                tokens = None
        if tokens is not None and rows is not None:
            check_draft_compatible(_TokenList(tokens), rows, draft)
        else:
            from .models.loader import load_checkpoint

            ck = load_checkpoint(tpath)
            check_draft_compatible(ck.tokenizer(), ck.config.vocab_size, draft)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None


class _TokenList:
    """A GGUF header's token list seen through the one method check_draft_compatible uses."""

    def __init__(self, tokens: list[str]):
        self._vocab = {t: i for i, t in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def cmd_generate(a) -> int:
    spec, params = _check_generate(a)
    import torch

    from .engine.llm import LLM

    if a.threads:
        torch.set_num_threads(a.threads)
    t = time.perf_counter()
    llm = LLM(a.model, spec=spec, device=a.device, quantize=a.quantize, enable_prefix_caching=a.enable_prefix_caching)
    note = f" [{a.draft_note}]" if getattr(a, "draft_note", None) and spec.method != "none" else ""
    what = spec.draft_model if spec.method == "draft" else spec.method
    print(f"[forerun] loaded {a.model} (+ {what}{note}) in {time.perf_counter() - t:.1f}s; {llm.engine.pool_description}",
          file=sys.stderr)
    chat = not a.raw
    if a.compare_plain and spec.enabled:
        plain = LLM.from_model(llm.model, llm.tokenizer, device=a.device, enable_prefix_caching=a.enable_prefix_caching)
        (base, base_s), (outs, spec_s) = compare_with_plain(llm, plain, a.prompt, params, chat, a.progress)
    else:
        t = time.perf_counter()
        outs = llm.generate(a.prompt, params, chat=chat, progress=a.progress)
        spec_s = time.perf_counter() - t
    for o in outs:
        print(o.text)
        print("-" * 40, file=sys.stderr)
    if a.stats or a.compare_plain:  # (--compare-plain prints its comparison with or without --stats)
        s = _print_stats(spec_label(spec), outs, spec_s)
        if a.compare_plain and spec.enabled:
            b = _print_stats("plain", base, base_s)
            same = all(x.token_ids == y.token_ids for x, y in zip(outs, base))
            print(json.dumps({"speedup": round(s["tok_per_s"] / b["tok_per_s"], 3),
                              "identical_to_plain": same if params.temperature == 0 else "n/a (sampling)"}), file=sys.stderr)
    return 0


def compare_with_plain(llm, plain, prompts, params, chat: bool, progress: bool = False):
    """--compare-plain: ((plain outputs, seconds), (speculative outputs, seconds)) for the same prompts. The
    speculative engine is warmed up first (one short request), then its prefix cache emptied, so that both timed
    runs read the prompts alike."""
    llm.generate(prompts[:1], type(params)(max_tokens=2, temperature=0), chat=chat)  # warm-up
    llm.reset_prefix_cache()
    runs = []
    for engine, bar in ((plain, False), (llm, progress)):
        t = time.perf_counter()
        runs.append((engine.generate(prompts, params, chat=chat, progress=bar), time.perf_counter() - t))
    return runs[0], runs[1]


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="forerun", description="speculative-decoding inference engine")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=ArgumentParser)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompt", nargs="+")
    g.add_argument("--model", default=DEFAULT_MODEL, help="model name (see `forerun models list`), .gguf file or HF dir")
    g.add_argument("--draft", default=None,
                   help="MODEL | early-exit:N | ngram | none (default: a draft known to fit --model, else ngram)")
    g.add_argument("--k", default=None, help="drafts per round, or 'auto' (adaptive; the default)")
    g.add_argument("--rule", default=None, choices=list(VERIFY_RULES),
                   help="verification rule (default auto: greedy at temperature 0, exact sampling otherwise)")
    g.add_argument("--tree", default=None, help="tree drafting with the draft model: children per depth, e.g. 2,2,1")
    g.add_argument("--confidence", type=float, default=None, help=CONFIDENCE_HELP)
    g.add_argument("--draft-vocab", type=int, default=None,
                   help="the draft model ranks only the first N token ids and the special tokens (a faster draft head)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=96)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="later prompts reuse the keys and values of earlier ones' equal prefixes (e.g. a system "
                        "prompt); on by default")
    g.add_argument("--stats", action="store_true", help="print speculation statistics as JSON on stderr")
    g.add_argument("--compare-plain", action="store_true", help="also run plain decoding and report the speedup")
    g.add_argument("--progress", action="store_true")
    g.add_argument("--device", default=None)
    g.add_argument("--threads", type=int, default=0)
    g.add_argument("--quantize", default="auto", choices=["none", "int8", "int4", "auto"],
                   help="keep weights quantized (CPU int8: VNNI; int4: GGUF Q4 blocks exactly; CUDA: int4 / int8 weight-only "
                        "kernels (Triton, CUDA C++ on Hopper), bf16 activations); auto (default) = int4 for GGUF (CPU: "
                        "int8 without gcc or AVX2), safetensors as stored; none = GGUF dequantized to float")
    g.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show Python tracebacks on errors")

    m = sub.add_parser("models", help="pull, list or verify the known real models")
    msub = m.add_subparsers(dest="mcmd", required=True, parser_class=ArgumentParser)
    for name, text in (("pull", "download, verify and cache models (NAME... | all)"), ("list", "known models"),
                       ("verify", "rehash cached models in full (sha256)")):
        mp = msub.add_parser(name, help=text, add_help=False)
        mp.add_argument("rest", nargs=argparse.REMAINDER)

    for name, text in (("bench", "CPU benchmark: plain vs speculative vs transformers assisted generation"),
                       ("serve", "OpenAI-compatible HTTP server"),
                       ("train-eagle", "train an EAGLE draft head for a target model (offline corpus)")):
        b = sub.add_parser(name, help=text, add_help=False)
        b.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def _dispatch(argv: list[str]) -> int:
    # subcommands with their own parsers get their arguments untouched
    if argv[:1] == ["bench"]:
        from .bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["serve"]:
        try:
            from .server.cli import main as serve_main
        except ImportError as e:
            raise UsageError(f"forerun serve is not available: {e}") from None
        return serve_main(argv[1:])
    if argv[:1] == ["train-eagle"]:
        from .eagle.train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["models"] and argv[1:2] in (["pull"], ["list"], ["verify"]):
        from .models import hub

        fn = {"pull": hub.main_pull, "list": hub.main_list, "verify": hub.main_verify}[argv[1]]
        return fn(argv[2:])
    a = build_parser().parse_args(argv)
    if a.cmd == "generate":
        return cmd_generate(a)
    return 2  # pragma: no cover - argparse requires a known subcommand


def main(argv=None) -> int:
    """Entry point of the `forerun` command; returns the exit code (0 ok, 1 failed, 2 usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if debug:
        argv = [x for x in argv if x != "--debug"]
    try:
        return _dispatch(argv)
    except UsageError as e:
        if debug:
            raise
        return _fail(str(e), 2)
    except SystemExit as e:  # --help (0), or a sub-parser's own usage error (already printed)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else _fail(str(e.code), 2))
        return code
    except KeyboardInterrupt:
        print("forerun: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place every failure becomes one line
        if debug:
            raise
        from .models.hub import UnknownModelError

        if isinstance(e, UnknownModelError):
            return _fail(str(e), 2)
        return _fail(f"{type(e).__name__}: {e} (run with --debug for the traceback)", 1)


if __name__ == "__main__":
    sys.exit(main())
