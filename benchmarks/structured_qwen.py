"""Structured output with speculation on the real Qwen2.5-Coder-1.5B target + 0.5B draft (issue 14's check).

50 prompts, each with its own JSON schema (benchmarks/structured_tasks.py), every drafter (plain, draft model,
n-gram, early exit; EAGLE with --eagle-head), greedy and temperature 0.8. Per (temperature, drafter):

  1. constrained: the 50 requests with their schemas; every output is parsed (json.loads) and validated against
     its own schema (jsonschema): the validity count covers ALL outputs, including any that hit max_tokens
     (those are counted invalid and listed, never filtered out);
  2. unconstrained at matched lengths: the same prompts without a schema, each request's max_tokens set to its
     constrained output's length (ignore_eos), so both runs generate the same number of tokens per request
     from the same prefills: per-token time constrained / unconstrained is the cost of structured output
     (goal <= 1.10) for that drafter.

Speedup: constrained plain ms/token over constrained spec ms/token at the same temperature. At temperature 0
the constrained spec outputs are also compared token for token with constrained plain greedy. Acceptance and
`grammar_rejected` (draft tokens the grammar cut, forerun/stats.py) come from the requests' stats; grammar host
time from timing forerun.structured's hooks (benchmarks/structured.py's GrammarTimer).

    flock /tmp/forerun-heavy.lock nice -n 5 .venv/bin/python benchmarks/structured_qwen.py \
        [--prompts 50] [--max-tokens 128] [--batch 8] [--drafters draft,ngram,early-exit] [--eagle-head DIR]

Prints progress and a table; writes benchmarks/results/structured_qwen_cpu.json and .png.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from forerun.config import CacheConfig, SpecConfig  # noqa: E402
from forerun.engine.llm import LLM  # noqa: E402
from forerun.models.registry import load_model  # noqa: E402
from forerun.sampling_params import SamplingParams  # noqa: E402
from forerun.structured import StructuredOutput  # noqa: E402
from structured import GrammarTimer  # noqa: E402  (benchmarks/structured.py)
from structured_tasks import TASKS  # noqa: E402

SYSTEM = "Answer with a single JSON object that follows the requested format. Be concise."


def check(text: str, schema: dict) -> str | None:
    """None if text parses and validates against schema, else the reason (one line)."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return f"schema: {e.message[:120]}"
    return None


def chat_ids(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                                  add_generation_prompt=True, tokenize=True)
    return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def timed(llm: LLM, prompts: list, params: list[SamplingParams], desc: str) -> dict:
    with GrammarTimer() as gt:
        t, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, chat=False, progress=True)
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    tokens = sum(len(o.token_ids) for o in outs)
    st = LLM.aggregate_stats(outs)
    r = dict(wall_s=round(wall, 3), tokens=tokens, ms_per_token=round(1e3 * wall / tokens, 3),
             cpu_ms_per_token=round(1e3 * cpu / tokens, 3), grammar_ms_per_token=round(1e3 * gt.seconds / tokens, 4),
             stats=st.as_dict(), outs=outs)
    tqdm.write(f"  {desc}: {tokens} tokens in {wall:.1f} s = {r['ms_per_token']:.1f} ms/token, "
               f"acceptance {st.acceptance_rate:.3f}, grammar_rejected {st.grammar_rejected}")
    return r


def settings(args, model, dmodel, dtok) -> dict:
    out = {"plain": None}
    for d in args.drafters:
        if d == "draft":
            out[f"draft k={args.k}"] = SpecConfig(method="draft", draft_model=(dmodel, dtok), k=args.k)
        elif d == "ngram":
            out[f"ngram k={args.k}"] = SpecConfig(method="ngram", k=args.k)
        elif d == "tree":  # the draft model drafting a fixed tree
            out["draft tree 2,2,1"] = SpecConfig(method="draft", draft_model=(dmodel, dtok), tree=(2, 2, 1))
        elif d == "eagle-tree":  # an EAGLE head's dynamic tree (needs --eagle-head)
            if not args.eagle_head:
                raise SystemExit("drafter 'eagle-tree' needs --eagle-head")
            out["eagle tree 4,4,16"] = SpecConfig(method="eagle", eagle_head=args.eagle_head, eagle_tree=(4, 4, 16))
        elif d == "early-exit":
            out[f"early-exit L{args.early_exit_layers} k={args.ee_k}"] = SpecConfig(
                method="early-exit", early_exit_layers=args.early_exit_layers, k=args.ee_k)
        else:
            raise SystemExit(f"unknown drafter {d!r}")
    if args.eagle_head:
        out[f"eagle k={args.k}"] = SpecConfig(method="eagle", eagle_head=args.eagle_head, k=args.k)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--quantize", default="int8")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="max_num_seqs: requests decoded together")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--drafters", default="draft,ngram,early-exit")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--early-exit-layers", type=int, default=8)
    ap.add_argument("--ee-k", type=int, default=2)
    ap.add_argument("--eagle-head", default=None, help="an EAGLE head's folder (adds an 'eagle' row)")
    ap.add_argument("--no-free", action="store_true", help="skip the unconstrained matched-length runs")
    ap.add_argument("--free-plain", action="store_true", help="also run plain decoding unconstrained (its overhead)")
    ap.add_argument("--no-free-early-exit", action="store_true",
                    help="no unconstrained run for early exit (its drafts are nearly never accepted on this pair)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "structured_qwen_cpu.json"))
    ap.add_argument("--repeat", type=int, default=1,
                    help="constrained / unconstrained pairs per drafter row, alternating; each keeps its best ms/token")
    ap.add_argument("--no-plain", action="store_true", help="skip plain decoding (no speedup column)")
    ap.add_argument("--append-to", default=None,
                    help="also add this run's rows to that results JSON under 'overhead_reruns'")
    ap.add_argument("--replot", action="store_true", help="print the table and plot from --out's JSON (a run cut short)")
    args = ap.parse_args()
    if args.replot:
        d = json.load(open(args.out))
        for key in ("prompts", "batch", "quantize"):
            setattr(args, key, d["meta"][key])
        table(sorted(d["rows"], key=lambda r: r["temperature"]))
        plot(args, d["rows"], d["meta"]["temperatures"])
        return
    args.drafters = [d for d in args.drafters.split(",") if d]
    temps = [float(t) for t in args.temperatures.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t_load = time.perf_counter()
    model, tok, _ = load_model(args.target, quantize=args.quantize)
    dmodel, dtok = (load_model(args.draft, quantize=args.quantize)[:2]) if {"draft", "tree"} & set(args.drafters) else (None, None)
    print(f"loaded in {time.perf_counter() - t_load:.0f} s; threads {torch.get_num_threads()}")
    tasks = TASKS[: args.prompts]
    prompts = [chat_ids(tok, p) for p, _ in tasks]  # token ids: the chat template with our system message
    specs = [StructuredOutput(json_schema=s) for _, s in tasks]
    plan = settings(args, model, dmodel, dtok)
    if args.no_plain:
        plan.pop("plain")
    blocks = args.batch * ((400 + args.max_tokens + 16) // 16 + 2) + 16  # prompt (~100-200) + output + drafts
    rows, started = [], time.time()
    bar = tqdm(total=len(temps) * len(plan), desc="runs", unit="run", position=1)
    plain: dict[float, tuple] = {}  # temperature -> constrained plain (ms/token, cpu ms/token, token ids)
    for name, spec in plan.items():  # plain first: every drafter's row compares with it; then drafter by drafter,
        for T in temps:              # so that a run cut short still has whole drafters
            bar.set_postfix_str(f"T={T} {name}")
            kw = dict(device="cpu", cache=CacheConfig(num_blocks=blocks), max_num_seqs=args.batch)
            if spec is not None and spec.method == "draft":
                kw["draft_cache"] = CacheConfig(num_blocks=blocks)
            llm = LLM.from_model(model, tok, spec=spec, **kw, enable_prefix_caching=False)
            warm = [SamplingParams(temperature=T, max_tokens=16, seed=0, structured_output=specs[i]) for i in range(2)]
            llm.generate(prompts[:2], warm, chat=False)  # grammar compile, oneDNN kernels, drafter warm-up
            con = [SamplingParams(temperature=T, max_tokens=args.max_tokens, seed=args.seed + i, structured_output=so)
                   for i, so in enumerate(specs)]
            c = timed(llm, prompts, con, f"T={T} {name} JSON")
            results = []
            for o, (_, schema) in zip(c["outs"], tasks):
                err = check(o.text, schema)
                results.append(dict(valid=err is None, error=err, finish=o.finish_reason, tokens=len(o.token_ids),
                                    grammar_rejected=o.stats.grammar_rejected, text=o.text))
            ids = [list(o.token_ids) for o in c["outs"]]
            row = dict(setting=name, temperature=T, method=spec.method if spec else "none",
                       valid=sum(r["valid"] for r in results), n=len(results),
                       finished_by_length=sum(r["finish"] == "length" for r in results),
                       constrained={k: v for k, v in c.items() if k != "outs"}, outputs=results)
            if spec is None:
                plain[T] = (c["ms_per_token"], c["cpu_ms_per_token"], ids)
            elif T in plain:
                plain_ms, plain_cpu, plain_ids = plain[T]
                row["speedup_vs_plain"] = round(plain_ms / c["ms_per_token"], 4)
                row["cpu_speedup_vs_plain"] = round(plain_cpu / c["cpu_ms_per_token"], 4)
                if T == 0:
                    row["identical_to_plain"] = sum(a == b for a, b in zip(ids, plain_ids))
            if not args.no_free and (spec is not None or args.free_plain) and \
                    not (args.no_free_early_exit and spec is not None and spec.method == "early-exit"):
                lengths = [len(x) for x in ids]
                free = [SamplingParams(temperature=T, max_tokens=n, seed=args.seed + i, ignore_eos=True)
                        for i, n in enumerate(lengths)]
                u = timed(llm, prompts, free, f"T={T} {name} free")
                got = [len(o.token_ids) for o in u["outs"]]
                assert got == lengths, "matched lengths"
                times = dict(constrained=[c["ms_per_token"]], unconstrained=[u["ms_per_token"]],
                             constrained_cpu=[c["cpu_ms_per_token"]], unconstrained_cpu=[u["cpu_ms_per_token"]])
                for rep in range(1, args.repeat):  # alternate; the outputs are the same (greedy / seeded)
                    c2 = timed(llm, prompts, con, f"T={T} {name} JSON (repeat {rep})")
                    assert [list(o.token_ids) for o in c2["outs"]] == ids, "seeded constrained rerun differs"
                    u2 = timed(llm, prompts, free, f"T={T} {name} free (repeat {rep})")
                    for k, r_ in (("constrained", c2), ("unconstrained", u2)):
                        times[k].append(r_["ms_per_token"])
                        times[k + "_cpu"].append(r_["cpu_ms_per_token"])
                    c = min(c, c2, key=lambda r_: r_["ms_per_token"])
                    u = min(u, u2, key=lambda r_: r_["ms_per_token"])
                if args.repeat > 1:
                    row["constrained"] = {k: v for k, v in c.items() if k != "outs"}
                    row["all_ms_per_token"] = times
                row["unconstrained"] = {k: v for k, v in u.items() if k != "outs"}
                row["overhead"] = round(c["ms_per_token"] / u["ms_per_token"], 4)
                row["cpu_overhead"] = round(c["cpu_ms_per_token"] / u["cpu_ms_per_token"], 4)
            rows.append(row)
            bad = [f"#{i}: {r['finish']}, {r['error']}: {r['text'][:80]!r}" for i, r in enumerate(results) if not r["valid"]]
            tqdm.write(f"  valid {row['valid']}/{row['n']}" + ("".join("\n    " + b for b in bad) if bad else ""))
            del llm
            gc.collect()
            bar.update(1)
            save(args, rows, started, temps)
    bar.close()
    table(sorted(rows, key=lambda r: r["temperature"]))
    save(args, rows, started, temps, plot=not args.append_to)
    if args.append_to:
        d = json.load(open(args.append_to))
        d.setdefault("overhead_reruns", []).append(dict(meta=dict(batch=args.batch, repeat=args.repeat, threads=torch.get_num_threads(),
                                                                  started=time.strftime("%Y-%m-%d %H:%M", time.gmtime(started))),
                                                        rows=[{k: v for k, v in r.items() if k != "outputs"} for r in rows]))
        with open(args.append_to, "w") as f:
            json.dump(d, f, indent=1)
        print(f"appended to {args.append_to}")


def table(rows: list[dict]) -> None:
    head = (f"{'T':>3} {'setting':<22} {'valid':>6} {'len':>4} {'JSON ms/tok':>11} {'free ms/tok':>11} "
            f"{'JSON/free':>9} {'cpu J/f':>7} {'grammar ms':>10} {'accept JSON':>11} {'accept free':>11} "
            f"{'tok/call':>8} {'g.rej':>6} {'speedup':>7} {'=plain':>6}")
    print(head)
    for r in rows:
        c, u = r["constrained"], r.get("unconstrained")
        print(f"{r['temperature']:>3} {r['setting']:<22} {r['valid']:>3}/{r['n']:<2} {r['finished_by_length']:>4} "
              f"{c['ms_per_token']:>11.1f} {u['ms_per_token'] if u else float('nan'):>11.1f} "
              f"{r.get('overhead', float('nan')):>9.3f} {r.get('cpu_overhead', float('nan')):>7.3f} "
              f"{c['grammar_ms_per_token']:>10.3f} {c['stats']['acceptance_rate']:>11.3f} "
              f"{u['stats']['acceptance_rate'] if u else float('nan'):>11.3f} "
              f"{c['stats']['tokens_per_target_call']:>8.2f} {c['stats']['grammar_rejected']:>6} "
              f"{r.get('speedup_vs_plain', 1.0):>7.2f} {str(r.get('identical_to_plain', '')):>6}")


def save(args, rows, started, temps, plot: bool = False) -> None:
    meta = dict(target=args.target, draft=args.draft, quantize=args.quantize, prompts=args.prompts,
                max_tokens=args.max_tokens, batch=args.batch, temperatures=temps, k=args.k,
                early_exit_layers=args.early_exit_layers, ee_k=args.ee_k, eagle_head=args.eagle_head, device="cpu",
                threads=torch.get_num_threads(), started=time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
                minutes=round((time.time() - started) / 60, 1), system_prompt=SYSTEM,
                tasks=[dict(prompt=p, schema=s) for p, s in TASKS[: args.prompts]])
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if plot:
        print(f"wrote {args.out}")
        globals()["plot"](args, rows, temps)


def plot(args, rows, temps) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, T in zip(axes[0], temps):
        rs = [r for r in rows if r["temperature"] == T]
        x = range(len(rs))
        ax.bar([i - 0.2 for i in x], [r["unconstrained"]["ms_per_token"] if "unconstrained" in r else 0 for r in rs],
               0.4, label="unconstrained (matched lengths)")
        ax.bar([i + 0.2 for i in x], [r["constrained"]["ms_per_token"] for r in rs], 0.4, label="JSON schema")
        for i, r in enumerate(rs):
            ax.text(i + 0.2, r["constrained"]["ms_per_token"], f"{r['valid']}/{r['n']}\n"
                    f"a={r['constrained']['stats']['acceptance_rate']:.2f}", ha="center", va="bottom", fontsize=7)
        top = max([r["constrained"]["ms_per_token"] for r in rs] +
                  [r["unconstrained"]["ms_per_token"] for r in rs if "unconstrained" in r])
        ax.set_ylim(0, top * 1.2)  # room for the labels
        ax.set_xticks(list(x), [r["setting"] for r in rs], rotation=15, fontsize=8)
        ax.set_ylabel("ms per token")
        ax.set_title(f"T={T}: {args.prompts} schemas, batch {args.batch}, {args.quantize}")
        ax.legend(fontsize=7)
    fig.suptitle("Qwen2.5-Coder-1.5B (+0.5B draft), CPU: structured output with speculation", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out.replace(".json", ".png"), dpi=100)
    print(f"wrote {args.out.replace('.json', '.png')}")


if __name__ == "__main__":
    main()
