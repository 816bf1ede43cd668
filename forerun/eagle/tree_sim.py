"""Tokens per round of EAGLE chains and trees on the bench prompts without verifying them (docs/eagle.md, session 9).

    python -m forerun.eagle.tree_sim [--head DIR] [--shapes "4,4,16;4,6,24"] [--ks 2,3,4] [--prompts 20] [--out FILE]

The target decodes each bench prompt greedily once (chat template, `--max-tokens` new tokens, the layout `forerun
bench` loads), keeping the hidden states the head drafts from. Then every chain k and tree shape is replayed
round by round through the real `EagleDrafter` (`propose` / `propose_tree`, the head quantized as in the bench):
its draft is checked against the known greedy continuation (a tree accepts its longest root path that matches
it), the committed tokens' features are handed over with `observe_target` as the engine would, and the next
round starts where the verification would have left it. Since greedy verification commits exactly the target's
greedy tokens, this gives the bench's `tokens_per_target_call` (the prefill round counted, as the bench does)
without paying the verify rows, up to the int4 kernels' row-to-row rounding in the features.

It also times the target forward over n rows (n = 1 .. the largest tree) at the prompts' context, and every
proposal, so each row gets an estimated round time = verify(rows) + drafting + `--overhead-ms` (the engine's
host work per round, ~6 ms at 1 thread: plain bench 42 ms per token against a 36 ms decode) and tok/s from it.
The estimate is a guide for which rows to bench; the bench measures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..config import CacheConfig


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        k, s, n = (int(x) for x in part.split(","))
        out.append((k, s, n))
    return out


def parse_tree_rows(text: str) -> list[tuple[tuple[int, int, int], float | None]]:
    """'3,4,8;3,4,12@0.1' -> [((3, 4, 8), None), ((3, 4, 12), 0.1)]: tree rows, each with its confidence cut."""
    from ..config import parse_eagle_tree_row

    return [parse_eagle_tree_row(p.strip()) for p in text.split(";") if p.strip()]


def accepted_in_tree(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Drafts a greedy tree verification accepts: the longest path from the root (node 0) whose tokens equal
    `truth` (the target's greedy continuation after the root) in order."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if i:
            children.setdefault(p, []).append(i)
    node, a = 0, 0
    while a < len(truth):
        nxt = next((c for c in children.get(node, ()) if tokens[c] == truth[a]), None)
        if nxt is None:
            break
        node, a = nxt, a + 1
    return a


def accepted_in_chain(drafts: list[int], truth: list[int]) -> int:
    a = 0
    while a < len(drafts) and a < len(truth) and drafts[a] == truth[a]:
        a += 1
    return a


def decode_ids(target, ids: list[int], max_tokens: int, layers, eos=frozenset(), rid: int = 1000) -> dict:
    """Greedy decoding of one prompt (token ids), keeping the layers the head's features come from for every
    committed position: {'ids', 'gen', 'states': {layer: [len(ids) + len(gen) - 1, H]}}."""
    from ..runtime.runner import Chunk

    kv = target.kv
    kv.add_sequence(rid)
    res, _ = target.forward([Chunk(rid, list(ids))], hidden_layers=layers)
    states = {layer: [res.hidden_states[layer]] for layer in layers}
    gen = [int(res.logits[-1].argmax())]
    while len(gen) < max_tokens and gen[-1] not in eos:
        res, _ = target.forward([Chunk(rid, [gen[-1]])], hidden_layers=layers)
        for layer in layers:
            states[layer].append(res.hidden_states[layer])
        gen.append(int(res.logits[-1].argmax()))
    kv.free(rid)
    return {"ids": list(ids), "gen": gen, "states": {layer: torch.cat(v) for layer, v in states.items()}}


def decode_prompts(target, tok, prompts: list[str], max_tokens: int, layers) -> list[dict]:
    """decode_ids of each prompt through the chat template, as `forerun bench` feeds them."""
    eos = set(target.model.config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    out = []
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out.append(decode_ids(target, ids, max_tokens, layers, frozenset(eos)))
    return out


def verify_costs(target, sample: dict, rows: list[int], reps: int) -> dict[int, float]:
    """Median ms of one target forward of n rows (all with logits) after the sample's prompt + half its answer."""
    from ..runtime.runner import Chunk

    ids, gen = sample["ids"], sample["gen"]
    ctx_tokens = ids + gen[: len(gen) // 2]
    kv, rid = target.kv, 999
    kv.add_sequence(rid)
    target.forward([Chunk(rid, ctx_tokens, logits="none")])
    ctx = kv.length(rid)
    filler = (gen * 8)[:max(rows)]
    res = {}
    for n in rows:
        ts = []
        for i in range(reps + 2):
            t = time.perf_counter()
            target.forward([Chunk(rid, filler[:n], logits=n)])
            dt = time.perf_counter() - t
            kv.truncate(rid, ctx)
            if i >= 2:
                ts.append(dt)
        res[n] = 1000 * statistics.median(ts)
    kv.free(rid)
    return res


class TableCost:
    """target_time(tokens) in seconds from measured (rows -> ms) points, linear between them and beyond the last
    two, plus a fixed per-round overhead: what the tree budget reads from the engine's CostModel in a real run."""

    def __init__(self, ms: dict[int, float], overhead_ms: float = 0.0) -> None:
        self.pts = sorted(ms.items())
        self.overhead_ms = overhead_ms

    def target_time(self, tokens: int) -> float:
        pts = self.pts
        if len(pts) == 1:
            return (pts[0][1] + self.overhead_ms) / 1000
        i = 1
        while i < len(pts) - 1 and pts[i][0] < tokens:
            i += 1
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return (y0 + (y1 - y0) * (tokens - x0) / (x1 - x0) + self.overhead_ms) / 1000


def replay(target, head, samples: list[dict], *, k: int | None = None, shape: tuple[int, int, int] | None = None,
           quantize: str | None = None, cache: "CacheConfig | None" = None, trace: list | None = None,
           budget_cost=None, engine_tail: bool = False, confidence: float = 0.0) -> dict:
    """One chain (k) or fixed tree (shape) replayed over every sample (a head folder or module); see the module
    docstring. trace: a list that receives, per sample, the accepted drafts of each round after the prefill.
    budget_cost: a tree with the per-round budget (shape its maximum) fed this target cost (TableCost).
    engine_tail: as the engine's `_k_for` did before session 10: a tree round only while the request has room for
    the whole tree's depth (remaining - 1 >= steps), plain rounds after that. Without it a tree's steps are capped
    at remaining - 1 (`tree_depth_cap`, what the engine does now). confidence: the tree's cut (EagleDrafter's
    tree_confidence): only nodes of cumulative draft probability >= it are verified (`mean_verify_rows`)."""
    from ..config import CacheConfig
    from ..drafters.eagle import EagleDrafter
    from ..request import Request
    from ..sampling_params import SamplingParams

    topk, steps, nodes = shape or (4, 4, 16)
    d = EagleDrafter(target, head, cache=cache or CacheConfig(block_size=16, num_blocks=128), quantize=quantize,
                     tree_topk=topk, tree_steps=steps, tree_nodes=nodes, tree_confidence=confidence)
    if budget_cost is not None:
        d.use_target_cost(budget_cost)
    rounds = emitted = accepted = 0
    nodes_verified = 0
    at_depth: list[list[int]] = []  # per draft position: [rounds that offered it, rounds that accepted it]
    draft_s: list[float] = []
    per_sample: list[float] = []  # tokens per round after the prefill, each sample (prompt)
    for n, s in enumerate(samples):
        ids, gen, states = s["ids"], s["gen"], s["states"]
        limit = s.get("limit", len(gen))  # tokens to commit (gen may run further: drafts are then never cut)
        r = Request(2000 + n, None, list(ids), SamplingParams(temperature=0, max_tokens=limit),
                    torch.Generator().manual_seed(0), frozenset())
        r.output_token_ids.append(gen[0])  # the prefill round
        rounds += 1
        emitted += 1
        d.observe_target([r], [{layer: h[: len(ids)] for layer, h in states.items()}], [0])
        if trace is not None:
            trace.append([])
        s_rounds, s_emitted = 0, 0
        while len(r.output_token_ids) < limit:
            c = len(r.output_token_ids)
            truth = gen[c:]
            t = time.perf_counter()
            if shape is not None and engine_tail and limit - c - 1 < steps:
                a, depth = 0, 0  # a plain round
                nodes_verified += 1
            elif shape is None:
                prop = d.propose([r], [k])
                drafts = prop.tokens[0]
                a = accepted_in_chain(drafts, truth)
                depth = len(drafts)
            else:
                prop = d.propose_tree([r])
                a = accepted_in_tree(prop.tokens[0], prop.parents[0], truth)
                par = prop.parents[0]
                dep = [0] * len(par)
                for i in range(1, len(par)):
                    dep[i] = dep[par[i]] + 1
                depth = max(dep)
                nodes_verified += len(par)
            if depth:
                draft_s.append(time.perf_counter() - t)
            while len(at_depth) < depth:
                at_depth.append([0, 0])
            for i in range(depth):
                at_depth[i][0] += 1
                at_depth[i][1] += int(i < a)
            a = min(a, len(truth) - 1)  # the bonus token always lands
            if trace is not None:
                trace[-1].append(a)
            new = gen[c: c + a + 1]
            start = len(ids) + c - 1  # positions of the root and the accepted drafts (their features)
            d.observe_target([r], [{layer: h[start: start + a + 1] for layer, h in states.items()}], [start])
            r.output_token_ids.extend(new)
            d.rollback(r, r.num_tokens)
            took = min(len(new), limit - c)  # the last round is cut at max_tokens
            rounds += 1
            emitted += took
            accepted += a
            s_rounds += 1
            s_emitted += took
        per_sample.append(round(s_emitted / s_rounds, 3) if s_rounds else 0.0)
        d.release(r)
    out = {"rounds": rounds, "emitted": emitted, "accepted": accepted,
            "tokens_per_target_call": round(emitted / rounds, 4),
            "tokens_per_round_no_prefill": round((emitted - len(samples)) / max(1, rounds - len(samples)), 4),
            "per_position_acceptance": [round(b / a, 4) if a else 0.0 for a, b in at_depth],
            "draft_ms_median": round(1000 * statistics.median(draft_s), 2) if draft_s else 0.0,
            "draft_ms_mean": round(1000 * statistics.mean(draft_s), 2) if draft_s else 0.0,
            "head_layout": d.head_layout, "per_prompt_tokens_per_round": per_sample}
    if shape is not None:
        out["mean_verify_rows"] = round(nodes_verified / max(1, rounds - len(samples)), 2)
    if d.budget is not None:
        out["budget_chosen"] = dict(sorted(d.budget.chosen.items(), key=lambda kv: -kv[1]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m forerun.eagle.tree_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--head", default="~/.cache/forerun/eagle/qwen1.5b")
    p.add_argument("--quantize", default="auto", help="the target's layout (as forerun bench's --quantize)")
    p.add_argument("--head-quantize", default=None, help="EagleDrafter quantize (default: as the bench)")
    p.add_argument("--ks", default="2,3,4", help="chain rows")
    p.add_argument("--shapes", default="4,4,16", help="tree rows TOPK,STEPS,NODES;... (TOPK,STEPS,NODES@C: only "
                   "nodes of cumulative draft probability >= C verified, EagleDrafter's tree_confidence)")
    p.add_argument("--budget-shapes", default="", help="tree rows with the per-round budget (TableCost of the "
                   "measured verify times + --overhead-ms), the shape its maximum")
    p.add_argument("--engine-tail", action="store_true", help="trees: plain rounds once a request has less room "
                   "than the tree's depth, as the engine did before session 10 (now it caps the tree's depth)")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5, help="timing repetitions of each verify size")
    p.add_argument("--overhead-ms", type=float, default=6.0, help="host work per round in the engine (estimate)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from pathlib import Path

    from ..bench_prompts import CODE_PROMPTS
    from ..config import CacheConfig
    from ..models.eagle_head import load_eagle_head
    from ..models.registry import load_model
    from ..runtime.runner import ModelRunner

    head_dir = str(Path(a.head).expanduser())
    model, tok, _ = load_model(a.model, "cpu", torch.float32, quantize=a.quantize, progress=False)
    target = ModelRunner(model, CacheConfig(block_size=16, num_blocks=512), "cpu", torch.float32)
    layers = tuple(load_eagle_head(head_dir, model, dtype=torch.float32, device="cpu").eagle.aux_layers)
    t = time.perf_counter()
    samples = decode_prompts(target, tok, list(CODE_PROMPTS[: a.prompts]), a.max_tokens, layers)
    res: dict = {"model": a.model, "head": head_dir, "threads": a.threads, "prompts": a.prompts,
                 "max_tokens": a.max_tokens, "decode_s": round(time.perf_counter() - t, 1), "rows": []}
    shapes = parse_tree_rows(a.shapes)
    ks = [int(x) for x in a.ks.split(",") if x]
    bshapes = parse_shapes(a.budget_shapes)
    sizes = sorted({1, 2, *(k + 1 for k in ks), *(s[2] for s, _ in shapes), *(n for _, _, n in bshapes)})
    cost = verify_costs(target, samples[0], sizes, a.reps)
    res["verify_ms"] = {n: round(v, 2) for n, v in cost.items()}
    print(json.dumps({"verify_ms": res["verify_ms"]}), file=sys.stderr, flush=True)
    plain_round = cost[1] + a.overhead_ms
    configs = [(f"eagle k={k}", k, None, k + 1, None, 0.0) for k in ks] + \
              [(f"eagle tree {','.join(map(str, s))}" + ("" if c is None else f" p>={c:g}"), None, s,
                s[2] if c is None else None, None, c or 0.0) for s, c in shapes] + \
              [(f"eagle tree <={','.join(map(str, s))} budget", None, s, None, TableCost(cost, a.overhead_ms), 0.0)
               for s in bshapes]
    for label, k, shape, rows, bcost, conf in configs:
        t = time.perf_counter()
        row = {"config": label, **replay(target, head_dir, samples, k=k, shape=shape, quantize=a.head_quantize,
                                         budget_cost=bcost, engine_tail=a.engine_tail, confidence=conf)}
        if rows is None:  # budget rows and confidence cuts: the mean verify rows, at the measured cost line
            rows = row["mean_verify_rows"]
            verify = 1000 * TableCost(cost).target_time(rows)
        else:
            verify = cost[rows]
        draft = row["draft_ms_median"] if bcost is None else row["draft_ms_mean"]
        round_ms = verify + draft + a.overhead_ms
        tpr = row["tokens_per_round_no_prefill"]
        row.update(verify_rows=rows, est_round_ms=round(round_ms, 1), est_tok_per_s=round(1000 * tpr / round_ms, 2),
                   est_x_plain=round(tpr * plain_round / round_ms, 3), sim_s=round(time.perf_counter() - t, 1))
        res["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    res["est_plain_tok_per_s"] = round(1000 / plain_round, 2)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
