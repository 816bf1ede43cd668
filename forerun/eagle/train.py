"""`forerun train-eagle`: train an EAGLE head for a target model, on this machine's CPU or a GPU.

    forerun train-eagle --target qwen2.5-coder-1.5b-instruct --out ~/.cache/forerun/eagle/qwen1.5b \
        --train-tokens 30000 --minutes 30

1. Features (forerun.eagle.data): the target runs teacher-forced over an offline corpus (--corpus mix: Python
   sources of the installed interpreter and site-packages, mostly shaped as chat turns, code-then-prose answers,
   other languages' files and package docs; --corpus code: the Python part only), with its weights in the
   layout drafting runs against (--quantize auto: a GGUF stays int4 as `forerun bench` loads it), and the
   outputs of the head's feature layers and of the last layer are cached under --data (default OUT/data),
   resumable. On a shared machine use --threads 1 (two OpenMP threads stall when one core is busy).
   --corpus distill (self-distillation): the target first answers instructions made from the same offline
   corpus (never the benchmark prompts) greedily through forerun's batched engine; the answers are cached
   under DATA/distill/ (resumable) and the features are extracted over prompt + answer. --dataset FILE: your
   own records (chat turns, prompt / response pairs, text; JSON Lines or a JSON array, forerun/eagle/data.py)
   instead of the offline corpus, used as they are (--corpus dataset, the default with --dataset) or as
   instructions the target answers (--corpus distill). --extra-data DIR adds
   other feature folders: their training splits join the training set, their held-out splits are evaluated
   next to DATA's (reported under "extra").
2. Head: EAGLE-3 by default (fc over three target layers, reduced draft vocabulary of the most frequent
   training tokens, draft lm_head and norm initialised from the target's), or EAGLE-1 (--version 1).
3. Loss: cross-entropy against the target's next-token distribution (lm_head(norm(last layer)) restricted
   to the draft vocabulary), over `--ttt` unrolled training-time-test steps (EAGLE-3: step s feeds the head's
   own step s-1 outputs and attends to the committed rows plus its own chain, weights 0.8^s), plus, for
   EAGLE-1, a smooth-L1 regression of the next feature. --precision auto trains in bfloat16 autocast
   (float32 master weights and optimizer, the teacher's distribution in float32) where bfloat16 products are
   fast: a GPU with bf16, a CPU with AMX or AVX-512 BF16 (~2x the float32 step on this 2-core CPU, 6x on an
   H200); float32 elsewhere.
4. Every --eval-every steps: held-out acceptance, estimated teacher-forced on held-out files: per start,
   chains of k drafts are compared with the target's argmax; `acc_len` = 1 + mean accepted drafts over the
   starts where the held-out text follows the target's greedy choice along the chain (so that teacher
   forcing feeds what drafting would), `acc_len_all` counts a corpus deviation as a rejection (a lower bound).
   `tokens_per_round` is what a bench reports: chains of k drafted round after round along each stretch of
   text that follows the target's greedy choice (a round starts where the last one's accepted drafts and
   bonus token ended, so the easy positions a round accepts are not scored again). It runs below `acc_len`
   (docs/eagle.md, session 35: 1.52 against 1.88 on the bench prompts' own greedy answers).
5. Checkpoints in the published EAGLE-3 (SpecForge) / EAGLE-1 layouts under OUT (config.json +
   model.safetensors), plus OUT/train_state.pt to resume (--resume).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..models.eagle_head import EagleConfig, EagleHead, load_eagle_head, save_eagle_head
from . import data as D
from ..usage import ArgumentParser, run as run_main


def choose_draft_vocab(counts: torch.Tensor, size: int, must: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent training tokens (ties and unseen slots: lowest ids, which BPE vocabularies
    give to their most common merges), sorted; `must` tokens (EOS) always included. [size] long."""
    v = counts.numel()
    size = min(size, v)
    score = counts.double() + (1.0 - torch.arange(v, dtype=torch.float64) / v) * 0.5  # tie-break: low ids first
    for t in must:
        if 0 <= t < v:
            score[t] = float("inf")
    return score.topk(size).indices.sort().values


def init_head(target, cfg: EagleConfig, draft_ids: torch.Tensor | None, seed: int = 0,
              lm_head_weight: torch.Tensor | None = None) -> EagleHead:
    """Small random layer; fc reads the highest feature layer as identity (EAGLE-3) so the head starts from
    the target's own representation; draft norm / lm_head copied from the target's."""
    torch.manual_seed(seed)
    head = EagleHead(cfg, target)
    h = cfg.layer.hidden_size
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0, 0.02)
        if cfg.version == 3:
            head.fc.weight[:, -h:] += torch.eye(h)
            head.norm.weight.copy_(target.model.norm.weight)
            w = lm_head_weight if lm_head_weight is not None else _lm_head_weight(target)
            head.set_draft_vocab(draft_ids - torch.arange(draft_ids.numel()))
            head.lm_head.weight.copy_(w[draft_ids])
        else:
            head.fc.weight[:, h:] += torch.eye(h)
    return head


def _lm_head_weight(target) -> torch.Tensor:
    w = getattr(target.lm_head, "weight", None)
    if w is None and target.config.tie_word_embeddings:
        w = target.model.embed_tokens.weight
    if w is None:
        raise ValueError("the target's lm_head is packed (inference only): load it with pack_cpu=False")
    return w.detach()


def checkpoint_lm_head(ckpt) -> torch.Tensor:
    """The output head's weight as fp32 from a checkpoint (a GGUF's `output` dequantized exactly; the embedding
    for tied heads): what a teacher needs when the loaded model keeps its head quantized (no plain weight)."""
    from ..models.loader import GGUFQuantized

    want = "model.embed_tokens.weight" if ckpt.config.tie_word_embeddings else "lm_head.weight"
    for name, t in ckpt.tensors(keep_quantized=True):
        if name == want:
            return (t.dequantize() if isinstance(t, GGUFQuantized) else t).float()
    raise ValueError(f"{ckpt.source}: no {want}")


class Teacher:
    """The target's next-token logits from its stored last-layer states (no target forward needed).
    Soft targets over the draft vocabulary use the head's fp32 weight (`lm_head_weight` when the model keeps a
    quantized head); `argmax` (held-out acceptance) goes through the model's own head as inference does."""

    def __init__(self, target, head: EagleHead, lm_head_weight: torch.Tensor | None = None) -> None:
        self.norm = target.model.norm
        w = (lm_head_weight if lm_head_weight is not None else _lm_head_weight(target)).float()
        self.full = w
        self.draft = w[head.draft_to_target.to(w.device)].contiguous()  # [Vd, H]
        self.last = target.config.num_layers - 1
        self.head = None if getattr(target.lm_head, "weight", None) is not None else target.lm_head

    @torch.no_grad()
    def draft_logits(self, last: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, Vd]
        with torch.autocast(last.device.type, enabled=False):  # the training target stays float32
            return self.norm(last.float()) @ self.draft.T

    @torch.no_grad()
    def argmax(self, last: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T] target ids (full vocabulary)
        x = self.norm(last.float())
        if self.head is not None:  # quantized head: the logits drafting is verified against
            return torch.cat([self.head(x[i:i + 256]).argmax(-1) for i in range(0, x.shape[0], 256)])
        return torch.cat([(x[i:i + 256] @ self.full.T).argmax(-1) for i in range(0, x.shape[0], 256)])


def _on(seq: dict, device: torch.device) -> dict:
    """The sequence's tensors on the training device (a no-op on the CPU)."""
    if device.type == "cpu":
        return seq
    return {"tokens": seq["tokens"].to(device), "feats": {k: v.to(device) for k, v in seq["feats"].items()}}


def unrolled_outputs(head: EagleHead, seq: dict, steps: int, crop: tuple[int, int] | None = None):
    """Head outputs of `steps` training-time-test steps over one sequence: list of [T-1, H] (row t = token
    x_{t+1} with feature f_t). Step s row t continues the chain that left the committed rows at t - s."""
    seq = _on(seq, head.device)
    toks = seq["tokens"]
    a, b = crop or (0, toks.numel())
    ids = toks[a + 1:b].unsqueeze(0)  # [1, T'] x_{t+1}
    feats = head.target_feature({k: v[a:b - 1].float() for k, v in seq["feats"].items()}).unsqueeze(0)
    t = ids.shape[1]
    cache: list = []
    outs = []
    x_feats, from_target = feats, True
    for s in range(steps):
        mask = _ttt_mask(t, s, ids.device)
        out = head.forward_dense(ids, x_feats, from_target, cache=cache, mask=mask)
        outs.append(out[0])
        # next step's feature at row t = this step's output at row t - 1
        x_feats = torch.cat([out[:, :1] * 0, out[:, :-1]], dim=1)
        from_target = False
    return outs


def _ttt_mask(t: int, s: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[t, t * (s + 1)] bool: step s row r sees committed rows <= r - s, and row r - s + j of step j."""
    r = torch.arange(t, device=device)
    blocks = [r[None, :] <= (r[:, None] - s)]
    for j in range(1, s + 1):
        blocks.append(r[None, :] == (r[:, None] - s + j))
    return torch.cat(blocks, dim=1)


def resolve_precision(precision: str, device: torch.device) -> str:
    """--precision auto -> 'bf16' where bfloat16 matrix products are fast (CUDA with bf16; a CPU with AMX or
    AVX-512 BF16, where oneDNN runs them: 6x float32's products on this 2-core CPU), else 'fp32'."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if device.type == "cpu":
        cpu = getattr(torch, "cpu", None)
        fast = any(getattr(cpu, f, lambda: False)() for f in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
        return "bf16" if fast and torch.backends.mkldnn.is_available() else "fp32"
    return "fp32"


def _head_logits(head: EagleHead, out: torch.Tensor, lm_weight: torch.Tensor | None) -> torch.Tensor:
    """head.logits, or with a frozen lm_head's weight already cast (bf16 training: cast once per run, not per
    call)."""
    if lm_weight is None:
        return head.logits(out)
    x = out if head.norm is None else head.norm(out)
    return F.linear(x.to(lm_weight.dtype), lm_weight).float()


def sequence_loss(head: EagleHead, teacher: Teacher, seq: dict, steps: int, max_len: int,
                  gen: torch.Generator, feat_weight: float = 0.0,
                  lm_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Mean over rows and steps (weights 0.8^s) of CE(target next-token distribution, head).
    lm_weight: the frozen draft lm_head's weight in the autocast dtype (see _head_logits)."""
    n = seq["tokens"].numel()
    a = int(torch.randint(0, max(1, n - max_len) + 1, (1,), generator=gen)) if n > max_len else 0
    b = min(n, a + max_len)
    outs = unrolled_outputs(head, seq, steps, (a, b))
    last = seq["feats"][teacher.last][a:b].to(head.device)
    target_p = teacher.draft_logits(last[1:]).softmax(-1)  # row t: distribution of x_{t+2} = target at t+1
    total, weight = 0.0, 0.0
    for s, out in enumerate(outs):
        rows = slice(s, out.shape[0] - 0)  # rows r >= s have a chain of s steps from committed rows
        ce = F.cross_entropy(_head_logits(head, out[rows], lm_weight), target_p[rows])  # soft targets
        w = 0.8 ** s
        total = total + w * ce
        weight += w
        if feat_weight and s == 0 and head.eagle.version == 1:  # EAGLE-1: the output regresses the next feature
            tgt = head.target_feature({teacher.last: last[1:].float()})  # row t regresses f_{t+1}
            total = total + feat_weight * F.smooth_l1_loss(out, tgt)
    return total / weight, b - a


@torch.no_grad()
def heldout_acceptance(head: EagleHead, teacher: Teacher, seqs: list[dict], k: int = 4) -> dict:
    """Teacher-forced estimate of chain acceptance with k drafts (see the module docstring)."""
    acc_on, n_on, acc_all, n_all = 0, 0, 0, 0
    rounds = emitted = 0
    step_hits = torch.zeros(k)
    step_tries = torch.zeros(k)
    for seq in seqs:
        n = seq["tokens"].numel()
        if n < k + 4:
            continue
        outs = unrolled_outputs(head, seq, k)
        dev = head.device
        if "_argmax" not in seq:
            seq["_argmax"] = teacher.argmax(seq["feats"][teacher.last].to(dev))  # [n] the target's choice after p
        tgt = seq["_argmax"].to(dev)  # cached by an earlier evaluation, maybe on another device
        toks = seq["tokens"].to(dev)
        draft = torch.stack([head.draft_to_target[head.logits(o).argmax(-1)] for o in outs])  # [k, n-1]
        starts = n - k - 2
        if starts <= 0:
            continue
        t = torch.arange(starts, device=dev)
        correct = torch.stack([draft[s, t + s] == tgt[t + s + 1] for s in range(k)])  # [k, starts]
        fed_ok = torch.stack([torch.ones_like(t, dtype=torch.bool)] +
                             [toks[t + s + 1] == tgt[t + s] for s in range(1, k)])
        run = torch.cumprod(correct.long(), 0)  # accepted-so-far indicator per step
        run_all = torch.cumprod((correct & fed_ok).long(), 0)
        on_policy = fed_ok.all(0)
        acc_on += int(run[:, on_policy].sum())
        n_on += int(on_policy.sum())
        acc_all += int(run_all.sum())
        n_all += starts
        prev = torch.cat([torch.ones_like(run[:1]), run[:-1]]).bool() & fed_ok
        step_hits += (correct & prev).sum(1).float().cpu()
        step_tries += prev.sum(1).float().cpu()
        r, e = _rounds_on_greedy_stretches(draft.cpu(), toks.cpu(), tgt.cpu(), k)
        rounds += r
        emitted += e
    return {"acc_len": 1 + acc_on / max(n_on, 1), "acc_len_all": 1 + acc_all / max(n_all, 1),
            "step_acc": [round(float(x), 3) for x in step_hits / step_tries.clamp_min(1)],
            "on_policy_starts": n_on, "tokens_per_round": round(emitted / max(rounds, 1), 4), "rounds": rounds}


def _rounds_on_greedy_stretches(draft: torch.Tensor, toks: torch.Tensor, tgt: torch.Tensor, k: int,
                                min_len: int = 8) -> tuple[int, int]:
    """Chains of k drafted round after round, as greedy decoding with verification would, along every stretch
    of at least `min_len` positions where the text is the target's greedy choice (toks[p + 1] == tgt[p]).
    draft[s, t]: step s's draft from row t (row t: token x_{t+1}; step 0 reads feature f_t, step s the chain's
    step s-1 output at row t-1), which guesses x_{t+2}.
    A round rooted at committed position m drafts x_{m+1..m+k} from rows m-1 .. m+k-2, accepts the drafts that
    equal tgt[m..] in order, and commits them plus the bonus token. Returns (rounds, tokens committed)."""
    on = (toks[1:] == tgt[:-1]).tolist()  # on[p]: x_{p+1} is the greedy choice after p
    draft, tgt, width = draft.tolist(), tgt.tolist(), draft.shape[1]
    rounds = emitted = 0
    p, n = 0, len(on)
    while p < n:
        if not on[p]:
            p += 1
            continue
        v = p
        while v < n and on[v]:
            v += 1
        if v - p >= min_len:  # positions p .. v-1 greedy: roots m in [max(p, 1), v)
            m = max(p, 1)
            while m < v:
                a = 0
                while a < k and m - 1 + a < width and m + a < v and draft[a][m - 1 + a] == tgt[m + a]:
                    a += 1
                step = min(a + 1, v - m)
                rounds += 1
                emitted += step
                m += step
        p = v
    return rounds, emitted


def evaluate(head: EagleHead, teacher: Teacher, held: list[dict], k: int,
             extra_held: dict[str, list[dict]] | None = None) -> dict:
    """heldout_acceptance on `held`, plus the same on every extra held-out set under 'extra' (by name)."""
    ev = heldout_acceptance(head, teacher, held, k)
    if extra_held:
        ev["extra"] = {name: heldout_acceptance(head, teacher, seqs, k) for name, seqs in extra_held.items()}
    return ev


def train(head: EagleHead, teacher: Teacher, train_seqs: list[dict], held: list[dict], *, steps: int,
          minutes: float | None, ttt: int, lr: float, max_len: int, accum: int, eval_every: int, eval_k: int,
          out: Path | None, save_every: int, state: dict | None = None, progress: bool = True,
          train_lm_head: bool = False, log=print, deadline: float | None = None,
          extra_held: dict[str, list[dict]] | None = None, restart_schedule: bool = False,
          precision: str = "fp32") -> dict:
    """AdamW with warmup then cosine decay; returns the last evaluation (and the history under 'history').
    minutes: training time summed over resumed runs; deadline: a time.time() at which this run stops;
    extra_held: more held-out sets evaluated with `held` (each evaluation's 'extra'); restart_schedule: a resumed
    run starts a fresh schedule at `lr` (warmup, then cosine from the resumed step to `steps`) instead of
    continuing the old one (the optimizer's moments are kept). precision: 'fp32', or 'bf16' (autocast: the
    products in bfloat16, the weights, gradients and optimizer in float32; resolve_precision picks it)."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    if not train_lm_head and head.lm_head is not None:
        head.lm_head.weight.requires_grad_(False)
    amp = precision == "bf16"
    lm_weight = frozen_lm_weight(head, amp)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = make_optimizer(params, lr)
    step0 = 0
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        step0 = state["step"]
    origin = step0 if restart_schedule else 0  # the schedule's step 0
    if restart_schedule:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] = lr
    span = max(1, steps - origin)
    warm = max(1, min(50, span // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i / span, 1.0)))))
    with warnings.catch_warnings():  # a resumed run's schedule catches up before any optimizer step (on purpose)
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        for _ in range(step0 - origin):
            sched.step()
    gen = torch.Generator().manual_seed(1234 + step0)
    order = torch.randperm(len(train_seqs), generator=gen).tolist()
    pos = (step0 * accum) % len(order)
    history = list(state.get("history", [])) if state else []
    if history:  # a resumed run: evaluate first (the held-out set or the features may have changed)
        head.eval()
        ev = evaluate(head, teacher, held, eval_k, extra_held)
        ev.update(step=step0, tokens=history[-1].get("tokens", 0), seconds=history[-1].get("seconds", 0.0),
                  resumed=True)
        history.append(ev)
        log(f"[train-eagle] step {step0} (resumed): held-out {json.dumps(ev)}")
    else:
        head.eval()
        ev = evaluate(head, teacher, held, eval_k, extra_held)
        ev.update(step=step0, tokens=0, seconds=0.0)
        history.append(ev)
        log(f"[train-eagle] step {step0}: held-out {json.dumps(ev)}")
    tokens = history[-1].get("tokens", 0)
    seconds0 = history[-1].get("seconds", 0.0)
    t_start = time.perf_counter()
    bar = tqdm(total=steps, initial=step0, desc="train-eagle", unit="step", disable=not progress)
    step = step0
    feat_w = 1.0 if head.eagle.version == 1 else 0.0
    while step < steps:
        if minutes is not None and (time.perf_counter() - t_start) / 60 + seconds0 / 60 >= minutes:
            break
        if deadline is not None and time.time() >= deadline:
            break
        batch = [train_seqs[order[(pos + i) % len(order)]] for i in range(accum)]
        pos = (pos + accum) % len(order)
        loss_sum, n = train_step(head, teacher, opt, params, batch, ttt=ttt, max_len=max_len, gen=gen,
                                 feat_weight=feat_w, amp=amp, lm_weight=lm_weight)
        tokens += n
        sched.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum:.3f}")
        last = step == steps
        if step % eval_every == 0 or last:
            head.eval()
            ev = evaluate(head, teacher, held, eval_k, extra_held)
            ev.update(step=step, loss=round(loss_sum, 4), tokens=tokens,
                      seconds=round(seconds0 + time.perf_counter() - t_start, 1))
            history.append(ev)
            log(f"[train-eagle] step {step}: held-out {json.dumps(ev)}")
        if out is not None and (step % save_every == 0 or last):
            _save(head, opt, step, history, out)
    bar.close()
    head.eval()
    if history[-1]["step"] != step:
        ev = evaluate(head, teacher, held, eval_k, extra_held)
        ev.update(step=step, tokens=tokens, seconds=round(seconds0 + time.perf_counter() - t_start, 1))
        history.append(ev)
        log(f"[train-eagle] step {step}: held-out {json.dumps(ev)}")
    if out is not None:
        _save(head, opt, step, history, out)
    result = dict(history[-1])
    result["history"] = history
    return result


def frozen_lm_weight(head: EagleHead, amp: bool) -> torch.Tensor | None:
    """Under bf16 autocast, a frozen draft lm_head's weight cast once (autocast casts a weight that needs no
    gradient again in every call: 3 casts of [16384, 1536] per sequence, ~15 % of a CPU step); else None."""
    if amp and head.lm_head is not None and not head.lm_head.weight.requires_grad:
        return head.lm_head.weight.detach().to(torch.bfloat16)
    return None


def make_optimizer(params: list, lr: float) -> torch.optim.Optimizer:
    """AdamW, the fused step where the device has it (~10x faster than the default on a 2-core CPU: 0.02 against
    0.08-0.3 s a step for the 1.5B target's head)."""
    try:
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    except (RuntimeError, TypeError):  # a device without the fused kernel
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def train_step(head: EagleHead, teacher: Teacher, opt: torch.optim.Optimizer, params: list, batch: list[dict], *,
               ttt: int, max_len: int, gen: torch.Generator, feat_weight: float = 0.0, amp: bool = False,
               lm_weight: torch.Tensor | None = None) -> tuple[float, int]:
    """One optimizer step over `batch` (gradients accumulated sequence by sequence; amp: bf16 autocast of the
    forward); returns (mean loss, sequence tokens)."""
    head.train()
    opt.zero_grad(set_to_none=True)
    loss_sum, tokens = 0.0, 0
    for seq in batch:
        with torch.autocast(head.device.type, dtype=torch.bfloat16, enabled=amp):
            loss, n = sequence_loss(head, teacher, seq, ttt, max_len, gen, feat_weight=feat_weight,
                                    lm_weight=lm_weight)
        (loss / len(batch)).backward()
        loss_sum += loss.detach().item() / len(batch)
        tokens += n
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss_sum, tokens


def _save(head: EagleHead, opt, step: int, history: list, out: Path) -> None:
    save_eagle_head(head, out, extra_config={"forerun_training": {"step": step, "last_eval": history[-1]}})
    tmp = out / "train_state.tmp"
    torch.save({"optimizer": opt.state_dict(), "step": step, "history": history}, tmp)
    tmp.replace(out / "train_state.pt")


def training_summary(out: Path, data_dir: Path, a, n_train: int, n_held: int, feat_s: float, res: dict,
                     wall_s: float, step0: int = 0) -> dict:
    """OUT/training_summary.json: what the head cost, summed over every run that built it (--resume runs
    append a session): data size, feature extraction time (data_dir/*/stats.json), training time (the
    history's clock), wall time, steps, sequence tokens seen, held-out acceptance."""
    prev = {}
    if a.resume and (out / "training_summary.json").exists():
        try:
            prev = json.loads((out / "training_summary.json").read_text())
        except ValueError:
            prev = {}
    sessions = list(prev.get("sessions", []))
    if prev and not sessions:  # written before sessions were recorded: keep what it said as the first one
        sessions.append({k: prev[k] for k in ("train_seconds", "total_seconds", "steps", "acc_len") if k in prev})
    sessions.append({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": [step0, res["step"]],
                     "precision": getattr(a, "precision_used", getattr(a, "precision", None)),
                     "corpus": getattr(a, "corpus", None), "dataset": getattr(a, "dataset", None),
                     "feature_seconds": round(feat_s, 1), "wall_seconds": round(wall_s, 1),
                     "acc_len": round(res["acc_len"], 3)})
    stats = [D.split_stats(data_dir, sp) for sp in ("train", "heldout")]
    summary = {"out": str(out), "target": a.target, "version": a.version, "train_tokens": n_train,
               "heldout_tokens": n_held,
               "feature_seconds": round(sum(s.get("seconds", 0.0) for s in stats), 1),
               "train_seconds": res["seconds"],
               "wall_seconds": round(sum(s.get("wall_seconds", s.get("total_seconds", 0.0)) for s in sessions), 1),
               "steps": res["step"], "sequence_tokens": res.get("tokens"),
               "acc_len": round(res["acc_len"], 3), "acc_len_all": round(res["acc_len_all"], 3),
               "untrained_acc_len": round(res["history"][0]["acc_len"], 3), "step_acc": res["step_acc"],
               "tokens_per_round": res.get("tokens_per_round"),
               "sessions": sessions}
    notes = [s["note"] for s in stats if s.get("note")]
    if notes:
        summary["feature_seconds_note"] = "; ".join(notes)
    return summary


def capture_answers(target, tok, data_dir: Path, a, layers: tuple[int, ...], layout: str,
                    deadline: float | None) -> tuple[int, int]:
    """--corpus distill (one pass): the target's greedy answers with their features kept as they are made
    (capture.capture_distilled), held-out split first; returns the (train, held-out) answer tokens cached."""
    from .capture import capture_distilled

    kw = dict(max_len=a.seq_len, batch=a.distill_batch, max_new=a.distill_max_new, flush=2 * a.distill_batch,
              seed=a.seed, corpus=a.corpus, quantize=layout, progress=not a.quiet, deadline=deadline,
              prompts=D.dataset_prompts(a.dataset_records) if a.dataset else None)
    held, _ = capture_distilled(target, tok, data_dir, "heldout", a.distill_heldout_tokens or a.heldout_tokens,
                                a.heldout_tokens, layers, **kw)
    train, _ = capture_distilled(target, tok, data_dir, "train", a.distill_tokens or a.train_tokens,
                                 a.train_tokens, layers, **kw)
    return train, held


def generate_answers(target, tok, data_dir: Path, a, device, deadline: float | None) -> tuple[int, int]:
    """--corpus distill: the target's greedy answers (forerun's batched engine over the loaded target), cached
    under DATA/distill/ (data.generate_distilled); returns the (train, held-out) answer tokens cached."""
    import gc

    from ..engine.llm import LLM

    llm = LLM.from_model(target, tok, device=str(device), max_num_seqs=a.distill_batch)
    kw = dict(max_new=a.distill_max_new, chunk=2 * a.distill_batch, seed=a.seed, progress=not a.quiet,
              deadline=deadline, prompts=D.dataset_prompts(a.dataset_records) if a.dataset else None)
    try:
        held = D.generate_distilled(llm, data_dir, "heldout", a.distill_heldout_tokens or a.heldout_tokens, **kw)
        train = D.generate_distilled(llm, data_dir, "train", a.distill_tokens or a.train_tokens, **kw)
    finally:
        del llm
        gc.collect()
    return train, held


DEFAULTS = {"distill_max_new": 160, "distill_batch": 16, "draft_vocab": 32000}  # flags that default to None


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="forerun train-eagle", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model: known name, GGUF file or HF folder")
    p.add_argument("--out", required=True, help="folder for the head (config.json + model.safetensors)")
    p.add_argument("--data", default=None, help="feature cache folder (default OUT/data); reused and resumed")
    p.add_argument("--version", type=int, choices=(1, 3), default=3, help="EAGLE-3 (default) or EAGLE-1/2 head")
    p.add_argument("--train-tokens", type=int, default=30000, help="target tokens of training features")
    p.add_argument("--heldout-tokens", type=int, default=3000, help="target tokens of held-out features")
    p.add_argument("--corpus", default=None, choices=sorted(D.CORPORA),
                   help="training text recipe (forerun/eagle/data.py): mix (default), code (Python only), distill "
                        "(the target's own greedy answers to instructions made from the corpus, or from --dataset's "
                        "records) or dataset (--dataset's records as they are; the default with --dataset)")
    p.add_argument("--dataset", default=None, metavar="FILE",
                   help="your own data instead of the offline corpus: JSON Lines (or a JSON array) of chat records "
                        "{\"messages\": [{\"role\", \"content\"}, ...]} or ShareGPT {\"conversations\": [{\"from\", "
                        "\"value\"}, ...]}, {\"prompt\", \"response\"} pairs (the response optional with --corpus "
                        "distill) or {\"text\"}; 5%% of the records held out by a hash of each")
    p.add_argument("--extra-data", action="append", default=[], metavar="DIR",
                   help="another feature folder (same target and layers): its train split joins training, its "
                        "held-out split is evaluated too (repeatable)")
    p.add_argument("--distill-tokens", type=int, default=None,
                   help="--corpus distill: answer tokens to generate for training (default: --train-tokens; "
                        "generation also stops once the features hold --train-tokens)")
    p.add_argument("--distill-heldout-tokens", type=int, default=None,
                   help="--corpus distill: answer tokens to generate for held-out (default: --heldout-tokens)")
    p.add_argument("--distill-max-new", type=int, default=None,
                   help=f"--corpus distill: new tokens per answer (default {DEFAULTS['distill_max_new']})")
    p.add_argument("--distill-batch", type=int, default=None,
                   help=f"--corpus distill: sequences decoded at once (default {DEFAULTS['distill_batch']})")
    p.add_argument("--distill-minutes", type=float, default=None,
                   help="--corpus distill: bound this run's generation time (what was generated is kept)")
    p.add_argument("--distill-passes", type=int, choices=(1, 2), default=None,
                   help="--corpus distill: 1 = the features kept from the forwards that answer (the default on a "
                        "CPU: 1.57x the data a minute there); 2 = the engine answers, then prompt + answer are read "
                        "again for the features (the default on a GPU, where the engine answers from CUDA graphs)")
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="the target's weights for the features, as `forerun bench` loads them (default auto: a GGUF "
                        "stays int4 where the kernel runs); drafting should run against the same layout")
    p.add_argument("--seq-len", type=int, default=384, help="longest corpus sample (tokens)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help=f"EAGLE-3 draft vocabulary size (default {DEFAULTS['draft_vocab']})")
    p.add_argument("--intermediate", type=int, default=None, help="head MLP width (default: the target's)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (upper bound)")
    p.add_argument("--minutes", type=float, default=None,
                   help="stop training after this many minutes of training (summed over --resume runs)")
    p.add_argument("--wall-minutes", type=float, default=None,
                   help="this run's wall-time bound, feature extraction included (extraction stops at 60%% of it)")
    p.add_argument("--ttt", type=int, default=3, help="training-time-test unrolled steps")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--accum", type=int, default=4, help="sequences per optimizer step")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-k", type=int, default=4, help="drafts per chain in the held-out acceptance")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--train-lm-head", action="store_true", help="also train the draft lm_head (default: frozen)")
    p.add_argument("--resume", action="store_true", help="continue from OUT's head and train_state.pt")
    p.add_argument("--restart-schedule", action="store_true",
                   help="with --resume: a fresh warmup + cosine schedule at --lr from the resumed step to --steps "
                        "(default: continue the old schedule)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="training products: auto (default) = bf16 autocast where bfloat16 products are fast (a GPU "
                        "with bf16, a CPU with AMX or AVX-512 BF16), else fp32; weights and optimizer stay fp32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _check_flags(a) -> str | None:
    """What the non-count flags allow, judged before anything loads (one line, exit code 2)."""
    import math

    if a.threads < 0:
        return f"--threads must be >= 0 (0 = torch's default), got {a.threads}"
    from ..models import hub

    problem = hub.model_problem(a.target, "target")
    if problem:
        return problem
    from ..devices import device_problem

    if device_problem(a.device):
        return device_problem(a.device)
    if not (math.isfinite(a.lr) and a.lr > 0):
        return f"--lr must be a finite number > 0, got {a.lr}"
    if a.intermediate is not None and a.intermediate < 1:
        return f"--intermediate must be >= 1, got {a.intermediate}"
    for name in ("minutes", "wall_minutes"):
        v = getattr(a, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            return f"--{name.replace('_', '-')} must be a finite number > 0 (leave it out for no limit), got {v}"
    missing = [d for d in a.extra_data if not Path(d).expanduser().is_dir()]
    if missing:
        return f"--extra-data {missing[0]}: no such folder"
    out = Path(a.out).expanduser()
    if a.resume and not (out / "train_state.pt").exists():
        return f"--resume: {out} holds no train_state.pt to resume from (leave --resume out to start a new head)"
    if a.resume and (out / "config.json").exists():  # a resumed head keeps its shape: a flag saying otherwise
        try:  # would go unheard
            have = json.loads((out / "config.json").read_text())
        except ValueError:
            have = {}
        for flag, key in (("draft_vocab", "draft_vocab_size"), ("intermediate", "intermediate_size")):
            want = getattr(a, flag)
            if want is not None and key in have and want != have[key]:
                return (f"--{flag.replace('_', '-')} {want}: the head in {out} has {have[key]}, and a resumed head keeps "
                        f"its shape (leave the flag out, or start a new head elsewhere)")
    if a.restart_schedule and not a.resume:
        return "--restart-schedule works with --resume only"
    if a.dataset is not None:
        path = Path(a.dataset).expanduser()
        if not path.is_file():
            return f"--dataset {a.dataset}: no such file"
        if a.corpus in ("code", "mix"):
            return (f"--dataset replaces the built-in corpus: use --corpus dataset (its records as they are) or "
                    f"--corpus distill (the target answers its prompts), not --corpus {a.corpus}")
        try:
            a.dataset_records = D.read_dataset(path)
        except ValueError as e:
            return str(e)
        problem = D.check_dataset(a.dataset_records, a.corpus, a.dataset)
        if problem:
            return problem
    elif a.corpus == "dataset":
        return "--corpus dataset needs --dataset FILE"
    if a.corpus != "distill":
        given = [n for n in ("distill_tokens", "distill_heldout_tokens", "distill_max_new", "distill_batch",
                             "distill_minutes", "distill_passes") if getattr(a, n) is not None]
        if given:
            return f"--{given[0].replace('_', '-')} works with --corpus distill only"
    if a.version == 1 and a.draft_vocab is not None:
        return "--draft-vocab is for EAGLE-3 heads: an EAGLE-1 head drafts over the target's whole vocabulary"
    if a.version == 1 and a.train_lm_head:
        return "--train-lm-head is for EAGLE-3 heads: an EAGLE-1 head uses the target's lm_head"
    return None


def parse_flags(argv=None) -> argparse.Namespace | str:
    """The command line judged before anything loads: the flags with DEFAULTS filled in where left out, or what
    is wrong with them (one line)."""
    a = build_parser().parse_args(argv)
    a.corpus = a.corpus or ("dataset" if a.dataset is not None else "mix")
    for name in ("train_tokens", "heldout_tokens", "distill_max_new", "distill_batch", "seq_len", "draft_vocab",
                 "steps", "ttt", "accum", "eval_every", "eval_k", "save_every"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    problem = _check_flags(a)
    if problem:
        return problem
    for name, value in DEFAULTS.items():  # None until judged: a given one may have been refused above
        if getattr(a, name) is None:
            setattr(a, name, value)
    return a


def main(argv=None) -> int:
    a = parse_flags(argv)
    if isinstance(a, str):
        print(f"forerun train-eagle: error: {a}", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    from ..models.registry import load_model

    out = Path(a.out).expanduser()
    data_dir = Path(a.data).expanduser() if a.data else out / "data"
    t0 = time.perf_counter()
    wall0 = time.time()
    deadline = wall0 + 60 * a.wall_minutes if a.wall_minutes else None
    feat_deadline = wall0 + 36 * a.wall_minutes if a.wall_minutes else None
    try:
        # packed (fast) linears only where training never needs a plain weight: an EAGLE-3 head trains against
        # its own lm_head and the teacher reads the tied embedding
        from ..models.loader import load_checkpoint
        from ..models.hub import resolve_model

        from ..models.registry import parse_quantize

        ckpt = load_checkpoint(resolve_model(a.target))
        tied = ckpt.config.tie_word_embeddings
        device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        layout = parse_quantize(a.quantize, ckpt.format, device)
        target, tok, _ = load_model(a.target, device, torch.float32, pack_cpu=a.version == 3 and tied,
                                    quantize=layout)
        lm_w = None if getattr(target.lm_head, "weight", None) is not None or tied else checkpoint_lm_head(ckpt)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"forerun train-eagle: error: {e}", file=sys.stderr)
        return 2
    target.requires_grad_(False)
    cfg = EagleConfig.for_target(target.config, version=a.version, intermediate_size=a.intermediate)
    layers = D.feature_layers(target.config.num_layers, cfg.aux_layers)
    t_gen = time.perf_counter()
    if a.corpus == "distill":
        gen_deadline = time.time() + 60 * a.distill_minutes if a.distill_minutes else feat_deadline
        passes = a.distill_passes or (1 if device.type == "cpu" else 2)
        try:
            n_gen = capture_answers(target, tok, data_dir, a, layers, layout, gen_deadline) if passes == 1 else \
                generate_answers(target, tok, data_dir, a, device, gen_deadline)
        except ValueError as e:  # (a feature folder made with other settings)
            print(f"forerun train-eagle: error: {e}", file=sys.stderr)
            return 2
        print(f"[train-eagle] distilled answers: {n_gen[0]} train + {n_gen[1]} held-out tokens "
              f"({time.perf_counter() - t_gen:.0f}s)", file=sys.stderr)
    t_feat = time.perf_counter()
    kw = dict(max_len=a.seq_len, seed=a.seed, progress=not a.quiet, deadline=feat_deadline, corpus=a.corpus,
              quantize=layout)
    if a.corpus == "dataset":  # (a feature folder holds one file's records: named by the file's hash)
        kw.update(corpus=f"dataset:{D.dataset_id(a.dataset_records)}", samples=D.dataset_samples(a.dataset_records))
    try:
        n_held = D.extract(target, tok, data_dir, layers, "heldout", a.heldout_tokens, **kw)
        n_train = D.extract(target, tok, data_dir, layers, "train", a.train_tokens, **kw)
    except ValueError as e:
        print(f"forerun train-eagle: error: {e}", file=sys.stderr)
        return 2
    feat_s = time.perf_counter() - t_feat
    print(f"[train-eagle] features: {n_train} train + {n_held} held-out tokens in {data_dir} ({feat_s:.0f}s)",
          file=sys.stderr)
    state = None
    if a.resume and (out / "train_state.pt").exists():
        head = load_eagle_head(out, target, dtype=torch.float32, device=device)
        state = torch.load(out / "train_state.pt", weights_only=True)
    else:
        draft_ids = None
        if a.version == 3:
            counts = D.token_counts(data_dir, target.config.vocab_size)
            draft_ids = choose_draft_vocab(counts, a.draft_vocab, tuple(target.config.eos_token_ids))
            cfg = EagleConfig.for_target(target.config, version=3, draft_vocab_size=draft_ids.numel(),
                                         intermediate_size=a.intermediate)
        head = init_head(target, cfg, draft_ids, a.seed, lm_w).to(device)
    teacher = Teacher(target, head, lm_w)
    train_seqs, held = D.load_split(data_dir, "train"), D.load_split(data_dir, "heldout")
    if not train_seqs or not held:
        print(f"forerun train-eagle: error: no {'training' if not train_seqs else 'held-out'} features in {data_dir} "
              f"(samples shorter than 24 tokens are skipped)", file=sys.stderr)
        return 2
    extra_held = {}
    for extra in a.extra_data:
        ed = Path(extra).expanduser()
        meta = json.loads((ed / "train" / "meta.json").read_text()) if (ed / "train" / "meta.json").exists() else {}
        if meta and sorted(meta.get("layers", [])) != sorted(layers):
            print(f"forerun train-eagle: error: {ed} holds features of layers {meta.get('layers')}, not {list(layers)}",
                  file=sys.stderr)
            return 2
        extra_train = D.load_split(ed, "train")
        train_seqs += extra_train
        extra_held[ed.name] = D.load_split(ed, "heldout")
        print(f"[train-eagle] + {ed}: {sum(x['tokens'].numel() for x in extra_train)} train tokens, "
              f"{sum(x['tokens'].numel() for x in extra_held[ed.name])} held-out tokens", file=sys.stderr)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    precision = a.precision_used = resolve_precision(a.precision, device)
    log(f"[train-eagle] precision: {precision}" + (" (--precision auto)" if a.precision == "auto" else ""))
    res = train(head, teacher, train_seqs, held, steps=a.steps, minutes=a.minutes, ttt=a.ttt, lr=a.lr,
                max_len=a.seq_len, accum=a.accum, eval_every=a.eval_every, eval_k=a.eval_k, out=out,
                save_every=a.save_every, state=state, progress=not a.quiet, log=log, train_lm_head=a.train_lm_head,
                deadline=deadline, extra_held=extra_held, restart_schedule=a.restart_schedule and state is not None,
                precision=precision)
    summary = training_summary(out, data_dir, a, n_train, n_held, feat_s, res, time.perf_counter() - t0,
                               step0=state["step"] if state else 0)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
