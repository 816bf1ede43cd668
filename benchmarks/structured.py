"""Constrained (JSON schema) vs unconstrained speculative decoding: per-token time, acceptance, validity.

For every speculation setting the same prompts run with a JSON schema, then without one but with each
request's max_tokens set to the length of its constrained output (ignore_eos), so that both runs generate
the same number of tokens per request over the same prompts (same prefills, same batch shapes as requests
finish). The cost of structured output is the per-token time ratio constrained / unconstrained (goal:
<= 1.10), in one process; constrained and unconstrained runs alternate `--repeat` times and each keeps its
best (the machine is shared). Grammar host time (mask filling, applying, draft cutting, commits) is measured
separately by timing forerun.structured's hooks.

    python benchmarks/structured.py [--model smollm2-135m-instruct] [--draft qwen2.5-coder-0.5b-instruct]
        [--prompts 8] [--max-tokens 96] [--repeat 2] [--out benchmarks/results/structured_cpu.json]

Prints a table, writes the JSON and a PNG plot next to it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

import forerun.structured as structured  # noqa: E402
from forerun.config import CacheConfig, SpecConfig  # noqa: E402
from forerun.engine.llm import LLM  # noqa: E402
from forerun.models.registry import load_model  # noqa: E402
from forerun.sampling_params import SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 32},
        "hobbies": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 24}, "maxItems": 4},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
    "additionalProperties": False,
}
TOPICS = ["a retired teacher", "a young programmer", "a fictional pirate", "a chess champion", "a baker in Paris",
          "an astronaut", "a marathon runner", "a jazz musician", "a botanist", "a detective", "a farmer",
          "a video game character"]


class GrammarTimer:
    """Accumulates the wall time spent in forerun.structured's engine hooks (wraps them in place)."""

    NAMES = ("draft_masks", "draft_mask", "draft_accept", "draft_end", "commit", "tree_masks")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._orig = {}

    def __enter__(self):
        cls = structured.GrammarState
        for n in self.NAMES:
            f = getattr(cls, n)
            self._orig[n] = f

            def wrapped(*a, _f=f, **k):
                t = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    self.seconds += time.perf_counter() - t
            setattr(cls, n, wrapped)
        f = structured.apply_bitmask_
        self._orig["apply"] = f

        def apply(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t
        structured.apply_bitmask_ = apply
        return self

    def __exit__(self, *exc):
        for n in self.NAMES:
            setattr(structured.GrammarState, n, self._orig[n])
        structured.apply_bitmask_ = self._orig["apply"]


def timed(llm: LLM, prompts: list[str], sp) -> dict:
    with GrammarTimer() as gt:
        t, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, sp, chat=True)
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    tokens = sum(len(o.token_ids) for o in outs)
    st = LLM.aggregate_stats(outs)
    return dict(wall_s=round(wall, 3), tokens=tokens, ms_per_token=round(1e3 * wall / tokens, 3),
                cpu_ms_per_token=round(1e3 * cpu / tokens, 3),  # process CPU time: less exposed to other load
                grammar_s=round(gt.seconds, 3), acceptance=round(st.acceptance_rate, 4),
                mean_accepted=round(st.mean_accepted_length, 3), tokens_per_call=round(st.tokens_per_target_call, 3),
                outs=outs)


def valid(outs) -> str:
    import jsonschema

    ok = 0
    for o in outs:
        try:
            jsonschema.validate(json.loads(o.text), SCHEMA)
            ok += 1
        except Exception:  # noqa: BLE001 - count invalid outputs, whatever the failure
            pass
    return f"{ok}/{len(outs)}"


def run_pair(llm: LLM, prompts: list[str], constrained: SamplingParams, repeat: int) -> tuple[dict, dict]:
    """(constrained, unconstrained-with-matched-lengths), alternating, best of `repeat` each."""
    best_c = best_u = None
    for _ in range(repeat):
        c = timed(llm, prompts, constrained)
        lengths = [len(o.token_ids) for o in c["outs"]]
        free = [SamplingParams(temperature=constrained.temperature, max_tokens=n, seed=constrained.seed, ignore_eos=True)
                for n in lengths]
        u = timed(llm, prompts, free)
        assert [len(o.token_ids) for o in u["outs"]] == lengths
        c["valid_json"] = valid(c["outs"])
        best_c = c if best_c is None or c["ms_per_token"] < best_c["ms_per_token"] else best_c
        best_u = u if best_u is None or u["ms_per_token"] < best_u["ms_per_token"] else best_u
    best_c.pop("outs"), best_u.pop("outs")
    return best_c, best_u


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=None, help="a draft model sharing the tokenizer (adds a 'draft' row)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--early-exit", action="store_true", help="add an early-exit row (a third of the layers)")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "structured_cpu.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok, _ = load_model(args.model)
    settings = {"plain": None, "ngram k=4": SpecConfig(method="ngram", k=4)}
    if args.early_exit:
        settings["early-exit k=3"] = SpecConfig(method="early-exit", early_exit_layers=model.config.num_layers // 3, k=3)
    if args.draft:
        dmodel, dtok, _ = load_model(args.draft)
        settings["draft k=4"] = SpecConfig(method="draft", draft_model=(dmodel, dtok), k=4)
    prompts = [f"Describe {TOPICS[i % len(TOPICS)]} as a JSON object with name, age, city, hobbies and employed."
               for i in range(args.prompts)]
    so = structured.StructuredOutput(json_schema=SCHEMA)
    constrained = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=1, structured_output=so)
    rows = []
    for name, spec in settings.items():
        cache = CacheConfig(num_blocks=64 * args.prompts)  # 1024 tokens per request, not the 2 GiB default
        llm = LLM.from_model(model, tok, device="cpu", spec=spec, cache=cache,
                             enable_prefix_caching=False) if spec else \
            LLM.from_model(model, tok, device="cpu", cache=cache, enable_prefix_caching=False)
        llm.generate(prompts[:2], constrained, chat=True)  # warm up (grammar compile, oneDNN)
        c, u = run_pair(llm, prompts, constrained, args.repeat)
        rows.append(dict(setting=name, unconstrained=u, constrained=c,
                         overhead=round(c["ms_per_token"] / u["ms_per_token"], 4),
                         cpu_overhead=round(c["cpu_ms_per_token"] / u["cpu_ms_per_token"], 4),
                         grammar_ms_per_token=round(1e3 * c["grammar_s"] / c["tokens"], 4)))
    plain_c = rows[0]["constrained"]["ms_per_token"]
    print(f"{'setting':<16} {'free ms/tok':>11} {'json ms/tok':>11} {'json/free':>9} {'cpu json/free':>13} "
          f"{'grammar ms/tok':>14} "
          f"{'accept free':>11} {'accept json':>11} {'speedup json':>12} {'valid':>6}")
    for r in rows:
        u, c = r["unconstrained"], r["constrained"]
        print(f"{r['setting']:<16} {u['ms_per_token']:>11.2f} {c['ms_per_token']:>11.2f} {r['overhead']:>9.3f} "
              f"{r['cpu_overhead']:>13.3f} "
              f"{r['grammar_ms_per_token']:>14.3f} {u['acceptance']:>11.3f} {c['acceptance']:>11.3f} "
              f"{plain_c / c['ms_per_token']:>12.2f} {c['valid_json']:>6}")
    meta = dict(model=args.model, draft=args.draft, prompts=args.prompts, max_tokens=args.max_tokens,
                temperature=args.temperature, repeat=args.repeat, device="cpu", threads=torch.get_num_threads(),
                date=time.strftime("%Y-%m-%d %H:%M"), schema=SCHEMA)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    json.dump(dict(meta=meta, rows=rows), open(args.out, "w"), indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["unconstrained"]["ms_per_token"] for r in rows], 0.4, label="unconstrained")
        ax.bar([i + 0.2 for i in x], [r["constrained"]["ms_per_token"] for r in rows], 0.4, label="JSON schema")
        ax.set_xticks(list(x), [r["setting"] for r in rows])
        ax.set_ylabel("ms per token")
        ax.set_title(f"{args.model}, CPU, {args.prompts} prompts, T={args.temperature}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out.replace(".json", ".png"), dpi=100)
    except ImportError:
        print("matplotlib not installed: no plot")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
