"""What an EAGLE head step costs on the CPU next to the target's decode and verify forwards (docs/eagle.md, session 8).

    python -m forerun.eagle.head_cost [--head DIR] [--layouts none,int4,int8] [--reps 25] [--out FILE]

Loads the target as `forerun bench` does (GGUF kept int4 / int8, `--quantize auto`), decodes 40 tokens of a bench
prompt, then times (median of --reps, 1 thread by default): the target's decode (1 row) and verify forwards (5, 16
rows), and for each head layout (`EagleDrafter(quantize=...)`): a chain step (1 row fed with a head output), the
draft extend (1 and 2 rows from target features, through `fc`), tree steps 1-3 (4 t rows, the MLP and draft
lm_head on 4 of them), and whole `propose` (chain k = 4) / `propose_tree` (4, 4, 16) calls.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _median_ms(f, reps: int) -> float:
    f()
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return round(1000 * statistics.median(ts), 2)


def measure(model_name: str, head_dir: str, layouts: list[str], reps: int = 25, quantize: str = "auto") -> dict:
    from ..bench_prompts import CODE_PROMPTS
    from ..config import CacheConfig
    from ..drafters.eagle import EagleDrafter
    from ..models.quant import weight_bytes
    from ..models.registry import load_model
    from ..request import Request
    from ..runtime.runner import Chunk, ModelRunner
    from ..sampling_params import SamplingParams

    model, tok, _ = load_model(model_name, "cpu", torch.float32, quantize=quantize, progress=False)
    target = ModelRunner(model, CacheConfig(block_size=16, num_blocks=256), "cpu", torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": CODE_PROMPTS[0]}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    res: dict = {"model": model_name, "target_layout": getattr(model, "quantization", "none"),
                 "threads": torch.get_num_threads(), "reps": reps, "prompt_tokens": len(ids)}
    kv, rid = target.kv, 1
    kv.add_sequence(rid)
    out, _ = target.forward([Chunk(rid, ids)])
    gen = [int(out.logits[-1].argmax())]
    for _ in range(40):
        out, _ = target.forward([Chunk(rid, [gen[-1]])])
        gen.append(int(out.logits[-1].argmax()))
    ctx = kv.length(rid)
    res["context"] = ctx

    def target_rows(n: int):
        def f() -> None:
            target.forward([Chunk(rid, gen[-n:], logits=n)])
            kv.truncate(rid, ctx)
        return f

    res["target_decode_ms"] = _median_ms(target_rows(1), reps)
    res["target_verify5_ms"] = _median_ms(target_rows(5), reps)
    res["target_verify16_ms"] = _median_ms(target_rows(16), reps)
    kv.free(rid)
    probe = EagleDrafter(target, head_dir, cache=CacheConfig(block_size=16, num_blocks=8), quantize="none")
    layers = probe.target_hidden_layers
    del probe
    kv.add_sequence(rid)
    out, _ = target.forward([Chunk(rid, (ids + gen)[:-1], logits="none")], hidden_layers=layers)
    states = {layer: out.hidden_states[layer] for layer in layers}
    kv.free(rid)
    for layout in layouts:
        d = EagleDrafter(target, head_dir, cache=CacheConfig(block_size=16, num_blocks=64), quantize=layout,
                         tree_topk=4, tree_steps=4, tree_nodes=16)
        r = Request(7, None, list(ids), SamplingParams(temperature=0, max_tokens=64), torch.Generator().manual_seed(0),
                    frozenset())
        r.output_token_ids.extend(gen)
        d.observe_target([r], [states], [0])
        d.propose([r], [1])  # feeds the prefix
        hk = d.cache.kv
        base = hk.length(r.req_id)
        hid = d.head.config.hidden_size
        feat = torch.randn(16, hid, generator=torch.Generator().manual_seed(0)) * 0.5
        tfeat = d.head.target_feature({layer: h[-16:] for layer, h in states.items()})

        def head_rows(n: int, want: int, from_target: bool):
            def f() -> None:
                hk.reserve(r.req_id, base + n)
                d._run([Chunk(r.req_id, gen[-n:], logits=want)], (tfeat if from_target else feat)[:n], from_target)
                hk.truncate(r.req_id, base)
            return f

        lin = [p for n, p in d.head.named_parameters() if p.dim() == 2]
        row = {"layout": d.head_layout,
               "head_linear_MiB": round((weight_bytes(d.head)["quantized_linear_bytes"] if d.head_layout != "none"
                                         else sum(p.numel() * p.element_size() for p in lin)) / 2 ** 20, 1),
               "chain_step_ms": _median_ms(head_rows(1, 1, False), reps),
               "extend1_ms": _median_ms(head_rows(1, 1, True), reps),
               "extend2_ms": _median_ms(head_rows(2, 1, True), reps)}
        for t in (1, 2, 3):
            row[f"tree_step{t}_{4 * t}rows_ms"] = _median_ms(head_rows(4 * t, 4, False), reps)
        row["propose_chain_k4_ms"] = _median_ms(lambda: d.propose([r], [4]), max(5, reps // 2))
        row["propose_tree_4_4_16_ms"] = _median_ms(lambda: d.propose_tree([r]), max(5, reps // 2))
        row["chain_step_over_decode"] = round(row["chain_step_ms"] / res["target_decode_ms"], 3)
        res[layout] = row
        print(json.dumps(row), file=sys.stderr, flush=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m forerun.eagle.head_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--head", default="~/.cache/forerun/eagle/qwen1.5b")
    p.add_argument("--layouts", default="none,int4,int8", help="EagleDrafter quantize values to time")
    p.add_argument("--quantize", default="auto", help="the target's layout (as forerun bench's --quantize)")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the JSON here too")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from pathlib import Path

    res = measure(a.model, str(Path(a.head).expanduser()), a.layouts.split(","), a.reps, a.quantize)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
