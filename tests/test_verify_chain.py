"""verify_chain: the seeds' worked examples, batched == per-row reference, greedy semantics, errors."""
from __future__ import annotations

import math

import pytest
import torch

from forerun.verify import residual_weights, verify_chain
from forerun.verify.reference import ref_verify_chain
from test_verify_common import DEVICES, const_sampling, emitted, random_chain_batch, to_device


def _one_step_batch(target: list[float], draft: list[float], draft_token: torch.Tensor, uniforms: torch.Tensor):
    """N requests with one draft each (k = 1): row 2i verifies draft_token[i], row 2i+1 is the bonus row."""
    n = draft_token.shape[0]
    logits = torch.tensor(target).log().repeat(2 * n, 1)  # softmax(log p) = p at temperature 1
    draft_probs = torch.tensor(draft).repeat(2 * n, 1)
    drafts = torch.stack([draft_token, torch.full_like(draft_token, -1)], 1).flatten()
    return dict(target_logits=logits, draft_token_ids=drafts, first_token_positions=torch.arange(n) * 2,
                seqlens_q=torch.full((n,), 2), sampling=const_sampling(n), uniforms=uniforms, draft_probs=draft_probs)


def test_seed_000_worked_example_reject_then_b_or_d():
    """Draft p = [0.6, 0.3, 0.1, 0], target q = [0.4, 0.4, 0.1, 0.1]: residual [0, 0.5, 0, 0.5]; draft A
    with U = 0.8 is rejected (0.667 < 0.8); the resample is B or D, each with chance 0.5."""
    draft, target = [0.6, 0.3, 0.1, 0.0], [0.4, 0.4, 0.1, 0.1]
    res = residual_weights(torch.tensor([target]), torch.tensor([draft]))
    torch.testing.assert_close(res / res.sum(), torch.tensor([[0.0, 0.5, 0.0, 0.5]]))
    n = 20_000
    g = torch.Generator().manual_seed(0)
    uniforms = torch.rand(2 * n, 2, generator=g)
    uniforms[0::2, 0] = 0.8
    for rule in ("rejection", "penalty"):
        r = verify_chain(**_one_step_batch(target, draft, torch.zeros(n, dtype=torch.long), uniforms), rule=rule)
        assert (r.num_accepted == 0).all()
        counts = torch.bincount(r.sampled_token_ids, minlength=4)
        assert counts[0] == 0 and counts[1] + counts[3] >= n - 5  # C has weight 0 (penalty: ~2.5e-5)
        assert abs(counts[1] / n - 0.5) < 4 * math.sqrt(0.25 / n)


def test_seed_003_worked_example_20000_draws():
    """Target p = [0.6, 0.3, 0.1], draft q = [0.2, 0.3, 0.5]: token 0 always accepted, token 2 accepted
    with 0.2, every rejection becomes token 0; the first emitted token is distributed as p."""
    target, draft, n = [0.6, 0.3, 0.1], [0.2, 0.3, 0.5], 20_000
    g = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(torch.tensor(draft), n, replacement=True, generator=g)
    r = verify_chain(**_one_step_batch(target, draft, drafts, torch.rand(2 * n, 2, generator=g)), rule="rejection")
    first = r.output_token_ids[:, 0]
    freq = torch.bincount(first, minlength=3).double() / n
    for i, p in enumerate(target):
        assert abs(freq[i] - p) < 4 * math.sqrt(p * (1 - p) / n), (i, float(freq[i]))
    accepted = r.num_accepted == 1
    assert accepted[drafts == 0].all()
    rate2 = accepted[drafts == 2].double().mean()
    assert abs(rate2 - 0.2) < 4 * math.sqrt(0.16 / int((drafts == 2).sum()))
    assert (first[~accepted] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", ["greedy", "auto", "rejection", "penalty", "typical"])
def test_batched_equals_reference_on_ragged_batches(rule, device):
    g = torch.Generator().manual_seed(10)
    kwargs = dict(penalty=0.05) if rule == "penalty" else {}
    for _ in range(4):
        b = random_chain_batch(g)
        r = verify_chain(**to_device(b, device), rule=rule, **kwargs)
        ref = ref_verify_chain(*b.values(), rule=rule, **kwargs)
        assert r.num_accepted.tolist() == ref.num_accepted
        assert emitted(r) == ref.output_token_ids
        assert r.sampled_token_ids.tolist() == [o[-1] for o in ref.output_token_ids]
        assert (r.num_emitted == r.num_accepted + 1).all()


def test_greedy_rows_follow_the_argmax_chain_whatever_the_coins():
    g = torch.Generator().manual_seed(11)
    b = random_chain_batch(g)
    b["sampling"].temperature[:] = 0.0
    drafts, logits = b["draft_token_ids"], b["target_logits"]
    agree = torch.rand(drafts.shape, generator=g) < 0.7  # make long accepted prefixes likely
    b["draft_token_ids"] = torch.where((drafts >= 0) & agree, logits.argmax(-1), drafts)
    results = [verify_chain(**dict(b, uniforms=torch.rand(b["uniforms"].shape, generator=g)), rule=rule)
               for rule in ("greedy", "auto", "rejection", "typical")]
    for r in results[1:]:
        assert emitted(r) == emitted(results[0])
    for i, toks in enumerate(emitted(results[0])):
        f = int(b["first_token_positions"][i])
        want = logits[f: f + len(toks)].argmax(-1).tolist()
        assert toks == want
        assert all(b["draft_token_ids"][f + j] == t for j, t in enumerate(toks[:-1]))


def test_mixed_greedy_and_sampled_requests_in_one_batch():
    g = torch.Generator().manual_seed(12)
    b = random_chain_batch(g)
    temps = b["sampling"].temperature
    assert (temps == 0).any() and (temps > 0).any()
    r = verify_chain(**b)
    alone = verify_chain(**dict(b, rule="greedy"))
    for i in (temps == 0).nonzero().flatten().tolist():
        assert emitted(r)[i] == emitted(alone)[i]


def test_penalty_tiny_residual_returns_valid_token():
    """Uniform draft over 151,936 tokens, the target moves the drafted token's mass to the others: the
    draft is always rejected and every penalty-residual weight is below 2^-31."""
    vocab, drafted = 151_936, 1234
    q = torch.full((1, vocab), 1.0 / vocab)
    p = torch.full((1, vocab), 1.0 / (vocab - 1))
    p[0, drafted] = 0.0
    res = residual_weights(p, q, math.exp(-5e-5))
    assert (res < 2 ** -31).all() and (res > 0).sum() == vocab - 1
    logits = torch.cat([p.log(), torch.zeros(1, vocab)])
    uniforms = torch.tensor([[0.5, 0.999999], [0.1, 0.1]])
    for u_final in (0.0, 0.5, 0.999999):
        uniforms[0, 1] = u_final
        r = verify_chain(logits, torch.tensor([drafted, -1]), torch.tensor([0]), torch.tensor([2]), const_sampling(1),
                         uniforms, draft_probs=torch.cat([q, q]), rule="penalty")
        token = int(r.sampled_token_ids[0])
        assert r.num_accepted.tolist() == [0] and 0 <= token < vocab and token != drafted


def test_empty_residual_falls_back_to_target():
    p = torch.tensor([[0.25, 0.25, 0.5]])
    assert torch.equal(residual_weights(p, p.clone()), p)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_bad_logits_name_the_request(bad):
    b = random_chain_batch(torch.Generator().manual_seed(13), num_req=5)
    row = int(b["first_token_positions"][3])
    b["target_logits"][row, 0] = bad
    with pytest.raises(ValueError, match=r"request 3\) contains"):
        verify_chain(**b)


def test_all_zero_draft_distribution_names_the_request():
    b = random_chain_batch(torch.Generator().manual_seed(14), num_req=6)
    b["sampling"].temperature[:] = 1.0
    b["seqlens_q"][:] = 2
    b["first_token_positions"] = torch.arange(6) * 2
    b = dict(b, target_logits=b["target_logits"][:12], draft_probs=b["draft_probs"][:12].clone(),
             uniforms=b["uniforms"][:12], draft_token_ids=torch.tensor([1, -1] * 6))
    b["draft_probs"][8] = 0.0
    with pytest.raises(ValueError, match=r"draft_probs row 8 \(request 4\) is not a probability distribution"):
        verify_chain(**b)
    with pytest.raises(ValueError, match="needs draft_probs"):
        verify_chain(**dict(b, draft_probs=None))
    with pytest.raises(ValueError, match="rule must be one of"):
        verify_chain(**b, rule="nope")


def test_draft_probs_that_do_not_sum_to_one_are_refused():
    """0.99 * q passed as q raises every acceptance probability: refused, naming the row and request (issue 10: 12).
    Rows without a draft (the last row of each request) are not checked: they carry no q."""
    b = random_chain_batch(torch.Generator().manual_seed(15), num_req=6)
    b["sampling"].temperature[:] = 1.0
    verify_chain(**b)  # normalised: fine
    rows = (b["draft_token_ids"] >= 0).nonzero().squeeze(1)
    row = int(rows[len(rows) // 2])
    scaled = b["draft_probs"].clone()
    scaled[row] *= 0.99
    with pytest.raises(ValueError, match=rf"draft_probs row {row} \(request \d+\) sums to 0.99.*not 1"):
        verify_chain(**dict(b, draft_probs=scaled))
    last = b["first_token_positions"] + b["seqlens_q"] - 1  # no draft on these rows: anything goes
    loose = b["draft_probs"].clone()
    loose[last] *= 0.5
    verify_chain(**dict(b, draft_probs=loose))


def test_build_row_to_req_is_exported_and_matches_the_result():
    from forerun.verify import build_row_to_req

    ftp, seqlens = torch.tensor([0, 4]), torch.tensor([4, 1])
    assert build_row_to_req(ftp, seqlens).tolist() == [0, 0, 0, 0, 1]
    b = random_chain_batch(torch.Generator().manual_seed(16), num_req=7)  # shuffled row blocks
    r = verify_chain(**b)
    assert torch.equal(build_row_to_req(b["first_token_positions"], b["seqlens_q"]), r.row_to_req)
    # and it builds draft_probs with each request's settings, as the docs show
    rtr = build_row_to_req(b["first_token_positions"], b["seqlens_q"])
    logits = torch.randn(len(rtr), 12)
    want = torch.stack([b["sampling"].probs(logits[i:i + 1], rtr[i:i + 1])[0] for i in range(len(rtr))])
    assert torch.allclose(b["sampling"].probs(logits, rtr), want)
    with pytest.raises(ValueError, match="same length"):
        build_row_to_req(torch.tensor([0, 1]), torch.tensor([1]))
