"""forerun.eagle.tree_sim: replaying chains and trees against a known greedy continuation gives the acceptance a
real round (draft -> target forward -> greedy verification) gives."""
from __future__ import annotations

import pytest
import torch

from forerun.config import CacheConfig
from forerun.drafters.eagle import EagleDrafter
from forerun.eagle.tree_sim import accepted_in_chain, accepted_in_tree, decode_ids, parse_shapes, parse_tree_rows, replay

from test_eagle import _request, random_head, run_rounds
from tiny import hf_model, ours_from_hf


def test_accepted_counts():
    # root 0 -> 1 (a), 2 (b); 1 -> 3 (c); 3 -> 4 (d); 2 -> 5 (c)
    toks, par = [9, 1, 2, 3, 4, 3], [-1, 0, 0, 1, 3, 2]
    assert accepted_in_tree(toks, par, [1, 3, 4, 7]) == 3
    assert accepted_in_tree(toks, par, [2, 3, 4]) == 2
    assert accepted_in_tree(toks, par, [5]) == 0
    assert accepted_in_tree(toks, par, [1, 3]) == 2  # the truth ends first
    assert accepted_in_chain([1, 2, 3], [1, 2, 4]) == 2
    assert accepted_in_chain([1, 2], [1, 2, 4]) == 2
    assert parse_shapes("4,4,16; 2,3,5") == [(4, 4, 16), (2, 3, 5)]
    assert parse_tree_rows("3,4,8; 3,4,12@0.1") == [((3, 4, 8), None), ((3, 4, 12), 0.1)]
    with pytest.raises(ValueError, match="after @"):
        parse_tree_rows("3,4,12@0")


def half_right_head(target):
    """An EAGLE-1 head that drafts the target's own next token from the feature, blurred by a random layer: the
    tiny target repeats its last token, and this head gets about half its drafts accepted."""
    head = random_head(target, 1)
    h = head.fc.weight.shape[0]
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.bias.zero_()
        head.fc.weight[:, h:] = torch.eye(h)
    return head


@pytest.mark.parametrize("tree", [False, True])
def test_replay_matches_real_rounds(tree):
    """The same head through the mini engine of test_eagle (a target forward verifies every draft) and through
    the replay: the same accepted drafts and rounds."""
    hf = hf_model("qwen2")
    target = ours_from_hf(hf, num_blocks=512)
    head = half_right_head(target.model)
    n = 20
    prompts = [[5, 6, 7, 8, 9], [11, 3, 90, 2, 2, 2, 40, 41], [60, 61]]
    kw = dict(tree_topk=3, tree_steps=3, tree_nodes=8)
    real = EagleDrafter(target, head, cache=CacheConfig(block_size=4, num_blocks=512), **kw)
    stats = {"accepted": 0, "rounds": 0}
    for i, p in enumerate(prompts):  # one request at a time (the replay's batch)
        s = run_rounds(target, real, [_request(i, p, max_tokens=n)], n, k=3, tree=tree)  # trees capped at the end
        stats["accepted"] += s["accepted"]
        stats["rounds"] += s["rounds"]
    layers = real.target_hidden_layers
    samples = [dict(decode_ids(target, p, n + 8, layers), limit=n) for p in prompts]
    trace: list = []
    got = replay(target, head, samples, k=3, shape=(3, 3, 8) if tree else None,
                 cache=CacheConfig(block_size=4, num_blocks=512), trace=trace)
    assert got["accepted"] == stats["accepted"]
    assert got["rounds"] == stats["rounds"]
    assert 0 < got["accepted"] < 3 * got["rounds"], "the check needs a head that is right only sometimes"
    assert sum(map(sum, trace)) == got["accepted"]
    # each prompt's tokens per round after its prefill: its accepted drafts plus one a round, the last cut at n
    assert got["per_prompt_tokens_per_round"] == [round((n - 1) / len(t), 3) for t in trace]
    assert len(set(got["per_prompt_tokens_per_round"])) > 1
    if tree:  # a confidence cut verifies fewer nodes a round (mean_verify_rows) and accepts no more
        cut = replay(target, head, samples, shape=(3, 3, 8), cache=CacheConfig(block_size=4, num_blocks=512),
                     confidence=0.2)
        assert cut["mean_verify_rows"] < got["mean_verify_rows"] and cut["accepted"] <= got["accepted"]


def test_engine_tail_decodes_the_end_plainly():
    """engine_tail: once fewer than `steps` + 1 tokens are left, rounds are plain (the engine before session 10)."""
    hf = hf_model("qwen2")
    target = ours_from_hf(hf, num_blocks=512)
    head = half_right_head(target.model)
    layers = (target.model.config.num_layers - 1,)
    samples = [dict(decode_ids(target, [5, 6, 7, 8, 9], 30, layers), limit=20)]
    cache = CacheConfig(block_size=4, num_blocks=512)
    free, tail = [], []
    replay(target, head, samples, shape=(3, 3, 8), cache=cache, trace=free)
    replay(target, head, samples, shape=(3, 3, 8), cache=cache, trace=tail, engine_tail=True)
    assert tail[0][-3:] == [0, 0, 0] and len(tail[0]) > len(free[0])
