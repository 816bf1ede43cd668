"""verify_tree and the tree layout helpers: SGLang's worked examples, batched == reference, structure."""
from __future__ import annotations

import pytest
import torch

from forerun.verify import (parents_from_retrive, retrive_links, tree_attention_mask, tree_positions, verify_tree)
from forerun.verify.reference import ref_verify_tree
from test_verify_common import DEVICES, const_sampling, emitted, random_tree_batch, to_device

# SGLang's sgl-kernel test: two requests of 6 nodes; retrive_next_token / retrive_next_sibling per request.
SGL_NEXT_TOKEN = torch.tensor([1, 2, -1, 4, 5, -1, 4, 2, 3, -1, 5, -1])
SGL_NEXT_SIBLING = torch.tensor([-1, 3, -1, -1, -1, -1, -1, -1, -1, -1, 1, -1])
SGL_CANDIDATES = torch.tensor([0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12])
FTP, SIZES = torch.tensor([0, 6]), torch.tensor([6, 6])


def _sgl_logits() -> torch.Tensor:
    logits = torch.ones(2, 6, 20)
    logits[0, 0, 3] = logits[0, 3, 4] = logits[0, 4, 5] = logits[1, 0, 11] = logits[1, 4, 12] = 10
    for i in range(2):
        for j in range(6):
            if logits[i, j].max() < 10:
                logits[i, j, 18] = 10
    return logits.view(12, 20)


def test_parents_and_links_round_trip_on_sglang_example():
    parents = parents_from_retrive(SGL_NEXT_TOKEN, SGL_NEXT_SIBLING, FTP, SIZES)
    assert parents.tolist() == [-1, 0, 1, 0, 3, 4, -1, 0, 1, 2, 0, 4]
    next_token, next_sibling = retrive_links(parents, FTP, SIZES)
    assert next_token[:6].tolist() == SGL_NEXT_TOKEN[:6].tolist()  # request 0: siblings already in index order
    assert next_sibling[:6].tolist() == SGL_NEXT_SIBLING[:6].tolist()
    assert next_token[6:].tolist() == [1, 2, 3, -1, 5, -1] and next_sibling[6:].tolist() == [-1, 4, -1, -1, -1, -1]


@pytest.mark.parametrize("rule, thresholds", [("greedy", (1.0, 1.0)), ("target_only", (1.0, 1.0)),
                                              ("target_only", (0.0, 0.0))])
def test_sglang_worked_example(rule, thresholds):
    """sgl-kernel's test_tree_speculative_sampling_target_only, temperature 0.01: accept_index
    [[0, 3, 4, 5], [6, 10, 11, -1]], accept_token_num [3, 2], predicts 3 4 5 18 / 11 12 18."""
    parents = parents_from_retrive(SGL_NEXT_TOKEN, SGL_NEXT_SIBLING, FTP, SIZES)
    g = torch.Generator().manual_seed(0)
    r = verify_tree(_sgl_logits(), SGL_CANDIDATES, parents, FTP, SIZES, const_sampling(2, temperature=0.01),
                    torch.rand(12, 2, generator=g), rule=rule, threshold_single=thresholds[0],
                    threshold_acc=thresholds[1])
    assert r.accepted_rows[:, :4].tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert r.num_accepted.tolist() == [3, 2]
    assert emitted(r) == [[3, 4, 5, 18], [11, 12, 18]]
    assert r.accepted_mask.nonzero().flatten().tolist() == [3, 4, 5, 10, 11]


def _target_only_single(candidates, next_token, next_sibling, target_probs, coins, threshold_single=1.0):
    """One request given SGLang-style target_probs (logits = log p at temperature 1)."""
    n = len(candidates)
    ftp, size = torch.tensor([0]), torch.tensor([n])
    parents = parents_from_retrive(torch.tensor(next_token), torch.tensor(next_sibling), ftp, size)
    uniforms = torch.stack([torch.tensor(coins), torch.zeros(n)], 1)
    return verify_tree(torch.tensor(target_probs).log(), torch.tensor(candidates), parents, ftp, size,
                       const_sampling(1), uniforms, rule="target_only", threshold_single=threshold_single)


@pytest.mark.parametrize("threshold_single", [0.0, 1.0])
def test_sglang_zero_probability_candidate_is_never_accepted(threshold_single):
    r = _target_only_single([0, 1], [1, -1], [-1, -1], [[0.0, 0.0, 1.0, 0.0]] * 2, [0.0, 0.0], threshold_single)
    assert r.num_accepted.tolist() == [0] and r.sampled_token_ids.tolist() == [2]


def test_sglang_zero_coin_accepts_positive_probability_candidate():
    r = _target_only_single([0, 1], [1, -1], [-1, -1], [[0.0, 0.25, 0.75, 0.0], [0.0, 0.0, 1.0, 0.0]], [0.0, 0.0])
    assert r.num_accepted.tolist() == [1]


def test_sglang_coin_at_bucket_boundary_skips_zero_mass_bucket():
    r = _target_only_single([0, 1, 2, 3], [1, -1, -1, -1], [-1, 2, 3, -1],
                            [[0.0, 0.25, 0.0, 0.75]] + [[0.0, 0.0, 1.0, 0.0]] * 3, [0.25, 0.0, 0.0, 0.0])
    assert r.num_accepted.tolist() == [1] and emitted(r)[0][0] == 3


def test_target_only_final_token_excludes_rejected_children():
    # root children tokens 1 and 2 hold 0.3 + 0.3 of the mass; coin 0.9 rejects both: final from {0, 3}
    probs = [[0.2, 0.3, 0.3, 0.2]] + [[0.25] * 4] * 2
    for u in torch.linspace(0, 0.999, 30).tolist():
        n = 3
        parents = torch.tensor([-1, 0, 0])
        uniforms = torch.tensor([[0.9, u], [0.0, 0.0], [0.0, 0.0]])
        r = verify_tree(torch.tensor(probs).log(), torch.tensor([0, 1, 2]), parents, torch.tensor([0]),
                        torch.tensor([n]), const_sampling(1), uniforms, rule="target_only")
        assert r.num_accepted.tolist() == [0] and r.sampled_token_ids.item() in (0, 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule, kwargs", [
    ("greedy", {}), ("auto", {}), ("exact", {}), ("exact", dict(draft_scheme="without_replacement")),
    ("target_only", {}), ("target_only", dict(threshold_single=0.3, threshold_acc=0.6)), ("typical", {})])
def test_batched_equals_reference_on_random_trees(rule, kwargs, device):
    g = torch.Generator().manual_seed(20)
    for _ in range(4):
        b = random_tree_batch(g)
        r = verify_tree(**to_device(b, device), rule=rule, **kwargs)
        ref = ref_verify_tree(*b.values(), rule=rule, **kwargs)
        assert r.num_accepted.tolist() == ref.num_accepted
        assert emitted(r) == ref.output_token_ids
        paths = [row[: n + 1] for row, n in zip(r.accepted_nodes.tolist(), r.num_accepted.tolist())]
        assert paths == ref.accepted_nodes


def test_tree_of_one_path_equals_the_chain_greedy():
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(5, 7, generator=g)
    tokens = torch.cat([torch.tensor([0]), logits[:4].argmax(-1)])
    tokens[3] = (tokens[3] + 1) % 7  # the third draft disagrees
    r = verify_tree(logits, tokens, torch.tensor([-1, 0, 1, 2, 3]), torch.tensor([0]), torch.tensor([5]),
                    const_sampling(1, temperature=0.0), torch.rand(5, 2, generator=g))
    assert emitted(r) == [tokens[1:3].tolist() + [int(logits[2].argmax())]]


def test_tree_mask_positions():
    #        0
    #      /   \
    #     1     2          parents [-1, 0, 0, 1, 1, 2]
    #    / \     \
    #   3   4     5
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, -1, 0])  # a second request with 2 nodes
    ftp, sizes = torch.tensor([0, 6]), torch.tensor([6, 2])
    mask = tree_attention_mask(parents, ftp, sizes)
    assert mask.shape == (8, 6)
    assert mask[4].tolist() == [True, True, False, False, True, False]
    assert mask[5].tolist() == [True, False, True, False, False, True]
    assert mask[7].tolist() == [True, True, False, False, False, False]
    assert tree_positions(parents, ftp, sizes).tolist() == [0, 1, 1, 2, 2, 2, 0, 1]
    nt, ns = retrive_links(parents, ftp, sizes)
    assert nt.tolist() == [1, 3, 5, -1, -1, -1, 1, -1] and ns.tolist() == [-1, 2, -1, 4, -1, -1, -1, -1]


def test_bad_trees_and_logits_raise():
    s, u = const_sampling(1), torch.rand(3, 2)
    with pytest.raises(ValueError, match="node 2 has parent 2"):
        verify_tree(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), torch.tensor([-1, 0, 2]), torch.tensor([0]),
                    torch.tensor([3]), s, u)
    logits = torch.zeros(3, 4)
    logits[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"row 1 \(request 0\) contains NaN"):
        verify_tree(logits, torch.zeros(3, dtype=torch.long), torch.tensor([-1, 0, 0]), torch.tensor([0]),
                    torch.tensor([3]), s, u, rule="exact", draft_probs=torch.full((3, 4), 0.25))
    with pytest.raises(ValueError, match=r"draft_probs row 0 \(request 0\)"):
        verify_tree(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), torch.tensor([-1, 0, 0]), torch.tensor([0]),
                    torch.tensor([3]), s, u, rule="exact", draft_probs=torch.zeros(3, 4))


def test_verify_tree_and_verify_chain_share_the_default_rule():
    """Both default to "auto" (issue 10: 12): a sampled request passed without a rule is verified exactly,
    not silently greedily; without draft_probs it is an error, as in verify_chain."""
    import inspect

    from forerun.verify import verify_chain

    assert inspect.signature(verify_tree).parameters["rule"].default == "auto"
    assert inspect.signature(verify_chain).parameters["rule"].default == "auto"
    b = random_tree_batch(torch.Generator().manual_seed(22))
    b["sampling"].temperature[:] = 1.0
    default, auto = verify_tree(**b), verify_tree(**b, rule="auto")
    assert emitted(default) == emitted(auto) and emitted(default) != emitted(verify_tree(**b, rule="greedy"))
    with pytest.raises(ValueError, match="needs draft_probs"):
        verify_tree(**dict(b, draft_probs=None))
    scaled = b["draft_probs"].clone()
    scaled *= 0.99
    with pytest.raises(ValueError, match="sums to 0.99"):
        verify_tree(**dict(b, draft_probs=scaled))


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tree_verdict_equals_verify_tree(device, kernel):
    """The device round's greedy verdict (layout from the drafter's mask and depths, TreeRound._run_device) against
    verify_tree(rule="greedy") and the reference: random uniform trees over a 4-token vocabulary (duplicate sibling
    tokens: the first in index order wins) with integer logits (argmax ties: the first index), accepted counts,
    path nodes and emitted tokens equal; and the power check: some trees accept 3+ drafts, some none.
    kernel: forerun/kernels/tree_verdict.py (CUDA's default; the CPU runs it under Triton's interpreter), also
    over a 9000-token vocabulary (three 4096-entry chunks, argmax ties across them)."""
    from functools import partial

    from forerun.drafters.eagle import tree_mask_and_depth
    from forerun.verify import tree as T

    if kernel:
        pytest.importorskip("triton")
        if device == "cpu" and torch.cuda.is_available():
            pytest.skip("the interpreter is off beside a GPU (the kernel runs on CUDA there)")
    greedy_tree_verdict = partial(T.greedy_tree_verdict, kernel=kernel)
    g = torch.Generator().manual_seed(27)
    accepted = []
    for b, n, v in [(1, 2, 4), (7, 5, 4), (40, 9, 4), (16, 16, 4)] + ([(5, 7, 9000)] if kernel else []):
        parents = torch.full((b, n), -1, dtype=torch.long)
        for i in range(1, n):
            parents[:, i] = (torch.rand(b, generator=g) * i).long()
        logits = torch.randint(0, 3, (b * n, v), generator=g).float()  # ties
        am = logits.argmax(-1).view(b, n)
        if v > 4096:  # the maximum in a later chunk too: the lowest index must win across chunks
            logits[:, 4096 + 17] = logits[:, 5000] = 3.0
            logits[::2, 3] = 3.0
        tokens = torch.randint(0, 4 if v == 4 else v, (b, n), generator=g)
        follow = torch.rand(b, n, generator=g) < 0.6  # mostly the parent's argmax: deep paths
        tokens = torch.where(follow & (parents >= 0), am.gather(1, parents.clamp(min=0)), tokens)
        tokens[:, 0] = 0
        mask, depth = tree_mask_and_depth(parents, n)
        got = greedy_tree_verdict(*(x.to(device) for x in (logits, tokens, parents, mask, depth)))
        ref = verify_tree(logits, tokens.reshape(-1), parents.reshape(-1), torch.arange(b) * n, torch.full((b,), n),
                          const_sampling(b, temperature=0.0), torch.rand(b * n, 2, generator=g), rule="greedy")
        assert got.num_accepted.tolist() == ref.num_accepted.tolist()
        assert got.accepted_nodes.tolist() == ref.accepted_nodes.tolist()
        assert got.output_token_ids.tolist() == ref.output_token_ids.tolist()
        accepted += ref.num_accepted.tolist()
        assert bool(got.finite)
        layout = [x.to(device) for x in (tokens, parents, mask, depth)]
        for bad in (float("nan"), float("inf")):  # a non-finite row is flagged (the round then names it)
            spoiled = logits.clone()
            spoiled[b * n - 1, 1] = bad
            assert not bool(greedy_tree_verdict(spoiled.to(device), *layout).finite)
        spoiled = logits.clone()
        spoiled[0] = float("-inf")
        assert not bool(greedy_tree_verdict(spoiled.to(device), *layout).finite)
    assert max(accepted) >= 3 and min(accepted) == 0
