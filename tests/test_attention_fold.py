"""The split attention's merge folded into the split kernel in decode steps (TritonPagedAttention.fold_merge): the
split program that arrives last at its (sequence, KV head)'s counter merges the partial softmaxes, in place of a
second kernel. Under the CPU interpreter: the same output as the separate merge kernel and the reference for decode
steps and split counts (more splits than key tiles too), the counters back at zero after every launch (so a second
launch, or a CUDA-graph replay, starts clean), the merge kernel not launched, but launched for steps of several
tokens, and a stale counter caught. The GPU's concurrent arrivals: tests/test_gpu.py (the attention matrix and the
PDL chain test, folded and not)."""
from __future__ import annotations

import pytest
import torch

from attention_cases import STEP_CASES, paged_case
from forerun.attention.reference import paged_attention_reference

triton_backend = pytest.importorskip("forerun.attention.triton_backend")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_N = 16 if DEV == "cuda" else 4  # tiles of 4 keys under the interpreter; tl.dot on a GPU wants 16


def _case(name, seed):
    q_lens, prefixes, tree, window = STEP_CASES[name]
    q, k, v, meta = paged_case(q_lens, prefixes, 4, 2, 16, 4, DEV, torch.bfloat16 if DEV == "cuda" else torch.float32,
                               seed=seed, tree=tree)
    return q, k, v, meta, window


def _counters():
    return triton_backend._counters(torch.device(DEV) if DEV == "cpu" else torch.device("cuda", 0))


@pytest.mark.parametrize("name", ["one token", "decode", "decode window"])
@pytest.mark.parametrize("splits", [2, 5, 32])
def test_folded_merge_equals_the_merge_kernel(name, splits):
    q, k, v, meta, window = _case(name, splits)
    scale = q.shape[-1] ** -0.5
    apart = triton_backend.TritonPagedAttention(block_n=BLOCK_N, num_splits=splits, fold_merge=False)
    folded = triton_backend.TritonPagedAttention(block_n=BLOCK_N, num_splits=splits, fold_merge=True)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), meta, scale, window)
    want = apart.forward(q, k, v, meta, scale, window=window)
    for _ in range(2):  # the counters are left at zero: a second launch merges as the first
        got = folded.forward(q, k, v, meta, scale, window=window)
        assert not _counters().any()
        tol = 1e-6 if DEV == "cpu" else 1e-2
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() < tol
        assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_folding_launches_no_merge_kernel_and_needs_its_counter(monkeypatch):
    q, k, v, meta, _ = _case("decode", 3)
    scale = q.shape[-1] ** -0.5
    want = triton_backend.TritonPagedAttention(block_n=BLOCK_N, num_splits=3, fold_merge=False).forward(q, k, v, meta,
                                                                                                       scale)

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the merge kernel was launched")

    monkeypatch.setattr(triton_backend, "_merge_splits_kernel", NoLaunch())
    folded = triton_backend.TritonPagedAttention(block_n=BLOCK_N, num_splits=3, fold_merge=True)
    assert torch.allclose(folded.forward(q, k, v, meta, scale).float(), want.float(), atol=1e-2, rtol=0)
    if DEV == "cpu":  # (programs run in order under the interpreter; on a GPU the outcome would be a race)
        # a counter left at 1 (a merge that never reset it): the second sequence's first KV head merges one split
        # early
        _counters()[1 * 2 + 0] = 1
        stale = folded.forward(q, k, v, meta, scale)
        _counters().zero_()
        assert (stale[1].float() - want[1].float()).abs().max() > 1e-2
        assert torch.allclose(stale[0].float(), want[0].float(), atol=1e-2, rtol=0)  # the other rows as before
    with pytest.raises(AssertionError):  # unfolded, the merge kernel runs
        triton_backend.TritonPagedAttention(block_n=BLOCK_N, num_splits=3, fold_merge=False).forward(q, k, v, meta,
                                                                                                   scale)
    q, k, v, meta, _ = _case("causal", 3)
    with pytest.raises(AssertionError):  # and for steps of several tokens, folded or not
        folded.forward(q, k, v, meta, scale)


def test_fold_is_the_default_and_can_be_switched_off(monkeypatch):
    monkeypatch.delenv("FORERUN_FOLD_MERGE", raising=False)
    assert triton_backend.TritonPagedAttention().fold_merge
    monkeypatch.setenv("FORERUN_FOLD_MERGE", "0")
    assert not triton_backend.TritonPagedAttention().fold_merge
    assert triton_backend.TritonPagedAttention(fold_merge=True).fold_merge
