"""Seed 003's formulae and the statistics the API returns."""
from __future__ import annotations

import pytest

from forerun.stats import RequestStats, aggregate, expected_speedup, expected_tokens_per_round


def test_expected_tokens_worked_examples():
    assert expected_tokens_per_round(0.8, 5) == pytest.approx(3.69, abs=0.005)  # seed 000: a = 0.8, gamma = 5
    assert expected_tokens_per_round(0.8, 4) == pytest.approx(3.36, abs=0.005)  # seed 003
    assert expected_tokens_per_round(1.0, 4) == 5
    assert expected_tokens_per_round(0.0, 4) == 1


def test_expected_speedup_worked_examples():
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(2.8, abs=0.01)  # seed 003: 3.36 / 1.2
    assert expected_speedup(0.5, 4, 0.05) == pytest.approx(1.6, abs=0.02)  # 1.94 / 1.2


def test_request_stats_per_position_and_aggregate():
    a, b = RequestStats(), RequestStats()
    a.record(4, 2, 3)  # drafted 4, accepted 2, emitted 3
    a.record(4, 4, 5)
    b.record(2, 0, 1)
    assert a.acceptance_rate == 6 / 8 and a.mean_accepted_length == 3 and a.tokens_per_target_call == 4
    assert a.per_position_acceptance == [1.0, 1.0, 0.5, 0.5]
    total = aggregate([a, b])
    assert total.rounds == 3 and total.drafted == 10 and total.accepted == 6
    assert total.per_position_acceptance == [2 / 3, 2 / 3, 0.5, 0.5]
    assert total.as_dict()["tokens_per_target_call"] == 3.0


def test_tree_rounds_count_drafted_nodes():
    """A tree of 10 nodes and depth 3 that accepts 2: 10 draft tokens verified, not 3 (issue 10: 11)."""
    s = RequestStats()
    s.record(3, 2, 3, drafted_nodes=10)
    s.record(3, 3, 4, drafted_nodes=10)
    assert s.drafted == 6 and s.drafted_nodes == 20 and s.accepted == 5
    assert s.acceptance_rate == 5 / 20 and s.position_acceptance_rate == 5 / 6
    assert s.per_position_acceptance == [1.0, 1.0, 0.5]
    d = s.as_dict()
    assert d["drafted_nodes"] == 20 and d["acceptance_rate"] == 0.25
    chain = RequestStats()
    chain.record(4, 2, 3)  # a chain: nodes = positions
    assert chain.drafted_nodes == 4 and chain.acceptance_rate == chain.position_acceptance_rate == 0.5
    total = aggregate([s, chain])
    assert total.drafted_nodes == 24 and total.drafted == 10
    with pytest.raises(ValueError, match="drafted_nodes"):
        RequestStats().record(3, 1, 2, drafted_nodes=2)
