"""The Triton attention kernel's first-tile preload (the attention chain under PDL, kernels/pdl.py): each split's
first tile is taken out of the loop; its keys and values cached before the step are fetched before the kernel
waits on its predecessor, the rows written in the step itself after the wait. Under the CPU interpreter (no grid
waits) the preload is forced with `TESTS_FORCE_PRELOAD`; the output must equal the plain kernel's exactly and the
reference within rounding: a single 1-token step (the shape the engine preloads in), decode batches, multi-token
causal, tree and sliding-window steps, splits with tiles of cached keys only, of both, and with none. (Which rows
are read before the wait only matters with concurrent kernels: the GPU test
tests/test_gpu.py::test_attention_chain_with_pdl_gives_the_same_logits checks that.)"""
from __future__ import annotations

import pytest
import torch

from attention_cases import STEP_CASES as CASES, paged_case
from forerun.attention.reference import paged_attention_reference

triton_backend = pytest.importorskip("forerun.attention.triton_backend")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(q_lens, prefixes, tree=False, seed=0):
    return paged_case(q_lens, prefixes, 4, 2, 16, 4, DEV, torch.bfloat16 if DEV == "cuda" else torch.float32,
                      seed=seed, tree=tree)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_preloaded_first_tile_changes_nothing(name, splits, monkeypatch):
    q_lens, prefixes, tree, window = CASES[name]
    q, k, v, meta = _case(q_lens, prefixes, tree=tree, seed=splits)
    scale = q.shape[-1] ** -0.5
    # tiles of 4 keys under the interpreter (several per sequence); tl.dot on a GPU wants at least 16
    backend = triton_backend.TritonPagedAttention(block_n=16 if DEV == "cuda" else 4, num_splits=splits)
    monkeypatch.setattr(triton_backend, "TESTS_FORCE_PRELOAD", [False])
    plain = backend.forward(q, k, v, meta, scale, window=window)
    monkeypatch.setattr(triton_backend, "TESTS_FORCE_PRELOAD", [True])
    pre = backend.forward(q, k, v, meta, scale, window=window)
    assert torch.equal(pre, plain)  # the same arithmetic in the same order
    ref = paged_attention_reference(q.float(), k.float(), v.float(), meta, scale, window)
    assert ((pre.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_the_chain_waits_in_one_token_steps_only(monkeypatch):
    """kernels/pdl.py's gate: with PDL available, steps of at most ATTENTION_ROWS (1) tokens wait, larger ones do
    not, FORERUN_PDL_ATTENTION=0 (set_attention_waits(False)) none; without PDL (the CPU) none."""
    from forerun.kernels import pdl
    t = torch.zeros(1)
    assert pdl.ATTENTION_ROWS == 1 and not pdl.attention_waits(t, 1)  # no PDL here
    monkeypatch.setattr(pdl, "enabled", lambda t: True)
    monkeypatch.setattr(pdl, "_attention", [True, pdl.ATTENTION_ROWS])
    assert pdl.attention_waits(t, 1) and not pdl.attention_waits(t, 2)
    pdl.set_attention_waits(True, max_rows=16)
    assert pdl.attention_waits(t, 16) and not pdl.attention_waits(t, 17)
    pdl.set_attention_waits(False)
    assert not pdl.attention_waits(t, 1)
