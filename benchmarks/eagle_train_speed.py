"""Training-step speed of `forerun train-eagle`: float32 against bfloat16 autocast, on the CPU or a GPU.

    python benchmarks/eagle_train_speed.py                       # CPU: the Qwen2.5-Coder-1.5B head's shape
    python benchmarks/eagle_train_speed.py --shape qwen3-8b      # a GPU: the Qwen3-8B shape, 2048-token sequences

The step is `forerun.eagle.train.train`'s (sequence_loss over --accum sequences of --seq-len tokens, --ttt
training-time-test steps, backward, clipping, the fused AdamW step), timed over --steps steps after --warmup.
The target is random at the shape's width and vocabulary with --target-layers layers (a head's step never runs
the target: only its embedding, final norm and output rows are read), the features random, so the numbers are
the step's cost, not a training result. Writes a JSON and a PNG (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle_gpu import QWEN3_8B, build_target  # noqa: E402
from forerun.eagle import train as T  # noqa: E402
from forerun.models.eagle_head import EagleConfig  # noqa: E402

QWEN15B = dict(arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
               num_heads=12, num_kv_heads=2, head_dim=128, qk_norm=False, rope_theta=1e6,
               max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True)
SHAPES = {  # target shape, head MLP width, draft vocabulary, sequence length
    "qwen1.5b": (QWEN15B, 4480, 16384, 384),
    "qwen3-8b": (QWEN3_8B, 12288, 32000, 2048),
}


def setup(shape: str, target_layers: int, device: torch.device, seq_len: int, n_seqs: int, seed: int = 0):
    base, inter, vocab, _ = SHAPES[shape]
    cfg = dict(base, num_layers=target_layers)
    target = build_target(cfg, device, torch.float32, seed)
    target.requires_grad_(False)
    h = cfg["hidden_size"]
    aux = (0, target_layers // 2, target_layers - 1)
    ecfg = EagleConfig.for_target(target.config, version=3, draft_vocab_size=vocab, intermediate_size=inter,
                                  aux_layers=aux)
    ids = torch.randperm(cfg["vocab_size"], generator=torch.Generator().manual_seed(seed))[:vocab].sort().values
    head = T.init_head(target, ecfg, ids, seed).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = sorted(set(aux) | {target_layers - 1})
    seqs = [{"tokens": torch.randint(0, cfg["vocab_size"], (seq_len,), device=device, generator=gen),
             "feats": {l: torch.randn(seq_len, h, device=device, generator=gen).to(torch.bfloat16) for l in layers}}
            for _ in range(n_seqs)]
    return target, head, seqs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(target, head, seqs, precision: str, steps: int, warmup: int, accum: int, ttt: int, seq_len: int,
               device: torch.device) -> dict:
    """train()'s step (forerun.eagle.train.train_step with the same optimizer and lm_head cast), timed alone."""
    teacher = T.Teacher(target, head)
    head.lm_head.weight.requires_grad_(False)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = T.make_optimizer(params, 1e-5)
    amp = precision == "bf16"
    lm_weight = T.frozen_lm_weight(head, amp)
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(warmup + steps):
        batch = [seqs[(i * accum + j) % len(seqs)] for j in range(accum)]
        sync(device)
        t = time.perf_counter()
        T.train_step(head, teacher, opt, params, batch, ttt=ttt, max_len=seq_len, gen=gen, amp=amp,
                     lm_weight=lm_weight)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    times.sort()
    med = times[len(times) // 2]
    return {"precision": precision, "step_s_median": round(med, 4), "step_s_min": round(times[0], 4),
            "tokens_per_s": round(accum * seq_len / med, 1)}


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([r["precision"] for r in rows], [r["tokens_per_s"] for r in rows], color=["#888", "#2a7"][:len(rows)])
    for i, r in enumerate(rows):
        ax.text(i, r["tokens_per_s"], f"{r['step_s_median']:.3f} s/step", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("training tokens / s")
    ax.set_title(f"train-eagle step, {res['shape']} head, {res['device_name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: qwen3-8b on CUDA, else qwen1.5b")
    p.add_argument("--device", default=None)
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--ttt", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=None, help="default: the shape's (384 / 2048)")
    p.add_argument("--target-layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (a PNG beside it)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = a.shape or ("qwen3-8b" if device.type == "cuda" else "qwen1.5b")
    seq_len = a.seq_len or SHAPES[shape][3]
    target, head, seqs = setup(shape, a.target_layers, device, seq_len, n_seqs=2 * a.accum)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    res = {"shape": shape, "device_name": name, "seq_len": seq_len, "accum": a.accum, "ttt": a.ttt,
           "head_params_trainable": sum(p.numel() for p in head.parameters() if p.requires_grad), "rows": []}
    print(f"| precision | s / step (median of {a.steps}) | training tokens / s |")
    print("| --- | --- | --- |")
    for prec in a.precisions.split(","):
        row = time_steps(target, head, seqs, prec, a.steps, a.warmup, a.accum, a.ttt, seq_len, device)
        res["rows"].append(row)
        print(f"| {prec} | {row['step_s_median']:.3f} | {row['tokens_per_s']:.0f} |", flush=True)
    if len(res["rows"]) == 2:
        res["speedup"] = round(res["rows"][0]["step_s_median"] / res["rows"][1]["step_s_median"], 3)
        print(f"{res['rows'][1]['precision']} / {res['rows'][0]['precision']}: {res['speedup']}x")
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                f"eagle_train_speed_{device.type}.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, out.rsplit(".", 1)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
