"""The EAGLE dynamic tree's per-round draft budget (forerun/drafters/eagle_budget.py) and its use by EagleDrafter."""
from __future__ import annotations

import math

import pytest

from forerun.config import CacheConfig
from forerun.drafters.eagle import EagleDrafter, _Tree
from forerun.drafters.eagle_budget import LinearCost, TreeBudget, TreeBudgetPolicy, budget_ladder, subtree_value

from test_eagle import _request, plain_greedy, random_head, run_rounds
from tiny import hf_model, ours_from_hf

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]


def candidate_tree(probs=(0.6, 0.2, 0.1, 0.05), steps=4, topk=4) -> _Tree:
    """A greedy candidate tree as EagleDrafter grows it: every node of each level's `topk` best expanded by
    its top-k children, whose draft probabilities are `probs` (so a child's score = parent's + log p)."""
    tree = _Tree(0)
    level = [0]
    for _ in range(steps):
        new = []
        for node in level:
            for p in probs[:topk]:
                tree.add(node, 1, tree.score[node] + math.log(p))
                new.append(len(tree.tok) - 1)
        level = sorted(new, key=lambda j: -tree.score[j])[:topk]
    return tree


def policy_with(target_t0: float, target_per_row: float, head_t0=1e-3, head_per_row=2e-5, maximum=(4, 4, 16),
                calibration_rounds=0) -> TreeBudgetPolicy:
    """A policy whose costs were 'measured' as given (seconds) and whose trees looked like candidate_tree()."""
    pol = TreeBudgetPolicy(TreeBudget(*maximum))
    for rows in (1, 8, 64, 512):
        pol.record_target(rows, target_t0 + target_per_row * rows)
        pol.record_head_step(rows, head_t0 + head_per_row * rows)
    t = candidate_tree(topk=maximum[0], steps=maximum[1])
    for _ in range(3):
        pol.record_values(pol.tree_values(t.parent, t.depth, t.score, t.rank))
    return pol


def test_ladder_is_sub_shapes_of_the_maximum():
    ladder = budget_ladder(4, 4, 16)
    assert TreeBudget(4, 4, 16) in ladder and TreeBudget(1, 1, 1) in ladder
    assert TreeBudget(1, 4, 5) in ladder  # the chain of 4
    assert all(s.topk <= 4 and s.steps <= 4 and s.nodes <= 16 for s in ladder)
    assert all(s.nodes - 1 >= s.steps for s in ladder if s.drafts)  # no shape with levels it cannot fill


def test_subtree_value_by_hand():
    t = candidate_tree(probs=(0.5, 0.25), steps=3, topk=2)
    # chain (top-1 child at every level) of 3: 0.5 + 0.25 + 0.125
    assert subtree_value(t.parent, t.depth, t.score, t.rank, TreeBudget(1, 3, 4)) == pytest.approx(0.875)
    # width 2, one level, 3 nodes: both children of the root
    assert subtree_value(t.parent, t.depth, t.score, t.rank, TreeBudget(2, 1, 3)) == pytest.approx(0.75)
    # 3 nodes of width 2, two levels: the two best of {0.5, 0.25, 0.25, 0.125}
    assert subtree_value(t.parent, t.depth, t.score, t.rank, TreeBudget(2, 2, 3)) == pytest.approx(0.75)
    assert subtree_value(t.parent, t.depth, t.score, t.rank, TreeBudget(2, 2, 4)) == pytest.approx(1.0)
    assert subtree_value(t.parent, t.depth, t.score, t.rank, TreeBudget(1, 1, 1)) == 0.0
    # more budget never loses value
    vals = [subtree_value(t.parent, t.depth, t.score, t.rank, TreeBudget(2, 3, n)) for n in (2, 4, 6, 8)]
    assert vals == sorted(vals)


def test_budget_shrinks_as_batch_grows_when_verify_rows_get_expensive():
    """CPU-like / compute-bound target: every verify row costs (0.5 ms on top of 10 ms per forward)."""
    pol = policy_with(10e-3, 0.5e-3)
    chosen = [pol.choose(b) for b in BATCHES]
    nodes = [s.nodes for s in chosen]
    assert nodes == sorted(nodes, reverse=True), chosen  # never grows with the batch
    assert nodes[0] >= 4 and nodes[-1] < nodes[0] / 2, chosen  # and comes well down
    steps = [s.steps for s in chosen]
    assert steps == sorted(steps, reverse=True), chosen
    # at the largest batch every extra row costs more than it brings: plain decoding
    expensive = policy_with(1e-3, 2e-3)
    assert expensive.choose(128) == TreeBudget(1, 1, 1)
    # each choice really is the best of the ladder under the model (no shape with more tokens per second)
    for b, s in zip(BATCHES, chosen):
        rate = lambda x: b * pol.expected_tokens(x) / pol.round_seconds(x, b)  # noqa: E731
        assert all(rate(s) >= rate(x) * 0.9999 for x in pol.ladder if x in pol.values or not x.drafts)


def test_budget_stays_at_the_maximum_when_verify_rows_are_free():
    """Memory-bound decode (flat verify cost, cheap head): the largest tree has the most value at every batch."""
    pol = policy_with(20e-3, 0.0, head_t0=1e-5, head_per_row=0.0)
    assert [pol.choose(b) for b in BATCHES] == [TreeBudget(4, 4, 16)] * len(BATCHES)


def test_unmeasured_policy_drafts_the_maximum_and_calibration_scales_value():
    pol = TreeBudgetPolicy(TreeBudget(3, 3, 8))
    assert pol.choose(64) == TreeBudget(3, 3, 8)  # nothing measured yet
    pol = policy_with(10e-3, 0.5e-3)
    base = pol.expected_tokens(TreeBudget(4, 4, 16))
    for _ in range(200):  # the head is twice as confident as it is right
        pol.record_outcome(2.0, 1)
    assert pol.calibration == pytest.approx(0.5, abs=0.02)
    assert pol.expected_tokens(TreeBudget(4, 4, 16)) - 1 == pytest.approx((base - 1) * pol.calibration)
    # a less useful head gets smaller trees at the same batch
    fresh = policy_with(10e-3, 0.5e-3)
    assert pol.choose(4).nodes <= fresh.choose(4).nodes


def test_engine_cost_model_is_used_when_given():
    class Flat:
        def target_time(self, tokens):
            return 0.02

    class Steep:
        def target_time(self, tokens):
            return 0.001 + 0.002 * tokens

    pol = policy_with(10e-3, 0.5e-3)
    pol.target_cost = Flat()
    flat = pol.choose(64)
    pol.target_cost = Steep()
    assert pol.choose(64).nodes < flat.nodes


def test_linear_cost_fit():
    c = LinearCost()
    for x in (1, 10, 100):
        c.record(x, 0.5 + 0.01 * x)
    assert c.time(50) == pytest.approx(1.0)
    assert c.target_time(0) == pytest.approx(0.5)


def _tiny_drafter(**kw):
    hf = hf_model("qwen2")
    target = ours_from_hf(hf, num_blocks=512)
    head = random_head(target.model, 3, draft_vocab=50)
    drafter = EagleDrafter(target, head, cache=CacheConfig(block_size=4, num_blocks=512), tree_topk=3,
                           tree_steps=3, tree_nodes=8, **kw)
    return target, drafter


def test_drafter_with_adaptive_budget_is_lossless_and_shrinks_its_trees():
    """Greedy output with the per-round budget equals plain greedy; with a target whose verify rows are dear
    the drafter's trees come down below the configured maximum (and outcomes are recorded)."""

    class Steep:
        def target_time(self, tokens):
            return 1e-3 + 5e-3 * tokens

    target, drafter = _tiny_drafter(target_cost=Steep())
    prompts = [[5, 6, 7, 8, 9], [11, 3, 90, 2, 2, 2, 40, 41], [60, 61], [7, 7, 7, 1]]
    reqs = [_request(i, p) for i, p in enumerate(prompts)]
    seen = []
    orig = drafter.budget.choose

    def spy(batch):
        s = orig(batch)
        seen.append(s)
        return s

    drafter.budget.choose = spy
    run_rounds(target, drafter, reqs, 24, tree=True)
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == plain_greedy(target, p, 24)
    assert seen[0] == TreeBudget(3, 3, 8)  # unmeasured: the maximum
    assert min(s.nodes for s in seen) < 8
    assert drafter.budget.predicted > 0 and drafter.budget.head.ready
    assert drafter.cache.kv.num_free_blocks == drafter.cache.kv.num_blocks - 1


def test_drafter_measures_target_cost_itself_without_the_engine():
    target, drafter = _tiny_drafter(adaptive_budget=True)
    reqs = [_request(i, p) for i, p in enumerate([[5, 6, 7, 8, 9], [60, 61, 3]])]
    run_rounds(target, drafter, reqs, 12, tree=True)
    assert drafter.budget.target_cost is None and drafter.budget.own_target.ready
    for r, p in zip(reqs, [[5, 6, 7, 8, 9], [60, 61, 3]]):
        assert r.output_token_ids == plain_greedy(target, p, 12)


# -- forerun bench's EAGLE rows --------------------------------------------------------------------------
def _bench_args(head_dir, **over):
    import argparse

    a = dict(drafters="draft,eagle", ks="4", draft="qwen2.5-coder-0.5b-instruct", early_exit_layers=8,
             eagle_head=str(head_dir), eagle_ks="4,auto", eagle_trees="4,4,16;2,3,6", eagle_budget=True,
             model="qwen2.5-coder-1.5b-instruct", draft_vocabs="")
    a.update(over)
    return argparse.Namespace(**a)


def test_bench_eagle_rows_and_their_skip_message(tmp_path, capsys):
    from forerun.bench import _configs

    rows = _configs(_bench_args(tmp_path / "missing"))
    assert [r[0] for r in rows] == ["plain", "draft k=4"]
    assert "skipping the EAGLE rows: no EAGLE head in" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    rows = _configs(_bench_args(tmp_path, eagle_trees="4,4,16;2,3,6;3,4,12@0.10"))
    assert [r[0] for r in rows][2:] == ["eagle k=4", "eagle k=auto", "eagle tree 4,4,16", "eagle tree <=4,4,16 budget",
                                        "eagle tree 2,3,6", "eagle tree <=2,3,6 budget", "eagle tree 3,4,12 p>=0.1",
                                        "eagle tree <=3,4,12 p>=0.1 budget"]
    assert all(r[1] == f"eagle:{tmp_path}" for r in rows[2:])
    assert rows[4][3] == "4,4,16" and rows[2][3] is None
    assert rows[8][3] == "3,4,12@0.1"  # the confidence cut travels with the shape (run_forerun's SpecConfig)
    # --draft-vocabs: each draft-model row again with the draft ranking part of the vocabulary
    rows = _configs(_bench_args(tmp_path / "missing", ks="4,auto", draft_vocabs="32768,100"))
    assert [r[0] for r in rows] == ["plain", "draft k=4", "draft k=4 vocab=32768", "draft k=4 vocab=100",
                                    "draft k=auto", "draft k=auto vocab=32768", "draft k=auto vocab=100"]


def test_bench_reads_the_heads_training_record(tmp_path):
    import json

    from forerun.bench import eagle_head_info

    (tmp_path / "config.json").write_text(json.dumps({"draft_vocab_size": 16384, "intermediate_size": 4480}))
    assert eagle_head_info(tmp_path)["training"] is None  # a published head: nothing recorded
    (tmp_path / "training_summary.json").write_text(json.dumps(
        {"train_tokens": 29736, "heldout_tokens": 1654, "feature_seconds": 4243.2, "train_seconds": 3219.3,
         "steps": 202, "acc_len": 1.605, "out": "ignored"}))
    info = eagle_head_info(tmp_path)
    assert info["draft_vocab_size"] == 16384
    assert info["training"] == {"train_tokens": 29736, "heldout_tokens": 1654, "feature_seconds": 4243.2,
                                "train_seconds": 3219.3, "steps": 202, "acc_len": 1.605}


def test_training_summary_adds_up_resumed_runs(tmp_path):
    """train-eagle's OUT/training_summary.json: data size, extraction time (data/*/stats.json) and sessions."""
    import argparse
    import json

    from forerun.eagle.train import training_summary

    data = tmp_path / "data"
    for split, sec in (("train", 100.0), ("heldout", 20.0)):
        (data / split).mkdir(parents=True)
        (data / split / "stats.json").write_text(json.dumps({"seconds": sec, "tokens": 1}))
    a = argparse.Namespace(resume=False, target="t", version=3)
    res = {"step": 10, "seconds": 50.0, "tokens": 999, "acc_len": 1.2, "acc_len_all": 1.1, "step_acc": [0.2],
           "history": [{"acc_len": 1.0}]}
    first = training_summary(tmp_path, data, a, 500, 50, 120.0, res, 200.0)
    assert first["feature_seconds"] == 120.0 and first["wall_seconds"] == 200.0 and len(first["sessions"]) == 1
    (tmp_path / "training_summary.json").write_text(json.dumps(first))
    (data / "train" / "stats.json").write_text(json.dumps({"seconds": 160.0, "tokens": 2, "note": "n"}))
    a.resume = True
    res2 = dict(res, step=25, seconds=90.0, acc_len=1.4)
    second = training_summary(tmp_path, data, a, 900, 50, 60.0, res2, 80.0, step0=10)
    assert second["feature_seconds"] == 180.0 and second["train_seconds"] == 90.0
    assert second["wall_seconds"] == 280.0 and [s["steps"] for s in second["sessions"]] == [[0, 10], [10, 25]]
    assert second["train_tokens"] == 900 and second["feature_seconds_note"] == "n"
