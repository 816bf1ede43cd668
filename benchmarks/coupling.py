"""Acceptance of the seeded Gumbel-max coupling vs rejection sampling, on real drafts.

For real target / draft distributions p, q at many positions (Qwen2.5-Coder-1.5B and 0.5B, teacher-forced on
the target's own greedy continuations of the bench prompts, temperature T), per position:
  rejection sampling accepts a draft with probability sum_v min(p, q) = 1 - TV(p, q) (the optimum);
  the coupling accepts with P(argmax(log p + g) = argmax(log q + g)), estimated over many noise draws g
  (the engine's own noise: forerun.verify.coupling).
Prints a table; writes benchmarks/results/coupling_cpu.json and a PNG.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from forerun.bench_prompts import CODE_PROMPTS  # noqa: E402
from forerun.models.registry import load_model  # noqa: E402
from forerun.runtime.runner import Chunk, ModelRunner  # noqa: E402
from forerun.config import CacheConfig  # noqa: E402
from forerun.verify.coupling import _mix32, _mul32, row_key  # noqa: E402
from forerun.verify.probs import logits_to_probs  # noqa: E402


def gumbel_at(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The engine's Gumbel noise (forerun.verify.coupling.gumbel_noise) at the given token ids only:
    keys [N], tokens [N, M] -> [N, M]."""
    h = _mix32(keys.unsqueeze(1) ^ _mul32(tokens, 0x2C1B3C6D))
    h = _mix32(h ^ 0x68E31DA4)
    u = (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)
    return (-torch.log(-torch.log(u))).to(torch.float32)


def logits_over(model, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=64), "cpu", next(model.parameters()).dtype,
                         max_batch_tokens=1024, max_seqs=2)
    runner.kv.add_sequence(0)
    out, _ = runner.forward([Chunk(0, ids, logits="all")])
    return out.logits.float()


def main() -> None:
    torch.set_num_threads(2)
    n_prompts, new, draws = int(os.environ.get("PROMPTS", 6)), 48, int(os.environ.get("DRAWS", 100))
    t0 = time.perf_counter()
    quant = os.environ.get("QUANTIZE", "int8")  # int8 keeps the pair in ~3.5 GB; p and q stay real model outputs
    target, tok, _ = load_model("qwen2.5-coder-1.5b-instruct", quantize=quant)
    draft, _, _ = load_model("qwen2.5-coder-0.5b-instruct", quantize=quant)
    res_quant = quant
    from forerun.engine.llm import LLM
    from forerun.sampling_params import SamplingParams

    llm = LLM.from_model(target, tok, device="cpu", enable_prefix_caching=False)
    res = {"quantize": res_quant, "temperatures": {}, "date": datetime.datetime.now().isoformat(timespec="seconds"), "draws": draws,
           "prompts": n_prompts, "new_tokens": new}
    seqs = []
    for p in CODE_PROMPTS[:n_prompts]:
        o = llm.generate([p], SamplingParams(temperature=0, max_tokens=new), chat=True)[0]
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        seqs.append((ids, o.token_ids))
    print(f"[{time.perf_counter() - t0:.0f}s] continuations done", flush=True)
    pl, ql = [], []
    for ids, out in seqs:
        full = ids + out
        n = len(out)
        pl.append(logits_over(target, full)[len(ids) - 1: len(ids) - 1 + n])
        ql.append(logits_over(draft, full)[len(ids) - 1: len(ids) - 1 + n])
    P, Q = torch.cat(pl), torch.cat(ql)  # [N, V]
    print(f"[{time.perf_counter() - t0:.0f}s] {P.shape[0]} positions scored", flush=True)
    temps = (0.6, 0.8, 1.0)
    n = P.shape[0]
    z, o, zf = torch.zeros(n, dtype=torch.long), torch.ones(n), torch.zeros(n)
    logp = {T: logits_to_probs(P, torch.full((n,), T), z, o, zf).log() for T in temps}
    logq = {T: logits_to_probs(Q, torch.full((n,), T), z, o, zf).log() for T in temps}
    agree = {T: torch.zeros(n) for T in temps}
    # The winner of argmax(log p + g) lies, but for a vanishing chance, among the likely tokens: the noise is
    # evaluated (with the engine's own hash, forerun.verify.coupling) on the union of both top-CAND lists only,
    # and the smallest top-CAND mass of p is reported (1 - it bounds the chance a winner lies outside).
    cand = int(os.environ.get("CAND", 512))
    idx = {T: torch.cat([logp[T].topk(cand, -1).indices, logq[T].topk(cand, -1).indices], -1) for T in temps}
    for s in range(draws):  # the engine's noise for seed s: one draw serves every temperature
        keys = torch.tensor([row_key(s, 1000 + i) for i in range(n)])
        for T in temps:
            g = gumbel_at(keys, idx[T])  # [N, 2 * cand]
            wp = idx[T].gather(1, (logp[T].gather(1, idx[T]) + g).argmax(-1, keepdim=True))
            wq = idx[T].gather(1, (logq[T].gather(1, idx[T]) + g).argmax(-1, keepdim=True))
            agree[T] += (wp == wq).squeeze(1).float()
    print(f"[{time.perf_counter() - t0:.0f}s] {draws} noise draws done", flush=True)
    for temp in temps:
        mass_p = logp[temp].exp().gather(1, logp[temp].topk(cand, -1).indices).sum(-1)
        res.setdefault("candidate_mass_p_min", {})[str(temp)] = float(mass_p.min())
        rejection = torch.minimum(logp[temp].exp(), logq[temp].exp()).sum(-1)  # [N]
        coupling = agree[temp] / draws
        row = dict(positions=P.shape[0], rejection=float(rejection.mean()), coupling=float(coupling.mean()),
                   ratio=float(coupling.mean() / rejection.mean()))
        res["temperatures"][str(temp)] = row
        print(f"T={temp}: rejection sampling accepts {row['rejection']:.3f}, the coupling {row['coupling']:.3f} "
              f"({row['ratio']:.1%} of it) over {row['positions']} positions", flush=True)
    out_dir = os.path.join(REPO, "benchmarks", "results")
    json.dump(res, open(os.path.join(out_dir, "coupling_cpu.json"), "w"), indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = list(res["temperatures"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ts, [res["temperatures"][k]["rejection"] for k in ts], marker="o", label="rejection sampling (1 - TV)")
    ax.plot(ts, [res["temperatures"][k]["coupling"] for k in ts], marker="o", label="seeded Gumbel coupling")
    ax.set_xlabel("temperature")
    ax.set_ylabel("per-draft acceptance")
    ax.set_title("Qwen2.5-Coder 1.5B target, 0.5B draft")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "coupling_cpu.png"), dpi=110)
    print("wrote benchmarks/results/coupling_cpu.json")


if __name__ == "__main__":
    main()
