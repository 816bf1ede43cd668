"""Prefix caching (kvcache/pool.py, `enable_prefix_caching`): a prompt that starts like an earlier request's tokens
reuses their keys and values. The pool's bookkeeping alone, then the engine's outputs against the same engine with
the cache off (a reuse of wrong keys changes the next tokens), then the flags."""
from __future__ import annotations

import pytest
import torch

from forerun.config import CacheConfig, ModelConfig, SpecConfig
from forerun.engine.engine import Engine
from forerun.kvcache.pool import KVPool
from forerun.sampling_params import SamplingParams
from tiny import hf_model, ours_from_hf, sharpen, tiny_llm, tiny_tokenizer

CFG = ModelConfig(arch="llama", vocab_size=97, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=4)
BS = 4


def pool(num_blocks: int = 32) -> KVPool:
    return KVPool(CFG, CacheConfig(block_size=BS, num_blocks=num_blocks), torch.float32, "cpu", prefix_caching=True)


def run(p: KVPool, sid: int, tokens: list[int], computed: int | None = None) -> int:
    """A sequence that finds its prefix, then 'computes' the rest: each position's key is its token id + 1000 x
    its position (what a forward over the same tokens would write), and commits. Returns the tokens found."""
    hit = p.add_sequence(sid, tokens)
    n = len(tokens) if computed is None else computed
    p.reserve(sid, n)
    slots = p.slots(sid, hit, n)
    vals = torch.tensor([tokens[i] + 1000.0 * i for i in range(hit, n)])
    p.k[:, :].view(CFG.num_layers, -1, 1, 4)[:, slots] = vals.view(1, -1, 1, 1)
    p.set_length(sid, n)
    return hit


def keys_of(p: KVPool, sid: int) -> list[float]:
    slots = p.slots(sid, 0, p.length(sid))
    return p.k[1].view(-1, 1, 4)[slots][:, 0, 0].tolist()


def test_a_finished_sequences_blocks_serve_the_next_prompt_per_token():
    p = pool()
    a = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # two whole blocks and a half
    assert run(p, 0, a) == 0
    p.free(0, a)  # all of it final
    assert p.num_cached_blocks == 2  # whole blocks only
    assert p.num_free_blocks == p.num_blocks - 1  # cached blocks nobody holds count as free
    # the same two blocks, then tokens no cached block starts with: 8 found
    b = a[:8] + [40, 41, 42, 43, 44]
    assert run(p, 1, b) == 8
    assert keys_of(p, 1) == [t + 1000.0 * i for i, t in enumerate(b)]
    # a prompt that shares a block and a half: the half is copied into a block of its own
    c = a[:6] + [50, 51, 52]
    assert run(p, 2, c) == 6
    assert p.blocks(2)[0] == p.blocks(1)[0]  # the first block is shared
    assert p.blocks(2)[1] not in p.blocks(1)  # the partial one is a copy
    assert keys_of(p, 2) == [t + 1000.0 * i for i, t in enumerate(c)]
    # the same prompt again: everything but its last token is found (its logits are needed)
    p.free(1, b)
    p.free(2, c)
    assert run(p, 3, b) == len(b) - 1
    assert keys_of(p, 3) == [t + 1000.0 * i for i, t in enumerate(b)]


def test_keys_chain_the_whole_prefix():
    p = pool()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    run(p, 0, a)
    p.free(0, a)
    # the second block's tokens after another first block: not the same keys (positions and context differ)
    assert run(p, 1, [9, 9, 9, 9, 5, 6, 7, 8, 9]) == 0
    # the first token differs: nothing
    assert run(p, 2, [0] + a[1:]) == 0


def test_only_the_tokens_named_final_are_registered():
    p = pool()
    a = list(range(20, 33))  # 13 tokens: 3 whole blocks
    run(p, 0, a)
    p.free(0, a[:6])  # e.g. positions past 6 held rejected drafts
    assert p.num_cached_blocks == 1
    assert run(p, 1, a) == 4  # the first block only (the second was not named final)


def test_shared_blocks_are_held_and_never_rewritten():
    p = pool()
    a = list(range(30, 42))  # 3 blocks
    run(p, 0, a)
    p.free(0, a)
    run(p, 1, a[:9] + [77])  # holds blocks 0, 1; block 2 copied (1 token)
    shared = p.blocks(1)[:2]
    assert all(b not in p._evictable for b in shared)
    with pytest.raises(ValueError, match="shared prefix-cache blocks"):
        p.truncate(1, 7)
    p.truncate(1, 8)  # the copied block is its own: rolling back into it is fine
    p.free(1)
    assert all(b in p._evictable for b in shared)


def test_the_allocator_evicts_the_least_recently_released_and_never_a_held_block():
    p = pool(num_blocks=9)  # 8 usable blocks
    a, b = [1] * 9, [2] * 9  # 2 whole blocks each (+1 token)
    run(p, 0, a)
    p.free(0, a)
    run(p, 1, b)
    p.free(1, b)
    assert p.num_cached_blocks == 4 and p.num_free_blocks == 8
    run(p, 2, a)  # holds a's two blocks (a more recent use than b's)
    assert run(p, 2 + 1, [3] * 20) == 0  # 5 blocks: 3 never-cached + 2 evicted, b's (released before a's use)
    assert p.num_cached_blocks == 2
    with pytest.raises(Exception):
        p.reserve(3, 28)  # a's held blocks are not taken
    p.free(2, a)
    p.free(3)
    assert run(p, 4, b) == 0  # b was evicted
    p.free(4)
    assert run(p, 5, a) == 8  # a survived


def test_the_pool_keeps_its_count_whatever_is_cached():
    p = pool(num_blocks=12)
    seqs = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [7, 8, 9, 10, 11, 12, 40], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    for rep in range(3):
        for i, s in enumerate(seqs):
            run(p, 10 * rep + i, s)
        for i, s in enumerate(seqs):
            p.free(10 * rep + i, s)
        assert p.num_free_blocks == p.num_blocks - 1
        held = [b for b, c in p._cached.items() if c.holders]
        assert not held
    assert p.prefix_hits > 0 and p.prefix_queries > p.prefix_hits


# ---------------------------------------------------------------------------------------------------------- engine

SYS = [5, 9, 13, 22, 40, 7, 11, 12, 30, 31]  # a shared "system prompt" of 10 tokens (2.5 blocks of 4)
PROMPTS = [SYS + [60, 61, 62], SYS + [63, 64], SYS[:6] + [3], SYS + [60, 61, 62], SYS, [70, 71, 72, 70, 71]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return sharpen(hf_model("llama"), 3.0)


def draft_spec(seed=7, **kw):
    runner = ours_from_hf(hf_model("llama", seed=seed, num_hidden_layers=1))
    return SpecConfig(method="draft", draft_model=(runner.model, tiny_tokenizer(97)), **kw)


@pytest.mark.parametrize("spec", ["plain", "draft", "tree", "early-exit", "ngram"])
def test_greedy_outputs_with_the_cache_equal_those_without(target, spec):
    mk = {"plain": lambda: None, "draft": lambda: draft_spec(k=3), "tree": lambda: draft_spec(tree=(2, 2, 1)),
          "early-exit": lambda: SpecConfig(method="early-exit", early_exit_layers=1, k=3),
          "ngram": lambda: SpecConfig(method="ngram", k=3)}[spec]
    want = tiny_llm(target, spec=mk(), enable_prefix_caching=False).generate(PROMPTS, GREEDY)
    llm = tiny_llm(target, spec=mk(), enable_prefix_caching=True, check_invariants=True)
    got = [llm.generate([p], GREEDY)[0] for p in PROMPTS]  # one after the other: each finds the ones before
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # block size 4: the first whole blocks, then per token within the next cached block (the tokens' own prefix
    # included: prompt 0's answer is cached too, but prompt 3 = prompt 0 stops one token short of its end)
    assert [o.stats.cached_tokens for o in got] == [0, 10, 6, 12, 9, 0]
    again = llm.generate(PROMPTS, GREEDY)  # all at once, everything cached now
    assert [o.token_ids for o in again] == [o.token_ids for o in want]
    assert [o.stats.cached_tokens for o in again] == [len(p) - 1 for p in PROMPTS]
    kv = llm.runner.kv
    assert kv.num_free_blocks == kv.num_blocks - 1 and kv.num_cached_blocks > 0
    if spec in ("draft", "tree"):  # the draft model's own pool caches too
        dkv = llm.engine.drafter.kv
        assert dkv.prefix_caching and dkv.prefix_hits > 0 and dkv.num_free_blocks == dkv.num_blocks - 1


def test_a_cached_prefix_gives_the_same_logprobs(target):
    """Where the reused keys came from another request's prefill, the next token's distribution is the same (to
    float rounding: the torch path's products are not batch-invariant, the CPU C kernels' are)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    want = tiny_llm(target, enable_prefix_caching=False).generate(PROMPTS, params)
    llm = tiny_llm(target, enable_prefix_caching=True)
    got = [llm.generate([p], params)[0] for p in PROMPTS]
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        for a, b in zip(w.logprobs, g.logprobs):
            assert a["top"].keys() == b["top"].keys()
            assert all(abs(a["top"][t] - b["top"][t]) < 1e-4 for t in a["top"]), (a, b)
    assert sum(o.stats.cached_tokens for o in got) > 0


def test_seeded_sampling_is_unchanged_by_the_cache(target):
    spec = draft_spec(k=3)
    params = [SamplingParams(temperature=0.8, max_tokens=16, seed=100 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    want = tiny_llm(target, spec=spec, enable_prefix_caching=False).generate(PROMPTS, params)
    llm = tiny_llm(target, spec=draft_spec(k=3), enable_prefix_caching=True)
    got = [llm.generate([p], q)[0] for p, q in zip(PROMPTS, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.stats.cached_tokens for o in got) > 0


@pytest.mark.parametrize("which", ["target", "draft"])
def test_a_small_pool_preempts_and_evicts_with_the_same_outputs(target, which):
    spec = draft_spec(k=3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = tiny_llm(target, spec=spec, enable_prefix_caching=False).generate(PROMPTS, params)
    small = CacheConfig(block_size=4, num_blocks=24)
    kw = {"cache": small} if which == "target" else {"draft_cache": small}
    llm = tiny_llm(target, spec=draft_spec(k=3), check_invariants=True, enable_prefix_caching=True, **kw)
    for _ in range(2):
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert llm.engine.stats().num_preemptions > 0
    for kv in (llm.runner.kv, llm.engine.drafter.kv):
        assert kv.num_free_blocks == kv.num_blocks - 1


def test_an_aborted_request_leaves_the_pools_whole(target):
    eng = Engine.from_model(ours_from_hf(target).model, tiny_tokenizer(97), spec=draft_spec(k=3), device="cpu",
                            cache=CacheConfig(block_size=4, num_blocks=256), enable_prefix_caching=True,
                            check_invariants=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), request_id=str(i))
    for _ in range(3):
        eng.step()
    for i in range(len(PROMPTS)):
        eng.abort(str(i))
    assert not eng.has_unfinished()
    for kv in (eng.runner.kv, eng.drafter.kv):
        assert kv.num_free_blocks == kv.num_blocks - 1
    out = tiny_llm(target, enable_prefix_caching=False).generate(PROMPTS[:1], GREEDY)[0].token_ids
    eng.add_request(PROMPTS[0], GREEDY, request_id="again")
    got = []
    while eng.has_unfinished():
        for d in eng.step():
            got.extend(d.new_token_ids)
    assert got == out


def eagle_spec(head, **kw):
    return SpecConfig(method="eagle", eagle_head=head, **kw)


def recorded_drafts(llm) -> list:
    """Wrap the EAGLE drafter's proposals: every round's drafted tokens (chain) or tree tokens, in order."""
    d, log = llm.engine.drafter, []
    chain, tree = d.propose, d.propose_tree_async

    def propose(requests, ks):
        out = chain(requests, ks)
        log.append(("chain", [list(t) for t in out.resolve()]))
        return out

    def propose_tree_async(requests, max_drafts=None):
        draft = tree(requests, max_drafts)
        finish = draft.result

        def result():
            out = finish()
            log.append(("tree", out.tokens, out.parents))
            return out
        draft.result = result
        return draft
    d.propose, d.propose_tree_async = propose, propose_tree_async
    return log


@pytest.mark.parametrize("tree", [None, (2, 2, 5)])
def test_eagle_heads_cache_their_rows_by_token_pairs(target, tmp_path, tree):
    """EAGLE with prefix caching: the head's own pool caches its rows, named by (token, next token) pairs, since row
    i reads the target's state at i and token i + 1. Outputs equal plain decoding's and every draft equals the one
    the uncached engine drafts (a row reused under the wrong name would change the head's attention); the target
    takes from its cache no more positions than the head holds (prompt 1 = SYS + [63, 64] after SYS + [60, ...]:
    the target alone would find 10 tokens, the head's row 9 pairs SYS's last token with 60, so 9)."""
    from tiny import random_eagle_head_dir

    head = random_eagle_head_dir(ours_from_hf(target).model, tmp_path / "head")
    spec = lambda: eagle_spec(head, k=3) if tree is None else eagle_spec(head, eagle_tree=tree)  # noqa: E731
    want_llm = tiny_llm(target, spec=spec(), enable_prefix_caching=False)
    want_log = recorded_drafts(want_llm)
    want = [want_llm.generate([p], GREEDY)[0] for p in PROMPTS]
    llm = tiny_llm(target, spec=spec(), enable_prefix_caching=True, check_invariants=True)
    log = recorded_drafts(llm)
    got = [llm.generate([p], GREEDY)[0] for p in PROMPTS]
    plain = tiny_llm(target, enable_prefix_caching=False).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want] == [o.token_ids for o in plain]
    assert log == want_log and sum(o.stats.drafted for o in got) > 0
    assert [o.stats.cached_tokens for o in got] == [0, 9, 5, 12, 9, 0]
    hkv = llm.engine.drafter.kv
    assert hkv.prefix_caching and hkv.prefix_hits > 0
    for kv in (llm.runner.kv, hkv):
        assert kv.num_free_blocks == kv.num_blocks - 1 and kv.num_cached_blocks > 0


def test_the_target_reuses_no_more_than_the_eagle_head_holds(target, tmp_path):
    """The head's pool forgets A's rows (reset) while the target's keeps A's prompt: B = A's prompt with another
    end then takes nothing from the target's cache either, and drafts (with B reading 10 cached target positions
    the head would have no target states for its rows 0-9, and never draft)."""
    from tiny import random_eagle_head_dir

    head = random_eagle_head_dir(ours_from_hf(target).model, tmp_path / "head")
    llm = tiny_llm(target, spec=eagle_spec(head, k=3), enable_prefix_caching=True, check_invariants=True)
    a, b = SYS + [60, 61, 62], SYS + [63, 64]
    llm.generate([a], GREEDY)
    hkv = llm.engine.drafter.kv
    assert hkv.num_cached_blocks > 0 and hkv.reset_prefix_cache() and hkv.num_cached_blocks == 0
    assert hkv.num_free_blocks == hkv.num_blocks - 1
    assert llm.runner.kv.add_sequence(99, b) == 10  # the target's pool alone still holds A's prompt
    llm.runner.kv.free(99)
    out = llm.generate([b], GREEDY)[0]
    assert out.stats.cached_tokens == 0 and out.stats.drafted > 0
    assert out.token_ids == tiny_llm(target, enable_prefix_caching=False).generate([b], GREEDY)[0].token_ids
    assert llm.reset_prefix_cache()  # every pool, from the public API (nothing runs: all of it goes)
    for kv in (llm.runner.kv, hkv):
        assert kv.num_cached_blocks == 0 and kv.num_free_blocks == kv.num_blocks - 1


def test_compare_plain_times_both_runs_without_the_warm_up_in_the_cache(target):
    """`forerun generate --compare-plain` warms the speculative engine up on the prompt, then empties its prefix
    cache: both timed runs read the whole prompt (with the warm-up's blocks left, the speculative run found 12 of its
    13 tokens and looked faster than it is)."""
    from forerun.cli import compare_with_plain

    llm = tiny_llm(target, spec=draft_spec(k=3))
    plain = tiny_llm(target)
    (base, _), (outs, _) = compare_with_plain(llm, plain, PROMPTS[:1], GREEDY, chat=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert [o.stats.cached_tokens for o in outs + base] == [0, 0]


def test_the_engine_caches_prefixes_by_default(target):
    """On by default, as in vLLM, SGLang and llama.cpp's server (`enable_prefix_caching=False` turns it off)."""
    llm = tiny_llm(target)
    assert llm.engine.prefix_caching and llm.runner.kv.prefix_caching
    got = [llm.generate([p], GREEDY)[0] for p in PROMPTS[:2]]
    assert got[1].stats.cached_tokens == 10
    off = tiny_llm(target, enable_prefix_caching=False)
    assert not off.runner.kv.prefix_caching
    assert [off.generate([p], GREEDY)[0].stats.cached_tokens for p in PROMPTS[:2]] == [0, 0]


def test_server_reports_cached_tokens_in_usage_and_metrics(target):
    import httpx

    from forerun.server.app import ServerConfig, build_app
    from test_server import Running, metrics

    eng = Engine.from_model(ours_from_hf(target).model, tiny_tokenizer(97), spec=draft_spec(k=3), device="cpu",
                            cache=CacheConfig(block_size=4, num_blocks=512), enable_prefix_caching=True)
    run = Running(build_app(eng, config=ServerConfig(model_names=("tiny",), max_num_seqs=8, max_queue=16,
                                                     max_body_bytes=1 << 20, default_max_tokens=16)))
    try:
        want = tiny_llm(target, enable_prefix_caching=False).generate(PROMPTS[:2], GREEDY)
        got = []
        for p in PROMPTS[:2]:
            r = httpx.post(run.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            got.append(r.json())
        assert [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got] == [0, 10]
        tok = tiny_tokenizer(97)
        assert [g["choices"][0]["text"] for g in got] == [tok.decode(w.token_ids) for w in want]
        m = metrics(run.url)
        assert m["forerun:prefix_cache_hits_total"] == 10
        assert m["forerun:prefix_cache_queries_total"] == len(PROMPTS[0]) + len(PROMPTS[1])
    finally:
        run.stop()


@pytest.mark.parametrize("which", ["draft", "eagle"])
def test_a_running_requests_prompt_serves_a_later_arrival(target, tmp_path, which):
    """A prompt's blocks are lent to the cache once it is read (all but its last token), not only when its request
    ends: B arrives while A decodes and reads A's prompt from the cache, in both pools (a draft model's, an EAGLE
    head's: its rows of A's prompt once fed); both outputs as alone."""
    if which == "eagle":
        from tiny import random_eagle_head_dir

        spec = eagle_spec(random_eagle_head_dir(ours_from_hf(target).model, tmp_path / "head"), k=3)
    else:
        spec = draft_spec(k=3)
    eng = Engine.from_model(ours_from_hf(target).model, tiny_tokenizer(97), spec=spec, device="cpu",
                            cache=CacheConfig(block_size=4, num_blocks=256), enable_prefix_caching=True,
                            check_invariants=True)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a, b = SYS + [60, 61, 62, 63, 64, 65], SYS + [60, 61, 62, 63, 70]
    eng.add_request(a, long, request_id="a")
    got = {"a": [], "b": []}
    for _ in range(3):
        for d in eng.step():
            got[d.request_id].extend(d.new_token_ids)
    assert eng.runner.kv.num_cached_blocks == 3  # A's prompt: 16 tokens, 15 final: 3 whole blocks
    eng.add_request(b, GREEDY, request_id="b")
    while eng.has_unfinished():
        for d in eng.step():
            got[d.request_id].extend(d.new_token_ids)
            if d.finished and d.request_id == "b":
                assert d.stats.cached_tokens == 12  # A's 3 lent blocks (its 4th is not final while A runs)
    assert got["a"] == tiny_llm(target, enable_prefix_caching=False).generate([a], long)[0].token_ids
    assert got["b"] == tiny_llm(target, enable_prefix_caching=False).generate([b], GREEDY)[0].token_ids
    assert eng.drafter.kv.prefix_hits > 0
    for kv in (eng.runner.kv, eng.drafter.kv):
        assert kv.num_free_blocks == kv.num_blocks - 1


def test_share_prefix_holds_the_blocks_for_their_owner():
    p = pool()
    a = list(range(40, 53))  # 13 tokens
    run(p, 0, a)
    p.share_prefix(0, a[:12])
    assert p.num_cached_blocks == 3 and p.num_free_blocks == p.num_blocks - 1 - 4
    with pytest.raises(ValueError, match="shared prefix-cache blocks"):
        p.truncate(0, 11)
    assert run(p, 1, a[:12] + [99]) == 12  # found while 0 runs
    p.free(0, a)
    p.free(1)
    assert p.num_free_blocks == p.num_blocks - 1 and p.num_cached_blocks == 3
