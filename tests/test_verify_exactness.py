"""Distribution tests (chi-square, fixed seeds): every exact path emits the target's distribution, and
the same tests reject deliberately biased samplers (power). Many i.i.d. trials run as one big batch.

Each trial drafts two tokens (chain) or a two-level tree from a draft model q, verifies it against a
target p, and records the first two tokens of the generation: the emitted ones, completed where only
one token was emitted by a plain sample of p( . | x1) (what the next round would do exactly). The
2-token prefix must follow p(x1) p(x2 | x1) over all V^2 cells. Where every draft was accepted, the third
token is the bonus sample: given x2 it must follow p( . | x2) whatever the drafts were (`_bonus_pvalue`).
"""
from __future__ import annotations

import math

import pytest
import torch

import forerun.verify.chain as chain_module
import forerun.verify.tree as tree_module
from forerun.verify import logits_to_probs, residual_weights, verify_chain, verify_tree
from scipy.stats import chi2 as chi2_dist
from test_verify_common import chi2_pvalue, const_sampling, pooled_cells

V = 8
CONFIGS = {"t0.7": dict(temperature=0.7), "t1.3": dict(temperature=1.3),
           "top_k3": dict(temperature=1.0, top_k=3), "top_p0.8": dict(temperature=1.0, top_p=0.8)}
ALPHA = 1e-3  # exact paths must pass; biased ones must fall far below
CHAIN_N = 1_000_000  # catches an accept ratio off by 1% (p < 1e-13 in every config)
TREE_N = 200_000


def _probs(logits: torch.Tensor, cfg: dict) -> torch.Tensor:
    s = const_sampling(logits.shape[0], **cfg)
    return logits_to_probs(logits, s.temperature, s.top_k, s.top_p, s.min_p)


def _world(seed: int, cfg: dict, draft_noise: float = 1.2):
    """Target and draft logits for position 1 ([V]) and position 2 given token 1 ([V, V]); the draft's logits
    are the target's plus Gaussian noise of scale draft_noise (small: most drafts accepted)."""
    g = torch.Generator().manual_seed(seed)
    t1, t2 = torch.randn(1, V, generator=g) * 1.5, torch.randn(V, V, generator=g) * 1.5
    d1, d2 = t1 + torch.randn(1, V, generator=g) * draft_noise, t2 + torch.randn(V, V, generator=g) * draft_noise
    return dict(t1=t1[0], t2=t2, p1=_probs(t1, cfg)[0], p2=_probs(t2, cfg), q1=_probs(d1, cfg)[0], q2=_probs(d2, cfg))


def _prefix_pvalue(w: dict, out: torch.Tensor, num_emitted: torch.Tensor, g: torch.Generator) -> float:
    """Smallest of two chi-square p-values, Bonferroni-corrected: the first token (V cells) and the
    2-token prefix (V^2 cells)."""
    x1 = out[:, 0]
    x2 = torch.where(num_emitted >= 2, out[:, 1], torch.multinomial(w["p2"][x1], 1, generator=g).squeeze(1))
    first = chi2_pvalue(torch.bincount(x1, minlength=V), w["p1"])
    joint = chi2_pvalue(torch.bincount(x1 * V + x2, minlength=V * V), (w["p1"].unsqueeze(1) * w["p2"]).flatten())
    return 2 * min(first, joint)


def _bonus_pvalue(w: dict, out: torch.Tensor, num_emitted: torch.Tensor) -> float:
    """Chi-square of the bonus token given the token before it: the trials that emitted 3 tokens, grouped by
    x2, each group's x3 counts against p( . | x2); the statistics and degrees of freedom add up over groups.
    Cells expected below 5 are pooled per group."""
    full = num_emitted == 3
    x2, x3 = out[full, 1], out[full, 2]
    stat, dof = 0.0, 0
    for c in range(V):
        counts = torch.bincount(x3[x2 == c], minlength=V)
        if counts.sum() == 0:
            continue
        cnt, exp = pooled_cells(counts, w["p2"][c])
        if len(cnt) > 1:
            stat += float(((cnt - exp) ** 2 / exp).sum())
            dof += len(cnt) - 1
    assert dof > 0 and int(full.sum()) > 0.2 * len(num_emitted), "too few bonus tokens for the test to have power"
    return float(chi2_dist.sf(stat, dof))


def _chain_trials(w: dict, cfg: dict, n: int, seed: int, rule: str = "rejection", bonus: bool = False) -> float:
    g = torch.Generator().manual_seed(seed)
    d1 = torch.multinomial(w["q1"], n, replacement=True, generator=g)
    d2 = torch.multinomial(w["q2"][d1], 1, generator=g).squeeze(1)
    logits = torch.stack([w["t1"].expand(n, V), w["t2"][d1], w["t2"][d2]], 1).reshape(3 * n, V)
    draft_probs = torch.stack([w["q1"].expand(n, V), w["q2"][d1], w["q2"][d2]], 1).reshape(3 * n, V)
    drafts = torch.stack([d1, d2, torch.full_like(d1, -1)], 1).flatten()
    r = verify_chain(logits, drafts, torch.arange(n) * 3, torch.full((n,), 3), const_sampling(n, **cfg),
                     torch.rand(3 * n, 2, generator=g), draft_probs=draft_probs, rule=rule)
    if bonus:
        return _bonus_pvalue(w, r.output_token_ids, r.num_emitted)
    return _prefix_pvalue(w, r.output_token_ids, r.num_emitted, g)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chain_rejection_emits_the_target_distribution(name):
    cfg = CONFIGS[name]
    assert _chain_trials(_world(1, cfg), cfg, CHAIN_N, seed=2) > ALPHA


def test_chain_test_rejects_accept_ratio_off_by_one_percent(monkeypatch):
    cfg = CONFIGS["t1.3"]
    monkeypatch.setattr(chain_module, "ratio_accept", lambda p_x, q_x, u: u * q_x * 0.99 < p_x)
    assert _chain_trials(_world(1, cfg), cfg, CHAIN_N, seed=2) < 1e-6


@pytest.mark.parametrize("name", ["t0.7", "top_k3"])
def test_chain_bonus_token_follows_the_target_given_the_last_draft(name):
    cfg = CONFIGS[name]  # a draft close to the target: most trials end with a bonus token
    assert _chain_trials(_world(1, cfg, draft_noise=0.3), cfg, CHAIN_N, seed=8, bonus=True) > ALPHA


def test_bonus_test_rejects_a_bonus_token_off_by_one_percent(monkeypatch):
    """Power: the bonus row (q = 0 there) samples p with 1% of its mass moved onto its most likely token (total
    variation 0.01 x (1 - p_max)); the residual rows are untouched, so only the bonus check can see it. Measured:
    p ~ 4e-17 (0.5% of the mass: ~1e-4, under the 1e-3 the exact paths must pass)."""
    cfg = CONFIGS["t1.3"]
    exact = chain_module.residual_weights

    def biased(p, q, alpha=1.0):
        w = exact(p, q, alpha)
        bonus = q.sum(1) == 0
        pb = p[bonus] / p[bonus].sum(1, keepdim=True)
        w[bonus] = 0.99 * pb + 0.01 * torch.nn.functional.one_hot(pb.argmax(1), pb.shape[1]).to(pb.dtype)
        return w

    monkeypatch.setattr(chain_module, "residual_weights", biased)
    assert _chain_trials(_world(1, cfg, draft_noise=0.3), cfg, CHAIN_N, seed=8, bonus=True) < 1e-6


def test_chain_test_rejects_residual_without_subtraction(monkeypatch):
    cfg = CONFIGS["t0.7"]
    monkeypatch.setattr(chain_module, "residual_weights", lambda p, q, alpha=1.0: p)
    assert _chain_trials(_world(1, cfg), cfg, CHAIN_N, seed=2) < 1e-6


# ---- trees ---------------------------------------------------------------------------------------------

TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]  # 3 children of the root, 2 children under each


def _tree_trials(w: dict, cfg: dict, n: int, seed: int, rule: str = "exact", scheme: str = "with_replacement",
                 drafted: str = "with_replacement", **kwargs) -> float:
    """drafted: how the children are drawn from q ("with_replacement", "without_replacement", or
    "top" = deterministic top-3 / top-2 of q, EAGLE-style)."""
    g = torch.Generator().manual_seed(seed)
    if drafted == "top":
        kids = w["q1"].topk(3).indices.expand(n, 3)
        grand = w["q2"][kids.reshape(-1)].topk(2).indices.view(n, 6)
    else:
        wr = drafted == "with_replacement"
        kids = torch.multinomial(w["q1"].expand(n, V), 3, replacement=wr, generator=g)
        grand = torch.multinomial(w["q2"][kids.reshape(-1)], 2, replacement=wr, generator=g).view(n, 6)
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), kids, grand], 1)  # [n, 10]
    logits = torch.cat([w["t1"].expand(n, 1, V), w["t2"][tokens[:, 1:]]], 1).reshape(10 * n, V)
    draft_probs = torch.cat([w["q1"].expand(n, 1, V), w["q2"][tokens[:, 1:]]], 1).reshape(10 * n, V)
    r = verify_tree(logits, tokens.flatten(), torch.tensor(TREE_PARENTS).repeat(n), torch.arange(n) * 10,
                    torch.full((n,), 10), const_sampling(n, **cfg), torch.rand(10 * n, 2, generator=g),
                    draft_probs=draft_probs, rule=rule, draft_scheme=scheme, max_nodes=10, **kwargs)
    return _prefix_pvalue(w, r.output_token_ids, r.num_emitted, g)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tree_exact_with_replacement_emits_the_target_distribution(name):
    cfg = CONFIGS[name]
    assert _tree_trials(_world(3, cfg), cfg, TREE_N, seed=4) > ALPHA


@pytest.mark.parametrize("name", ["t0.7", "t1.3"])
def test_tree_exact_without_replacement_emits_the_target_distribution(name):
    cfg = CONFIGS[name]
    p = _tree_trials(_world(3, cfg), cfg, TREE_N, seed=5, scheme="without_replacement", drafted="without_replacement")
    assert p > ALPHA


def test_tree_test_rejects_residual_without_normalisation(monkeypatch):
    cfg = CONFIGS["t1.3"]
    monkeypatch.setattr(tree_module, "normalised_residual", residual_weights)
    assert _tree_trials(_world(3, cfg), cfg, TREE_N, seed=4) < 1e-6


def test_tree_test_rejects_with_replacement_rule_on_distinct_children():
    cfg = CONFIGS["t1.3"]
    assert _tree_trials(_world(3, cfg), cfg, TREE_N, seed=5, drafted="without_replacement") < 1e-6


def test_target_only_is_exact_with_unit_thresholds_and_distinct_children():
    cfg = CONFIGS["t1.3"]
    assert _tree_trials(_world(6, cfg), cfg, TREE_N, seed=7, rule="target_only", drafted="top") > ALPHA


def test_target_only_with_lower_threshold_is_biased():
    cfg = CONFIGS["t1.3"]
    p = _tree_trials(_world(6, cfg), cfg, TREE_N, seed=7, rule="target_only", drafted="top", threshold_acc=0.7)
    assert p < 1e-6


# ---- the alpha-penalty residual ------------------------------------------------------------------------

def _penalty_output(p: torch.Tensor, q: torch.Tensor, alpha: float) -> torch.Tensor:
    """Exact output distribution of the penalty rule: min(p, q) + Z0 * r / Z."""
    r = residual_weights(p, q, alpha)
    z0 = (p - q).clamp_min(0).sum(-1, keepdim=True)
    return torch.minimum(p, q) + z0 * r / r.sum(-1, keepdim=True)


def test_penalty_bound_holds_analytically_on_random_distributions():
    g = torch.Generator().manual_seed(8)
    p = (torch.randn(4000, 6, generator=g, dtype=torch.float64) * 2).softmax(-1)
    q = (torch.randn(4000, 6, generator=g, dtype=torch.float64) * 2).softmax(-1)
    q[::3] = p[::3] * (1 + 0.01 * torch.rand(1334, 6, generator=g, dtype=torch.float64))  # near-equal pairs
    q = q / q.sum(-1, keepdim=True)
    for eps in (5e-5, 0.05, 0.3, 0.9):
        a = _penalty_output(p, q, 1 - eps)
        torch.testing.assert_close(a.sum(-1), torch.ones(4000, dtype=torch.float64))
        assert (a <= (1 + eps) * p + 1e-12).all()
        assert (a >= p - eps / (1 + eps) - 1e-12).all()


@pytest.mark.parametrize("eps", [0.05, 1 - math.exp(-5e-5)])
def test_penalty_counts_stay_within_the_bound(eps):
    """Target [0.5, 0.5, 0], draft [0.5, 0, 0.5]: with eps = 0.05 token 0 gets 0.5238 against the bound
    0.525, so the upper bound nearly bites; the counts must follow the penalty rule's own distribution
    and stay below (1 + eps) p N plus a 4-sigma margin (and above (p - eps/(1+eps)) N minus it)."""
    n, penalty = 200_000, -math.log(1 - eps)
    target, draft = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.5, 0.0, 0.5])
    g = torch.Generator().manual_seed(9)
    drafts = torch.multinomial(draft, n, replacement=True, generator=g)
    logits = target.log().repeat(2 * n, 1)
    r = verify_chain(logits, torch.stack([drafts, torch.full_like(drafts, -1)], 1).flatten(), torch.arange(n) * 2,
                     torch.full((n,), 2), const_sampling(n), torch.rand(2 * n, 2, generator=g),
                     draft_probs=draft.repeat(2 * n, 1), rule="penalty", penalty=penalty)
    counts = torch.bincount(r.output_token_ids[:, 0], minlength=3).double()
    margin = 4 * torch.sqrt(n * target * (1 - target))
    assert (counts <= (1 + eps) * target * n + margin).all()
    assert (counts >= (target - eps / (1 + eps)) * n - margin).all()
    output = _penalty_output(target.double().unsqueeze(0), draft.double().unsqueeze(0), 1 - eps)[0]
    assert chi2_pvalue(counts, output) > ALPHA
    if eps > 0.01:  # the bias is real and measurable: the exact target is rejected
        assert chi2_pvalue(counts, target) < 1e-6
