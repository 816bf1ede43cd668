"""logits_to_probs, sample_from_probs, compute_logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from forerun.sampling_params import SamplingParams
from forerun.verify import SamplingTensors, compute_logprobs, logits_to_probs, sample_from_probs
from forerun.verify.reference import ref_probs, ref_sample
from test_verify_common import DEVICES


def _settings(n, g):
    temp = torch.where(torch.rand(n, generator=g) < 0.2, 0.0, 0.3 + 1.5 * torch.rand(n, generator=g))
    top_k = torch.where(torch.rand(n, generator=g) < 0.5, torch.randint(1, 20, (n,), generator=g), 0)
    top_p = torch.where(torch.rand(n, generator=g) < 0.5, 0.3 + 0.7 * torch.rand(n, generator=g), 1.0)
    min_p = torch.where(torch.rand(n, generator=g) < 0.5, 0.2 * torch.rand(n, generator=g), 0.0)
    return temp, top_k, top_p, min_p


@pytest.mark.parametrize("device", DEVICES)
def test_matches_reference_row_by_row(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 50, generator=g) * 3
    logits[::7, :10] = float("-inf")  # masked tokens are allowed
    settings = _settings(200, g)
    probs = logits_to_probs(logits.to(device), *(s.to(device) for s in settings)).cpu()
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(200), atol=1e-5, rtol=0)
    for i in range(200):
        want = torch.tensor(ref_probs(logits[i], *(float(s[i]) if s.is_floating_point() else int(s[i]) for s in settings)),
                            dtype=torch.float64)
        torch.testing.assert_close(probs[i].double(), want, atol=1e-6, rtol=1e-5)


def test_matches_transformers_warpers():
    tr = pytest.importorskip("transformers.generation.logits_process")
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 100, generator=g) * 2
    for temp, k, p, m in [(0.7, 0, 1.0, 0.0), (1.3, 10, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.9, 0, 1.0, 0.1),
                          (0.8, 20, 0.9, 0.05)]:
        scores = tr.TemperatureLogitsWarper(temp)(None, logits.clone())
        if k:
            scores = tr.TopKLogitsWarper(k)(None, scores)
        if p < 1:
            scores = tr.TopPLogitsWarper(p)(None, scores)
        if m:
            scores = tr.MinPLogitsWarper(m)(None, scores)
        want = scores.softmax(-1)
        n = logits.shape[0]
        got = logits_to_probs(logits, torch.full((n,), temp), torch.full((n,), k), torch.full((n,), p),
                              torch.full((n,), m))
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_greedy_row_is_one_hot_at_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.0, 1.0, 2.0, 3.0]])
    probs = logits_to_probs(logits, torch.tensor([0.0, 1.0]), torch.tensor([2, 0]), torch.tensor([0.5, 1.0]),
                            torch.tensor([0.0, 0.0]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probs[1, 3] > probs[1, 2] > 0


def test_top_k_keeps_ties_and_top_p_keeps_the_best_token():
    logits = torch.tensor([[2.0, 2.0, 2.0, 0.0], [10.0, 0.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, torch.ones(2), torch.tensor([1, 0]), torch.tensor([1.0, 0.01]), torch.zeros(2))
    assert (probs[0, :3] > 0).all() and probs[0, 3] == 0  # k = 1 keeps all tokens tied with the best
    assert probs[1].tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad, what", [(float("nan"), "NaN"), (float("inf"), r"\+Inf")])
def test_nan_and_inf_name_row_and_request(bad, what):
    logits = torch.zeros(5, 8)
    logits[3, 2] = bad
    args = (torch.ones(5), torch.zeros(5, dtype=torch.long), torch.ones(5), torch.zeros(5))
    with pytest.raises(ValueError, match=f"row 3 .request 1. contains {what}"):
        logits_to_probs(logits, *args, row_to_req=torch.tensor([0, 0, 1, 1, 2]))
    with pytest.raises(ValueError, match=f"row 3 contains {what}"):
        logits_to_probs(logits, *args)


def test_fully_masked_row_raises():
    logits = torch.zeros(3, 4)
    logits[1] = float("-inf")
    with pytest.raises(ValueError, match="row 1 .request 7. is fully masked"):
        logits_to_probs(logits, torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(3), torch.zeros(3),
                        row_to_req=torch.tensor([6, 7, 8]))


def test_sample_inverse_cdf_matches_reference_and_skips_zero_weights():
    g = torch.Generator().manual_seed(2)
    w = torch.rand(300, 9, generator=g) * (torch.rand(300, 9, generator=g) < 0.5)
    w[:, 4] += 1e-3  # every row has mass
    u = torch.rand(300, generator=g)
    u[:5] = 1 - 2 ** -24  # largest float32 below 1: u * total may round onto the total
    got = sample_from_probs(w, u)
    assert (w[torch.arange(300), got] > 0).all()
    assert got.tolist() == [ref_sample(w[i].tolist(), float(u[i])) for i in range(300)]


def test_sample_across_blocks_matches_reference():
    """Sparse rows over several 1024-token blocks (empty blocks, a short tail block) and extreme coins."""
    g = torch.Generator().manual_seed(6)
    w = torch.rand(40, 3000, generator=g) * (torch.rand(40, 3000, generator=g) < 0.01)
    w[:, 2999] += (torch.arange(40) % 2).float()  # half the rows: a heavy token in the tail block
    w[:, 5] += 1e-4
    u = torch.rand(40, generator=g)
    u[:4] = torch.tensor([0.0, 1 - 2 ** -24, 0.5, 1 - 2 ** -24])
    got = sample_from_probs(w, u)
    assert (w[torch.arange(40), got] > 0).all()
    assert got.tolist() == [ref_sample(w[i].tolist(), float(u[i])) for i in range(40)]


def test_sample_unnormalised_tiny_weights():
    """Every weight below 2^-31 (a near-empty penalty residual): still a valid, correctly weighted token."""
    w = torch.zeros(4, 151_936)
    w[:, 100], w[:, 70_000], w[:, 151_935] = 1e-12, 3e-12, 1e-30
    assert (w < 2 ** -31).all()
    got = sample_from_probs(w, torch.tensor([0.0, 0.2, 0.3, 0.999999]))
    assert got.tolist() == [100, 100, 70_000, 70_000]


def test_compute_logprobs_raw_and_top_n():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 20, generator=g)
    tok = torch.tensor([0, 5, -1, 19, 3, 3])
    lp, top, ids = compute_logprobs(logits, tok, 3)
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(lp[[0, 1, 3, 4, 5]], ref[[0, 1, 3, 4, 5], tok[[0, 1, 3, 4, 5]]])
    assert math.isnan(lp[2])
    torch.testing.assert_close(top, ref.topk(3).values)
    assert ids.tolist() == ref.topk(3).indices.tolist()
    assert compute_logprobs(logits, tok, 0)[1] is None


def test_sampling_tensors_from_params_gather_per_row():
    s = SamplingTensors.from_params([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=-1,
                                                                                     top_p=0.9, min_p=0.05)])
    assert s.temperature.tolist() == [0.0, pytest.approx(0.7)] and s.top_k.tolist() == [0, 0]
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(7))
    probs = s.probs(logits, torch.tensor([1, 0, 1]))
    want = logits_to_probs(logits, s.temperature[[1, 0, 1]], s.top_k[[1, 0, 1]], s.top_p[[1, 0, 1]], s.min_p[[1, 0, 1]])
    assert torch.equal(probs, want) and probs[1].max() == 1.0
