"""Shared helpers of the verify tests (random ragged batches, chi-square), plus checks of the helpers."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from forerun.verify import SamplingTensors

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def const_sampling(num_req: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                   device: str = "cpu") -> SamplingTensors:
    full = lambda v, dt: torch.full((num_req,), v, dtype=dt, device=device)  # noqa: E731
    return SamplingTensors(full(temperature, torch.float32), full(top_k, torch.long), full(top_p, torch.float32),
                           full(min_p, torch.float32))


def mixed_sampling(num_req: int, g: torch.Generator, greedy_frac: float = 0.3) -> SamplingTensors:
    """Random per-request settings: some greedy, some with top-k / top-p / min-p."""
    rand = lambda: torch.rand(num_req, generator=g)  # noqa: E731
    temp = torch.where(rand() < greedy_frac, 0.0, 0.5 + rand())
    top_k = torch.where(rand() < 0.4, torch.randint(1, 8, (num_req,), generator=g), 0)
    top_p = torch.where(rand() < 0.4, 0.5 + 0.5 * rand(), 1.0)
    min_p = torch.where(rand() < 0.3, 0.1 * rand(), 0.0)
    return SamplingTensors(temp, top_k, top_p, min_p)


def to_device(obj, device: str):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, SamplingTensors):
        return SamplingTensors(*(to_device(t, device) for t in (obj.temperature, obj.top_k, obj.top_p, obj.min_p)))
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def random_chain_batch(g: torch.Generator, num_req: int = 40, vocab: int = 12, max_k: int = 5) -> dict:
    """Ragged chain batch (k = 0 included), requests' row blocks in shuffled order, drafts sampled
    from draft probabilities that share the requests' sampling settings."""
    seqlens = torch.randint(0, max_k + 1, (num_req,), generator=g) + 1
    order = torch.randperm(num_req, generator=g)
    ftp = torch.zeros(num_req, dtype=torch.long)
    ftp[order] = torch.cumsum(seqlens[order], 0) - seqlens[order]
    rows = int(seqlens.sum())
    sampling = mixed_sampling(num_req, g)
    row_to_req = torch.empty(rows, dtype=torch.long)
    for r in range(num_req):
        row_to_req[ftp[r]: ftp[r] + seqlens[r]] = r
    draft_logits = torch.randn(rows, vocab, generator=g) * 2
    draft_probs = sampling.probs(draft_logits, row_to_req)
    drafts = torch.multinomial(draft_probs, 1, generator=g).squeeze(1)
    drafts[ftp + seqlens - 1] = -1
    return dict(target_logits=draft_logits + torch.randn(rows, vocab, generator=g), draft_token_ids=drafts,
                first_token_positions=ftp, seqlens_q=seqlens, sampling=sampling,
                uniforms=torch.rand(rows, 2, generator=g), draft_probs=draft_probs)


def random_tree_batch(g: torch.Generator, num_req: int = 30, vocab: int = 10, max_nodes: int = 9) -> dict:
    """Random trees (parent[i] uniform in [0, i)), children drawn i.i.d. from the parent's draft probs."""
    sizes = torch.randint(1, max_nodes + 1, (num_req,), generator=g)
    ftp = torch.cumsum(sizes, 0) - sizes
    rows = int(sizes.sum())
    parents = torch.full((rows,), -1, dtype=torch.long)
    for r in range(num_req):
        for i in range(1, int(sizes[r])):
            parents[ftp[r] + i] = int(torch.randint(0, i, (1,), generator=g))
    sampling = mixed_sampling(num_req, g)
    row_to_req = torch.repeat_interleave(torch.arange(num_req), sizes)
    draft_logits = torch.randn(rows, vocab, generator=g) * 2
    draft_probs = sampling.probs(draft_logits, row_to_req)
    parent_row = torch.where(parents >= 0, ftp[row_to_req] + parents, torch.arange(rows))
    tokens = torch.multinomial(draft_probs[parent_row], 1, generator=g).squeeze(1)
    tokens[parents < 0] = 0
    return dict(target_logits=draft_logits + torch.randn(rows, vocab, generator=g), node_token_ids=tokens,
                parents=parents, first_token_positions=ftp, seqlens_q=sizes, sampling=sampling,
                uniforms=torch.rand(rows, 2, generator=g), draft_probs=draft_probs)


def emitted(result) -> list[list[int]]:
    """Per request: the emitted tokens (accepted then final)."""
    return [row[: n] for row, n in zip(result.output_token_ids.tolist(), result.num_emitted.tolist())]


def pooled_cells(counts: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(observed, expected) float64 cells of integer counts [C] against probabilities [C]: cells of probability 0
    must be empty (asserted) and are dropped; cells with expected count < 5 are pooled into one."""
    counts, probs = counts.double().flatten().cpu(), probs.double().flatten().cpu()
    assert counts[probs == 0].sum() == 0, "a token of target probability 0 was emitted"
    keep = probs > 0
    counts, probs = counts[keep], probs[keep] / probs[keep].sum()
    expected = probs * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    return counts, expected


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of integer counts [C] to probabilities [C] (cells as `pooled_cells`)."""
    counts, expected = pooled_cells(counts, probs)
    if len(counts) < 2:
        return 1.0
    return float(chisquare(np.asarray(counts), np.asarray(expected)).pvalue)


def assert_exact_with_one_point_power(counts: torch.Tensor, p: torch.Tensor) -> None:
    """The counts fit p (chi-square, p-value > 1e-3), and the same counts reject p with one point (0.01) of
    probability moved, either way, between its two likeliest tokens (p-value < 1e-3): the draws resolve a 1 % bias."""
    assert chi2_pvalue(counts, p) > 1e-3
    top = p.topk(2).indices
    for sign in (1, -1):
        biased = p.clone()
        biased[top[0]] += sign * 0.01
        biased[top[1]] -= sign * 0.01
        assert chi2_pvalue(counts, biased) < 1e-3


def test_chi2_helper_accepts_fair_and_rejects_one_percent_bias():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2])
    fair = torch.bincount(torch.multinomial(p, 1_000_000, replacement=True, generator=g), minlength=3)
    biased_p = torch.tensor([0.505, 0.297, 0.198])
    biased = torch.bincount(torch.multinomial(biased_p, 1_000_000, replacement=True, generator=g), minlength=3)
    assert chi2_pvalue(fair, p) > 1e-3
    assert chi2_pvalue(biased, p) < 1e-6


def test_chi2_helper_rejects_emission_of_zero_probability_token():
    with pytest.raises(AssertionError, match="probability 0"):
        chi2_pvalue(torch.tensor([10, 1]), torch.tensor([1.0, 0.0]))


def test_random_batches_are_well_formed():
    g = torch.Generator().manual_seed(0)
    b = random_chain_batch(g)
    assert int(b["seqlens_q"].sum()) == b["target_logits"].shape[0]
    assert (b["seqlens_q"] == 1).any(), "the ragged batch should include k = 0 requests"
    t = random_tree_batch(g)
    assert (t["parents"][t["first_token_positions"]] == -1).all()
