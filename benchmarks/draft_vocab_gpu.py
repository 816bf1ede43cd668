"""A draft model's decode step with its output head restricted to part of the vocabulary (models/vocab_subset.py,
`SpecConfig(draft_vocab=N)`) on one GPU: the Qwen3-0.6B shape in bf16 with random weights (its 151,936 x 1024 head
is a quarter of its bytes), batches 1 and 8, replayed from CUDA graphs, sampling included; the full head against
the first 65,536 and 32,768 ids (+ the special ids above them). Only the cost side: what a restricted draft loses
in acceptance is measured with the real models on the CPU (`forerun bench --draft-vocabs`). Prints a table, writes
JSON and a PNG.

    python benchmarks/draft_vocab_gpu.py --out benchmarks/results/draft_vocab_h200.json
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu as G  # noqa: E402
from forerun.models.vocab_subset import restrict_head  # noqa: E402
from forerun.runtime.cuda_graph import GraphRunner  # noqa: E402

SUBSETS = (None, 65536, 32768)
BATCHES = (1, 8)
SPECIAL = range(151643, 151936)  # Qwen's added tokens (end of text, chat markers, ...)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/draft_vocab.json")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = G.build_model(G.QWEN3_06B, None, seed=2)
    model.ops = G.FusedLayerOps()
    full = model.lm_head
    runs: dict[str, dict[int, list[float]]] = {}
    for rep in range(args.repeats):
        for n in SUBSETS:
            model.lm_head = full
            if n is not None:
                restrict_head(model, n, SPECIAL)
                if rep == 0:  # the same logits on the subset, -inf elsewhere, through the engine's kernels
                    x = torch.randn(1, model.config.hidden_size, device=G.DEV, dtype=G.BF16)
                    ref = model.ops.linear(x, full, torch.float32)
                    got = model.ops.linear(x, model.lm_head, torch.float32)
                    ids = model.lm_head.ids
                    assert torch.isneginf(got).sum() == got.shape[-1] - len(ids)
                    assert ((got[:, ids] - ref[:, ids]).abs().max() / ref.abs().max()).item() < 1e-2
            side = G.make_side(model, max(BATCHES), 640)
            side.graphs = GraphRunner(side.runner, batch_sizes=list(BATCHES), max_q_len=1)
            name = "full head" if n is None else f"first {n} ids"
            for b in BATCHES:
                step, reset = G.draft_step_fn(side, b, 512)
                runs.setdefault(name, {}).setdefault(b, []).append(G.bench_ms(step, inner=20))
                reset()
                G.log(f"[{rep}] {name:16s} batch {b}: {runs[name][b][-1] * 1e3:.1f} us")
            del side
            torch.cuda.empty_cache()
    base = {b: min(runs["full head"][b]) for b in BATCHES}
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape="Qwen3-0.6B (bf16, random)",
               context=512, rows={n: {b: dict(ms=min(t), runs=t, vs_full=min(t) / base[b]) for b, t in by.items()}
                                  for n, by in runs.items()})
    print("\n| draft head | " + " | ".join(f"batch {b}: ms (x full)" for b in BATCHES) + " |")
    print("| --- |" + " --- |" * len(BATCHES))
    for n, by in res["rows"].items():
        print(f"| {n} | " + " | ".join(f"{by[b]['ms']:.3f} ({by[b]['vs_full']:.2f}x)" for b in BATCHES) + " |")
    saved = G.save(res, os.path.abspath(args.out))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(saved["rows"])
    for i, b in enumerate(BATCHES):
        ax.bar([j + 0.4 * i for j in range(len(names))], [saved["rows"][n][str(b)]["ms"] for n in names], 0.4,
               label=f"batch {b}")
    ax.set_xticks([j + 0.2 for j in range(len(names))], names)
    ax.set_ylabel("draft decode step (ms)")
    ax.set_title("Qwen3-0.6B-shape draft step, head over part of the vocabulary")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
