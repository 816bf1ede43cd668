"""Trees near a request's end (issue 13, session 10): a request with fewer tokens left than the tree is deep, or
near the context limit, drafts the tree that fits (`Engine._k_for` / `_tree_drafts`, `tree_depth_cap`) instead of
decoding its last tokens one per round. Greedy output stays plain greedy."""
from __future__ import annotations

import pytest
import torch

from forerun.config import SpecConfig
from forerun.drafters.tree_drafter import TreeShape
from forerun.sampling_params import SamplingParams

from tiny import hf_model, model_from_hf, ours_from_hf, random_eagle_head_dir, sharpen, tiny_llm, tiny_tokenizer

PROMPTS = [[5, 9, 13, 22, 40, 7], [3, 4], list(range(10, 60, 3)), [70, 71, 72, 70, 71]]


def draft_spec(draft_hf, **kw):
    runner = ours_from_hf(draft_hf)
    return SpecConfig(method="draft", draft_model=(runner.model, tiny_tokenizer(draft_hf.config.vocab_size)), **kw)


def _llm(target_hf, spec, max_model_len=None):
    llm = tiny_llm(target_hf, spec=spec, check_invariants=True)
    if max_model_len is not None:
        llm.model.max_positions = max_model_len
    if spec is not None and spec.method == "eagle":
        llm.drafter.budget = None  # the configured tree every round (the budget follows measured times)
    return llm


def test_prefix_depth():
    t = TreeShape.from_branching((2, 2, 1))  # 2 + 4 + 4 drafts
    assert [t.nodes_upto(d) for d in range(4)] == [1, 3, 7, 11]
    assert t.prefix_depth(3) == 3 and t.prefix_depth(2) == 2 and t.prefix_depth(9) == 3
    assert t.prefix_depth(3, 6) == 2 and t.prefix_depth(3, 9) == 2 and t.prefix_depth(3, 1) == 0


def test_static_tree_drafts_to_the_end():
    """The draft model is the target (every level accepted): 7 new tokens with a depth-3 tree take 2 rounds, the
    prefill round's full tree (4 tokens) and a depth-2 prefix (3 tokens). Before: 1 + 3 plain rounds."""
    target = sharpen(hf_model("llama"), 3.0)
    sp = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    plain = _llm(target, None).generate(PROMPTS, sp)
    llm = _llm(target, draft_spec(target, tree=(2, 2, 1)))
    outs = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for o in outs:
        assert o.stats.rounds == 2 and o.stats.emitted == 7
        assert o.stats.drafted == 3 + 2 and o.stats.drafted_nodes == 10 + 6  # the whole tree, then its prefix


@pytest.mark.parametrize("tree", [(2, 2, 1), (3, 1), (1, 1, 1, 1)])
def test_static_tree_near_the_end_is_lossless(tree):
    """A noisy draft model, several max_tokens (smaller than the tree's depth too): identical to plain greedy."""
    target = sharpen(hf_model("llama"), 3.0)
    other = sharpen(hf_model("llama"), 3.0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * p.std() * 0.3)
    for n in (1, 2, 3, 5, 9):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        plain = _llm(target, None).generate(PROMPTS, sp)
        outs = _llm(target, draft_spec(other, tree=tree)).generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], n
        if n >= 3:
            assert sum(o.stats.drafted_nodes for o in outs) > 0


def test_static_tree_near_the_context_limit():
    """max_model_len = prompt + 7: a (2, 2, 1) tree (10 drafts) never fitted whole, so every token was a plain round;
    now the prefix that fits the room is drafted (depth 2, then 1), with the same output."""
    target = sharpen(hf_model("llama"), 3.0)
    prompt = PROMPTS[0]
    limit = len(prompt) + 7
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    plain = _llm(target, None, max_model_len=limit).generate([prompt], sp)
    llm = _llm(target, draft_spec(target, tree=(2, 2, 1)), max_model_len=limit)
    (o,) = llm.generate([prompt], sp)
    assert o.token_ids == plain[0].token_ids and len(o.token_ids) == 7
    assert o.stats.drafted_nodes == 6 + 2  # room 6 -> depth 2 (6 drafts), room 3 -> depth 1 (2), then plain rows
    assert o.stats.rounds == 4


@pytest.fixture(scope="module")
def eagle_setup(tmp_path_factory):
    hf = hf_model("qwen2")
    return hf, random_eagle_head_dir(model_from_hf(hf), tmp_path_factory.mktemp("head") / "head")


@pytest.mark.parametrize("tree", [(3, 3, 8), (4, 4, 16), (2, 5, 12)])
def test_eagle_tree_drafts_to_the_end(eagle_setup, tree):
    """EAGLE dynamic trees: requests with max_tokens below the tree's depth draft (their steps capped at
    remaining - 1) and stay identical to plain greedy; every round after the first (no features yet) with two or
    more tokens left drafts a tree no deeper than remaining - 1."""
    hf, head = eagle_setup
    steps = tree[1]
    spec = SpecConfig(method="eagle", eagle_head=head, eagle_tree=tree)
    for n in (2, 3, steps, steps + 3):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        plain = _llm(hf, None).generate(PROMPTS, sp)
        llm = _llm(hf, spec)
        outs = llm.generate(PROMPTS, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], n
        for o in outs:
            st = o.stats
            assert len(st.drafted_at) <= n - 2  # never deeper than what was left after the first round
            if n >= 3:
                assert st.drafted >= 1  # before: no tree at all while remaining - 1 < steps


def test_eagle_tree_near_the_context_limit(eagle_setup):
    hf, head = eagle_setup
    prompt = PROMPTS[2]
    limit = len(prompt) + 6
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    plain = _llm(hf, None, max_model_len=limit).generate([prompt], sp)
    llm = _llm(hf, SpecConfig(method="eagle", eagle_head=head, eagle_tree=(3, 3, 8)), max_model_len=limit)
    drafter = llm.engine.drafter
    seen = []  # (root position, nodes) of every tree drafted: node j sits at cache position root + j
    for name in ("propose_tree", "propose_tree_async"):
        real = getattr(drafter, name, None)
        if real is None:
            continue

        def spy(requests, max_drafts=None, _real=real, _async=name.endswith("async")):
            out = _real(requests, max_drafts)
            if not _async:
                seen.extend((r.num_tokens - 1, len(t)) for r, t in zip(requests, out.tokens))
            else:
                seen.extend((r.num_tokens - 1, 1 + m) for r, m in zip(requests, max_drafts or [None] * len(requests))
                            if m is not None)
            return out

        setattr(drafter, name, spy)
    (o,) = llm.generate([prompt], sp)
    assert o.token_ids == plain[0].token_ids and len(o.token_ids) == 6
    assert o.stats.drafted_nodes > 0  # before: a 7-node tree needed 7 free positions, so none was drafted
    assert seen and all(root + n - 1 <= limit - 2 for root, n in seen), (limit, seen)  # no slot reaches the limit


def test_eagle_sampled_trees_near_the_end_run(eagle_setup):
    """Sampled and seeded requests with few tokens left draft capped trees through the exact rule (the
    distribution checks are in test_eagle.py): they finish with max_tokens tokens."""
    hf, head = eagle_setup
    llm = _llm(hf, SpecConfig(method="eagle", eagle_head=head, eagle_tree=(3, 3, 8)))
    sps = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
           SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
           SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)]
    outs = llm.generate(PROMPTS, sps)
    assert [len(o.token_ids) for o in outs] == [3, 4, 2, 5]
    assert sum(o.stats.drafted_nodes for o in outs) > 0
    # the greedy request among sampled neighbours: token for token what plain greedy decoding gives
    assert outs[2].token_ids == _llm(hf, None).generate([PROMPTS[2]], sps[2])[0].token_ids


def test_scheduler_reserves_blocks_for_the_tree_that_fits():
    """A tree cut to fit its request (k nodes beyond the root) reserves blocks for those k nodes, as a chain of k
    drafts does, not for the whole configured tree: near every request's end the whole tree's reservation made
    small pools preempt for blocks no node would use."""
    from forerun.engine.round import RoundItem

    target = sharpen(hf_model("llama"), 3.0)
    llm = _llm(target, draft_spec(target, tree=(2, 2, 1)))  # 6 nodes beyond the root
    eng = llm.engine
    kv, sched = eng.runner.kv, eng.scheduler
    r = eng.make_request(list(range(3, 10)), SamplingParams(max_tokens=4))
    kv.add_sequence(r.req_id)
    kv.reserve(r.req_id, 7)
    kv.set_length(r.req_id, 7)
    r.output_token_ids.append(3)  # 8 tokens: the round feeds the newest and drafts a tree after it
    bs = kv.block_size
    need = lambda k: sched._blocks([RoundItem(r, feed=1, final=True, k=k)])[0]  # noqa: E731
    have = -(-7 // bs)
    for k in (0, 2, 6):
        assert need(k) == max(0, -(-(8 + k) // bs) - have), k  # positions 0 .. 7 + k
