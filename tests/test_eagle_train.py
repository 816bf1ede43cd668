"""`forerun train-eagle` pieces: the held-out rounds metric and bfloat16 training (forerun/eagle/train.py).

The reference for bf16 training is the same step in float32 (the recipe's earlier, only path)."""
from __future__ import annotations

import pytest
import torch

from forerun.eagle import train as T
from forerun.models.eagle_head import EagleConfig
from forerun.runtime.runner import Chunk

from tiny import hf_model, ours_from_hf


# -- tokens per round on held-out text --------------------------------------------------------------------
def _greedy_text(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """toks [n] and tgt [n] with tgt[p] = toks[p + 1]: every position follows the target's greedy choice."""
    toks = torch.arange(100, 100 + n)
    tgt = torch.cat([toks[1:], torch.tensor([7])])
    return toks, tgt


def _right_drafts(tgt: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """draft[s, t] = the right guess for row t (x_{t+2} = tgt[t + 1])."""
    d = torch.full((k, n - 1), -1)
    for s in range(k):
        for t in range(n - 1):
            if t + 1 < n:
                d[s, t] = tgt[t + 1]
    return d


def test_rounds_metric_by_hand():
    k, n = 3, 20
    toks, tgt = _greedy_text(n)
    # all drafts right: rounds root at m = 1, 5, 9, 13, 17 and commit k + 1 = 4 tokens each (the last: what is
    # left of the stretch, positions 1 .. 18 greedy after the root's predecessor)
    d = _right_drafts(tgt, k, n)
    assert T._rounds_on_greedy_stretches(d, toks, tgt, k) == (5, 18)
    # all drafts wrong: one token per round over the 18 roots 1 .. 18
    assert T._rounds_on_greedy_stretches(torch.full((k, n - 1), -1), toks, tgt, k) == (18, 18)
    # only step 0 right: two tokens per round
    d2 = d.clone()
    d2[1:] = -1
    assert T._rounds_on_greedy_stretches(d2, toks, tgt, k) == (9, 18)
    # a wrong first draft at root 5 only: rounds 1 (4 tokens), 5 (1), 6 (4), 10, 14 (4 each), 18 (1)
    d3 = d.clone()
    d3[0, 4] = -1  # row m - 1 = 4 drafts the first token of the round rooted at m = 5
    assert T._rounds_on_greedy_stretches(d3, toks, tgt, k) == (6, 18)


def test_rounds_metric_skips_text_off_the_greedy_path():
    """A position where the text leaves the target's choice ends a stretch; stretches under min_len are not
    scored (a chain could not be drafted along them the way decoding would)."""
    k, n = 2, 30
    toks, tgt = _greedy_text(n)
    tgt = tgt.clone()
    tgt[12] = 5  # x_13 is not the greedy choice after 12: stretches 0..11 and 13..28
    tgt[25] = 5  # ... and 13..24, 26..28 (3 positions: too short)
    d = _right_drafts(tgt, k, n)
    rounds, emitted = T._rounds_on_greedy_stretches(d, toks, tgt, k, min_len=8)
    # stretch 0..11: roots 1, 4, 7, 10 (3 tokens; the last 2: what is left); stretch 13..24: roots 13, 16, 19, 22
    assert (rounds, emitted) == (8, 11 + 12)


# -- bfloat16 training ----------------------------------------------------------------------------------------
def test_resolve_precision(monkeypatch):
    cpu = torch.device("cpu")
    assert T.resolve_precision("fp32", cpu) == "fp32"
    assert T.resolve_precision("bf16", cpu) == "bf16"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    assert T.resolve_precision("auto", cpu) == "fp32"
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert T.resolve_precision("auto", cpu) == "bf16"
    with pytest.raises(ValueError, match="precision"):
        T.train(None, None, [], [], steps=1, minutes=None, ttt=1, lr=1e-3, max_len=8, accum=1, eval_every=1,
                eval_k=1, out=None, save_every=1, precision="fp16")


@pytest.fixture(scope="module")
def tiny_setup():
    """A tiny random Qwen2 target, an EAGLE-3 head for it and a few sequences of its features."""
    runner = ours_from_hf(hf_model("qwen2", num_hidden_layers=4))
    model = runner.model
    model.requires_grad_(False)
    with torch.no_grad():  # a sharper next-token distribution than random weights give (near uniform), so that
        model.model.norm.weight.mul_(8.0)  # what the head learns shows in the loss
    cfg = EagleConfig.for_target(model.config, version=3, draft_vocab_size=64, intermediate_size=96)
    layers = tuple(sorted(set(cfg.aux_layers) | {model.config.num_layers - 1}))
    g = torch.Generator().manual_seed(3)
    seqs = []
    for i in range(4):
        ids = torch.randint(2, model.config.vocab_size, (40,), generator=g).tolist()
        runner.kv.add_sequence(i)
        out, _ = runner.forward([Chunk(i, ids, logits="none")], hidden_layers=layers)
        runner.kv.free(i)
        seqs.append({"tokens": torch.tensor(ids), "feats": {l: out.hidden_states[l].clone() for l in layers}})
    ids = torch.arange(64)
    return model, cfg, ids, seqs


def _trained(setup, precision: str, steps: int):
    model, cfg, ids, seqs = setup
    head = T.init_head(model, cfg, ids, seed=1)
    teacher = T.Teacher(model, head)
    res = T.train(head, teacher, seqs, seqs[:1], steps=steps, minutes=None, ttt=2, lr=3e-3, max_len=40, accum=2,
                  eval_every=steps, eval_k=2, out=None, save_every=10**6, progress=False, log=lambda s: None,
                  precision=precision)
    return head, teacher, res


def test_teacher_stays_float32_under_autocast(tiny_setup):
    model, cfg, ids, seqs = tiny_setup
    head = T.init_head(model, cfg, ids)
    teacher = T.Teacher(model, head)
    last = seqs[0]["feats"][teacher.last]
    ref = teacher.draft_logits(last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = teacher.draft_logits(last)
    assert got.dtype == torch.float32 and torch.equal(got, ref)


def test_bf16_loss_and_gradients_track_fp32(tiny_setup):
    """One sequence's loss and gradients under bf16 autocast (the frozen lm_head cast once) against float32."""
    model, cfg, ids, seqs = tiny_setup
    head = T.init_head(model, cfg, ids, seed=1)
    head.lm_head.weight.requires_grad_(False)
    teacher = T.Teacher(model, head)
    grads = {}
    for prec in ("fp32", "bf16"):
        head.zero_grad(set_to_none=True)
        w = head.lm_head.weight.detach().to(torch.bfloat16) if prec == "bf16" else None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "bf16"):
            loss, _ = T.sequence_loss(head, teacher, seqs[0], 2, 40, torch.Generator().manual_seed(0),
                                      lm_weight=w)
        loss.backward()
        grads[prec] = (loss.item(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None})
    (l32, g32), (l16, g16) = grads["fp32"], grads["bf16"]
    assert l16 != l32 and abs(l16 - l32) <= 0.02 * abs(l32)  # bf16 products, close to float32's
    assert set(g16) == set(g32) and "fc.weight" in g32
    for n in g32:
        cos = torch.nn.functional.cosine_similarity(g16[n].flatten(), g32[n].flatten(), dim=0)
        assert cos > 0.98, (n, float(cos))


def test_bf16_training_learns_like_fp32(tiny_setup):
    """The same 30 steps from the same start: bf16 lowers the loss as float32 does, lands near its weights,
    and leaves the master weights float32 (the checkpoint's dtype)."""
    h32, t32, r32 = _trained(tiny_setup, "fp32", 30)
    h16, t16, r16 = _trained(tiny_setup, "bf16", 30)
    model, cfg, ids, seqs = tiny_setup
    fresh = T.init_head(model, cfg, ids, seed=1)
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    with torch.no_grad():
        loss0 = T.sequence_loss(fresh, T.Teacher(model, fresh), seqs[1], 2, 40, gen())[0].item()
        loss32 = T.sequence_loss(h32, t32, seqs[1], 2, 40, gen())[0].item()
        loss16 = T.sequence_loss(h16, t16, seqs[1], 2, 40, gen())[0].item()
    assert loss32 < 0.8 * loss0  # training does something at this size
    assert abs(loss16 - loss32) <= 0.1 * (loss0 - loss32)
    assert any(not torch.equal(a, b) for a, b in zip(h32.parameters(), h16.parameters()))  # bf16 did run
    for (n, a), (_, b) in zip(h32.named_parameters(), h16.named_parameters()):
        assert b.dtype == torch.float32, n
        moved = (a - fresh.state_dict()[n]).norm()
        assert (a - b).norm() <= 0.25 * moved + 1e-6, n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_training_on_cuda_tracks_the_cpu(tiny_setup):
    """The recipe on a GPU (`--device cuda`, bf16 autocast by default there): the same steps land near the
    float32 CPU run's weights."""
    model, cfg, ids, seqs = tiny_setup
    h32, _, _ = _trained(tiny_setup, "fp32", 20)
    dev = torch.device("cuda")
    model.to(dev)
    try:
        head = T.init_head(model, cfg, ids, seed=1).to(dev)
        teacher = T.Teacher(model, head)
        T.train(head, teacher, seqs, seqs[:1], steps=20, minutes=None, ttt=2, lr=3e-3, max_len=40, accum=2,
                eval_every=20, eval_k=2, out=None, save_every=10**6, progress=False, log=lambda s: None,
                precision=T.resolve_precision("auto", dev))
        fresh = T.init_head(model.to("cpu"), cfg, ids, seed=1)
        for (n, a), (_, b) in zip(h32.named_parameters(), head.named_parameters()):
            moved = (a - fresh.state_dict()[n]).norm()
            assert (a - b.cpu()).norm() <= 0.25 * moved + 1e-6, n
    finally:
        model.to("cpu")
