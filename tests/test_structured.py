"""Structured output (forerun/structured.py): spec validation, mask rows against fresh xgrammar matchers (the
reference), draft cutting, tree walks, and the exactness of constrained speculative sampling (chi-square, with
power checks). Real-model tests (SmolLM2 + JSON schema, validated by jsonschema) are marked slow."""
from __future__ import annotations

import json

import pytest
import torch

import forerun.verify.chain as chain_module
from forerun.sampling_params import SamplingParams
from forerun.structured import (GrammarCompiler, StructuredOutput, apply_bitmask_, apply_grammar_to_draft_logits,
                                cut_drafts, mask_target_logits_, tree_verify_bitmask, unpack, verify_bitmask)
from forerun.verify import logits_to_probs, verify_chain
from test_verify_common import chi2_pvalue, const_sampling

# A toy vocabulary (RAW strings) and a regex whose allowed set depends on the prefix:
# start {a, ab, abc}; after a / ab {b, c, bc}; after abc also </s>.
VOCAB = ["a", "b", "c", "ab", "bc", "ca", "abc", "</s>"]
V, EOS = len(VOCAB), 7
SPEC = StructuredOutput(regex="a[bc]+c")


@pytest.fixture(scope="module")
def comp():
    return GrammarCompiler.from_vocab(VOCAB, [EOS])


def reference_allowed(comp, prefix: list[int]) -> torch.Tensor:
    """[V] bool from a fresh xgrammar matcher fed the prefix (no code of forerun.structured in the loop)."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(comp.compile(SPEC))
    for t in prefix:
        assert m.accept_token(t)
    if m.is_terminated():
        return torch.arange(V) == EOS
    bm = xgr.allocate_token_bitmask(1, V)
    m.fill_next_token_bitmask(bm)
    return torch.tensor([(int(bm[0, t // 32]) >> (t % 32)) & 1 == 1 for t in range(V)])


# -- the spec -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, msg", [
    (dict(), "exactly one of"),
    (dict(regex="a", json_object=True), "exactly one of"),
    (dict(regex="[a-"), "invalid regex"),
    (dict(grammar="root ::= foo"), "invalid grammar"),
    (dict(json_schema="{"), "not valid JSON"),
    (dict(json_schema=[1, 2]), "must be a JSON object"),
    (dict(json_schema={"type": "objectx"}), "invalid json_schema"),
    (dict(choice="yes"), "list of strings"),
    (dict(choice=[]), "non-empty"),
])
def test_bad_specs_fail_with_one_line(kw, msg):
    with pytest.raises(ValueError, match=msg) as e:
        StructuredOutput(**kw)
    assert "\n" not in str(e.value)


def test_sampling_params_takes_a_spec_and_refuses_other_things():
    assert SamplingParams(structured_output=SPEC).structured_output is SPEC
    with pytest.raises(ValueError, match="StructuredOutput"):
        SamplingParams(structured_output={"regex": "a"})


def test_equal_schemas_share_a_key_property_order_is_kept_and_response_format_maps(comp):
    a = StructuredOutput(json_schema={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutput(json_schema='{"type": "object",  "properties": {"x": {"type": "integer"}}}')
    assert a.key == b.key and hash(a.key)
    # properties come out in the schema's order (a sorted canonical form would reorder them)
    two = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}, "required": ["b", "a"],
           "additionalProperties": False}
    g = str(__import__("forerun.structured", fromlist=["_grammar"])._grammar(StructuredOutput(json_schema=two)))
    assert g.index('"\\"b\\""') < g.index('"\\"a\\""')
    rf = StructuredOutput.from_response_format({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}})
    assert rf.kind == "json_schema"
    assert StructuredOutput.from_response_format({"type": "json_object"}).kind == "json_object"
    with pytest.raises(ValueError, match="response_format"):
        StructuredOutput.from_response_format({"type": "text"})


def test_choice_grammar_accepts_exactly_the_choices():
    comp = GrammarCompiler.from_vocab(["y", "e", "s", "n", "o", '"', "q", "</s>"], [7])
    st = comp.new_state(StructuredOutput(choice=["yes", "no", 'q"']))
    for word, ok in [([0, 1, 2], True), ([3, 4], True), ([6, 5], True), ([0, 4], False)]:
        n, _ = st.draft_masks(word)
        assert (n == len(word)) == ok, word


# -- mask rows ----------------------------------------------------------------------------------------
def test_draft_masks_match_fresh_matchers_and_cut_at_the_first_rejected_token(comp):
    st = comp.new_state(SPEC)
    before = st.next_mask().clone()
    for draft, want_valid in [([0, 4, 2, 1], 4), ([6, 7, 1], 2), ([0, 5, 1], 1), ([1, 0], 0), ([], 0)]:
        n, rows = st.draft_masks(draft)
        assert n == want_valid
        assert rows.shape == (n + 1, 1)
        for j in range(n + 1):
            assert torch.equal(unpack(rows[j], V), reference_allowed(comp, draft[:j])), (draft, j)
        assert torch.equal(st.next_mask(), before), "the matcher must be back at the committed state"
    assert st.num_rejected_drafts == 0 + 1 + 2 + 2 + 0


def test_draft_session_rows_are_reused_and_equal(comp):
    st = comp.new_state(SPEC)
    st.commit([0])
    session = []
    for t in [4, 1, 2]:
        session.append(st.draft_mask().clone())
        assert st.draft_accept(t)
    st.draft_end()
    n, rows = st.draft_masks([4, 1, 2])
    assert n == 3
    for j in range(3):
        assert torch.equal(rows[j], session[j])
        assert torch.equal(unpack(rows[j], V), reference_allowed(comp, [0] + [4, 1, 2][:j]))
    assert torch.equal(unpack(rows[3], V), reference_allowed(comp, [0, 4, 1, 2]))
    n, rows2 = st.draft_masks([4, 2])  # another draft on the same committed state: cached row 0, 1 reused
    assert n == 2 and torch.equal(unpack(rows2[2], V), reference_allowed(comp, [0, 4, 2]))
    assert not st.draft_accept(0) and st.draft_accept(1)  # 'a' not allowed after 'abc'; 'b' is
    st.draft_end()


def test_commit_stops_at_termination_and_refuses_disallowed_tokens(comp):
    st = comp.new_state(SPEC)
    assert st.commit([6, EOS, 1, 2]) == 2 and st.is_terminated()
    n, rows = st.draft_masks([1])  # nothing but a stop token may follow a terminated grammar
    assert n == 0 and unpack(rows[0], V).nonzero().flatten().tolist() == [EOS]
    st = comp.new_state(SPEC)
    with pytest.raises(ValueError, match="not allowed"):
        st.commit([1])


def test_tree_masks_match_fresh_matchers_per_path(comp):
    tokens = [99, 0, 3, 5, 1, 2, EOS, 4, 2, EOS]
    parents = [-1, 0, 0, 0, 1, 1, 2, 6, 4, 8]
    st = comp.new_state(SPEC)
    st.commit([])
    valid, masks = st.tree_masks(tokens, parents)
    for i in range(len(tokens)):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        path.reverse()
        m = __import__("xgrammar").GrammarMatcher(comp.compile(SPEC))
        ok = all(m.accept_token(t) for t in path)
        assert bool(valid[i]) == ok, i
        if ok:
            assert torch.equal(unpack(masks[i], V), reference_allowed(comp, path)), i
        else:
            assert bool(unpack(masks[i], V).all())
    # 'ca' (3), EOS after 'ab' (6) and its child (7) are rejected; a,b,c,EOS (9) terminates and is valid
    assert valid.tolist() == [True, True, True, False, True, True, False, False, True, True]
    assert st.num_rejected_drafts == 3
    assert torch.equal(st.next_mask(), comp.new_state(SPEC).next_mask())
    both = tree_verify_bitmask([st, None], [tokens, [5, 1]], [parents, [-1, 0]])
    assert both.shape == (12, 1) and torch.equal(both[:10], masks) and bool((both[10:] == -1).all())


def test_verify_bitmask_and_apply(comp):
    st = comp.new_state(SPEC)
    drafts, probs, masks = cut_drafts([st, None], [[0, 5, 1], [5, 5]], [torch.rand(3, V), None])
    assert drafts == [[0], [5, 5]] and probs[0].shape == (1, V) and masks[1] is None
    bm = verify_bitmask(masks, [2, 3])
    logits = torch.zeros(5, V)
    mask_target_logits_(logits, bm)
    assert torch.equal(torch.isfinite(logits[0]), reference_allowed(comp, []))
    assert torch.equal(torch.isfinite(logits[1]), reference_allowed(comp, [0]))
    assert bool(torch.isfinite(logits[2:]).all())
    assert verify_bitmask([None], [1]) is None
    part = torch.zeros(3, V)
    apply_bitmask_(part, bm[:1], torch.tensor([2]))
    assert bool(torch.isfinite(part[:2]).all()) and torch.equal(torch.isfinite(part[2]), reference_allowed(comp, []))


# -- exactness ------------------------------------------------------------------------------------------
CONFIGS = {"t0.8": dict(temperature=0.8), "top_k3": dict(temperature=1.0, top_k=3)}
N = 1_000_000  # as tests/test_verify_exactness.py: an accept ratio off by 1% gives p < 1e-6
ALPHA = 1e-3


def _probs(logits: torch.Tensor, cfg: dict) -> torch.Tensor:
    s = const_sampling(logits.shape[0], **cfg)
    return logits_to_probs(logits, s.temperature, s.top_k, s.top_p, s.min_p)


def _world(seed: int):
    """Target / draft logits at position 1 ([V]) and position 2 given token 1 ([V, V])."""
    g = torch.Generator().manual_seed(seed)
    t1, t2 = torch.randn(V, generator=g) * 1.5, torch.randn(V, V, generator=g) * 1.5
    return dict(t1=t1, t2=t2, d1=t1 + torch.randn(V, generator=g), d2=t2 + torch.randn(V, V, generator=g))


def _expected(comp, w, cfg):
    """p1 [V], p2 [V, V] of constrained PLAIN sampling: softmax of target logits masked by fresh matchers."""
    m1 = torch.where(reference_allowed(comp, []), w["t1"], float("-inf"))
    p1 = _probs(m1[None], cfg)[0]
    p2 = torch.zeros(V, V)
    for x in range(V):
        if p1[x] > 0:
            p2[x] = _probs(torch.where(reference_allowed(comp, [x]), w["t2"][x], float("-inf"))[None], cfg)[0]
    return p1, p2


def _constrained_trials(comp, w, cfg, n, seed, drafter="model", unmasked_q_to_verifier=False):
    """n i.i.d. rounds of constrained speculation with k = 2 from the committed empty prefix, through the real
    hooks: the drafter masks its logits per draft position (draft session), cut_drafts cuts and gives the
    verify masks, the target logits are masked, verify_chain decides. Trials with identical drafts share one
    grammar computation (the masks depend on the tokens only), so a million trials stay fast.
    drafter: "model" (q = masked draft softmax) or "uniform" (point-mass drafts drawn uniformly from the whole
    vocabulary, as an n-gram drafter might propose tokens the grammar rejects)."""
    g = torch.Generator().manual_seed(seed)
    if drafter == "model":
        root = comp.new_state(SPEC)
        lg = w["d1"].clone()[None]
        apply_grammar_to_draft_logits(lg, [root])
        root.draft_end()
        q1 = _probs(lg, cfg)[0]
        q1_raw = _probs(w["d1"][None], cfg)[0]
        d1 = torch.multinomial(q1, n, replacement=True, generator=g)
        q2, q2_raw, states = torch.zeros(V, V), torch.zeros(V, V), {}
        for v in d1.unique().tolist():
            st = comp.new_state(SPEC)
            st.draft_mask()
            assert st.draft_accept(v), "a masked drafter cannot draft a rejected token"
            lg = w["d2"][v].clone()[None]
            apply_grammar_to_draft_logits(lg, [st])
            st.draft_end()
            q2[v], q2_raw[v] = _probs(lg, cfg)[0], _probs(w["d2"][v][None], cfg)[0]
            states[v] = st
        d2 = torch.multinomial(q2[d1], 1, generator=g).squeeze(1)
    else:
        d1, d2 = torch.randint(0, V, (n,), generator=g), torch.randint(0, V, (n,), generator=g)
        states = {}
    pair = d1 * V + d2
    uniq, inv = pair.unique(return_inverse=True)
    nvalid = torch.zeros(len(uniq), dtype=torch.long)
    mask_tab = torch.full((len(uniq), 3, 1), -1, dtype=torch.int32)
    for u, pv in enumerate(uniq.tolist()):
        a, b = divmod(pv, V)
        st = states.get(a) or comp.new_state(SPEC)
        (cut,), _, (rows,) = cut_drafts([st], [[a, b]], [None])
        assert cut == [a, b][: len(cut)]
        nvalid[u] = len(cut)
        mask_tab[u, : len(rows)] = rows
    nv = nvalid[inv]  # [n]
    lens = nv + 1
    ftp = torch.cumsum(lens, 0) - lens
    trial = torch.repeat_interleave(torch.arange(n), lens)
    local = torch.arange(int(lens.sum())) - ftp[trial]
    dtok = torch.stack([d1, d2], 1)  # [n, 2]
    prev = dtok[trial, (local - 1).clamp(min=0)]
    logits = torch.where((local == 0)[:, None], w["t1"].expand(len(local), V), w["t2"][prev])
    mask_target_logits_(logits, mask_tab[inv[trial], local])
    drafts = torch.where(local < nv[trial], dtok[trial, local.clamp(max=1)], -1)
    if drafter == "model":
        qa, qb = (q1_raw, q2_raw) if unmasked_q_to_verifier else (q1, q2)
        draft_probs = torch.where((local == 0)[:, None], qa.expand(len(local), V), qb[prev])
    else:
        draft_probs = torch.nn.functional.one_hot(drafts.clamp(min=0), V).float()
    draft_probs = draft_probs * (drafts >= 0)[:, None]
    r = verify_chain(logits, drafts, ftp, lens, const_sampling(n, **cfg), torch.rand(len(local), 2, generator=g),
                     draft_probs=draft_probs, rule="auto")
    return r.output_token_ids, r.num_emitted


def _pvalue(comp, w, cfg, out, num_emitted, seed):
    """First token (V cells) and 2-token prefix (V^2 cells), Bonferroni; a 1-token round is completed by a
    plain sample of the constrained p( . | x1), which is what the next round does."""
    g = torch.Generator().manual_seed(seed)
    p1, p2 = _expected(comp, w, cfg)
    x1 = out[:, 0]
    fill = p2[x1] + (p2[x1].sum(-1, keepdim=True) == 0)  # x1 of probability 0 (the power check): any x2
    x2 = torch.where(num_emitted >= 2, out[:, 1], torch.multinomial(fill, 1, generator=g).squeeze(1))
    first = chi2_pvalue(torch.bincount(x1, minlength=V), p1)
    joint = chi2_pvalue(torch.bincount(x1 * V + x2, minlength=V * V), (p1[:, None] * p2).flatten())
    return 2 * min(first, joint)


@pytest.mark.parametrize("drafter", ["model", "uniform"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_constrained_speculation_emits_constrained_target_distribution(comp, name, drafter):
    cfg, w = CONFIGS[name], _world(1)
    out, ne = _constrained_trials(comp, w, cfg, N, seed=2, drafter=drafter)
    assert _pvalue(comp, w, cfg, out, ne, seed=3) > ALPHA


def test_constrained_test_has_power_accept_ratio_off_by_one_percent(comp, monkeypatch):
    cfg, w = CONFIGS["t0.8"], _world(1)
    monkeypatch.setattr(chain_module, "ratio_accept", lambda p_x, q_x, u: u * q_x * 0.99 < p_x)
    out, ne = _constrained_trials(comp, w, cfg, N, seed=2)
    assert _pvalue(comp, w, cfg, out, ne, seed=3) < 1e-6


def test_constrained_test_has_power_verifier_given_unmasked_q(comp):
    """A drafter that samples from masked q but reports unmasked q to the verifier is biased: caught."""
    cfg, w = CONFIGS["t0.8"], _world(1)
    out, ne = _constrained_trials(comp, w, cfg, N // 4, seed=2, unmasked_q_to_verifier=True)
    assert _pvalue(comp, w, cfg, out, ne, seed=3) < 1e-6


def test_constrained_test_catches_unmasked_target(comp, monkeypatch):
    """Without the target mask, disallowed tokens come out: the chi-square helper refuses them."""
    import sys

    monkeypatch.setattr(sys.modules[__name__], "mask_target_logits_", lambda logits, bm: logits)
    cfg, w = CONFIGS["t0.8"], _world(1)
    out, ne = _constrained_trials(comp, w, cfg, 20_000, seed=2, drafter="uniform")
    with pytest.raises(AssertionError, match="probability 0"):
        _pvalue(comp, w, cfg, out, ne, seed=3)


@pytest.mark.parametrize("drafter", ["model", "uniform"])
def test_constrained_greedy_speculation_equals_constrained_plain_greedy(comp, drafter):
    cfg = dict(temperature=0.0)
    for seed in range(5):
        w = _world(seed)
        out, ne = _constrained_trials(comp, w, cfg, 200, seed, drafter=drafter)
        a1 = torch.where(reference_allowed(comp, []), w["t1"], float("-inf")).argmax()
        a2 = torch.where(reference_allowed(comp, [int(a1)]), w["t2"][a1], float("-inf")).argmax()
        assert bool((out[:, 0] == a1).all())
        assert bool((out[ne >= 2, 1] == a2).all())


def test_round_hooks_mask_rows_commit_and_tree_nodes(comp):
    from forerun.structured import commit_emitted, mask_request_rows_, tree_node_masks

    a, b = comp.new_state(SPEC), comp.new_state(SPEC)
    _, _, masks = cut_drafts([a, None, b], [[0, 4], [1], [6]], [None, None, None])
    logits = torch.zeros(9, V)
    mask_request_rows_(logits, masks, [0, 3, 5])  # rows 0-2: a, 3-4: free, 5-6: b, 7-8: untouched
    assert torch.equal(torch.isfinite(logits[2]), reference_allowed(comp, [0, 4]))
    assert torch.equal(torch.isfinite(logits[6]), reference_allowed(comp, [6]))
    assert bool(torch.isfinite(logits[3:5]).all() and torch.isfinite(logits[7:]).all())
    commit_emitted([a, None, b], [[0, 4], [3], [6, EOS, EOS]])
    assert a.num_committed == 2 and b.is_terminated()
    st = comp.new_state(SPEC)
    m = tree_node_masks(st, [99, 0, 3, 2, 1], [-1, 0, 0, 1, 2], [3, 4])
    assert torch.equal(unpack(m[0], V), reference_allowed(comp, [0, 2]))
    assert torch.equal(unpack(m[1], V), reference_allowed(comp, [3, 1]))
    assert st.num_rejected_drafts == 0


# -- real model (SmolLM2-135M-Instruct), every drafter ------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 16}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "hobbies", "employed"],
    "additionalProperties": False,
}
JSON_PROMPTS = ["Describe a fictional person as JSON.", "Give me a JSON record for a retired teacher.",
                "A JSON profile of a young programmer:"]
SPECS = {
    "ngram": dict(method="ngram", k=4),
    "early-exit": dict(method="early-exit", early_exit_layers=10, k=3),
    "draft": dict(method="draft", k=4),
    "tree": dict(method="draft", tree=(2, 2)),
}


@pytest.fixture(scope="module")
def smol():
    from forerun.models.registry import load_model

    return load_model("smollm2-135m-instruct")


def _llm(smol, name):
    from forerun.config import CacheConfig, SpecConfig
    from forerun.engine.llm import LLM

    model, tok, _ = smol
    small = dict(device="cpu", check_invariants=True, cache=CacheConfig(num_blocks=128))  # 2048 tokens, ~50 MB
    if name == "plain":
        return LLM.from_model(model, tok, **small)
    kw = dict(SPECS[name])
    if kw["method"] == "draft":
        kw["draft_model"] = (model, tok)  # the model drafting for itself: its own cache, the drafter's code path
    return LLM.from_model(model, tok, spec=SpecConfig(**kw), **small)


@pytest.fixture(scope="module")
def plain_greedy(smol):
    sp = SamplingParams(temperature=0, max_tokens=120, structured_output=StructuredOutput(json_schema=SCHEMA))
    return _llm(smol, "plain").generate(JSON_PROMPTS, sp, chat=True)


@pytest.mark.slow
def test_smollm2_plain_constrained_outputs_validate(plain_greedy):
    import jsonschema

    for o in plain_greedy:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECS))
def test_smollm2_constrained_speculation_greedy_equals_plain_and_sampled_validates(smol, plain_greedy, name):
    import jsonschema

    llm = _llm(smol, name)
    so = StructuredOutput(json_schema=SCHEMA)
    outs = llm.generate(JSON_PROMPTS, SamplingParams(temperature=0, max_tokens=120, structured_output=so), chat=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_greedy]
    sampled = llm.generate(JSON_PROMPTS, SamplingParams(temperature=0.8, max_tokens=120, seed=7, structured_output=so),
                           chat=True)
    for o in outs + sampled:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert llm.aggregate_stats(outs + sampled).drafted > 0


# -- grammar-rejected drafts in the speculation stats ----------------------------------------------------------
def test_cut_and_tree_rejections_are_counted_in_the_linked_request_stats(comp):
    from types import SimpleNamespace

    from forerun.stats import RequestStats, aggregate
    from forerun.structured import grammar_of, tree_node_masks

    req = SimpleNamespace(grammar=comp.new_state(SPEC), stats=RequestStats())
    free = SimpleNamespace(stats=RequestStats())
    st = grammar_of(req)
    assert st is req.grammar and st.stats is req.stats and grammar_of(free) is None
    cut_drafts([st, None], [[0, 5, 1, 2], [5, 5]], [None, None])  # 'a' ok, 'ca' rejected: 3 cut
    assert req.stats.grammar_rejected == 3 == st.num_rejected_drafts
    cut_drafts([st], [[0, 4, 2]], [None])  # all accepted: nothing more
    assert req.stats.grammar_rejected == 3
    tokens, parents = [99, 0, 1, 5, 2], [-1, 0, 0, 0, 1]  # 'a', 'a'+'c' valid; 'b' and 'ca' rejected at the root
    tree_node_masks(st, tokens, parents, [4])  # the tree drafter's hook counts nothing
    assert req.stats.grammar_rejected == 3
    st.tree_masks(tokens, parents)
    assert req.stats.grammar_rejected == 5
    d = req.stats.as_dict()
    assert d["grammar_rejected"] == 5 and free.stats.as_dict()["grammar_rejected"] == 0
    assert aggregate([req.stats, free.stats, req.stats]).grammar_rejected == 10


@pytest.fixture(scope="module")
def tiny_choice_world():
    """A tiny random model over words t0..t96 (t1 = EOS); the prompt repeats t5..t9, so an n-gram drafter keeps
    proposing t8 t9 after t5 t6 t7, which the choice grammar 't5t6t7' (then EOS only) rejects."""
    from tiny import hf_model

    return hf_model("llama", seed=3), "t5 t6 t7 t8 t9 t5 t6 t7 t8 t9 t5 t6 t7 t8 t9 t2 t9"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_reports_grammar_rejected_drafts_of_constrained_requests_only(tiny_choice_world, temperature):
    from tiny import tiny_llm

    from forerun.config import SpecConfig

    hf, prompt = tiny_choice_world
    llm = tiny_llm(hf, spec=SpecConfig(method="ngram", k=4), check_invariants=True)
    so = StructuredOutput(choice=["t5t6t7"])
    con = SamplingParams(temperature=temperature, seed=1, max_tokens=8, structured_output=so)
    free = SamplingParams(temperature=temperature, seed=1, max_tokens=8)
    c, u = llm.generate([prompt, prompt], [con, free])
    assert c.token_ids[:3] == [5, 6, 7] and c.finish_reason == "stop", c.token_ids
    # after 't9' then 't5': the n-gram proposes t6 t7 t8 t9; the grammar cuts t8 t9 (and anything after t7)
    assert c.stats.grammar_rejected >= 2, c.stats.as_dict()
    assert c.stats.as_dict()["grammar_rejected"] == c.stats.grammar_rejected
    assert u.stats.grammar_rejected == 0 and u.stats.drafted > 0
    assert llm.aggregate_stats([c, u]).grammar_rejected == c.stats.grammar_rejected
    assert llm.engine._grammar_compiler().num_rejected_drafts == c.stats.grammar_rejected  # engine-wide count
    assert llm.engine.stats().grammar_rejected == c.stats.grammar_rejected


@pytest.mark.slow
def test_smollm2_ngram_drafts_against_a_choice_grammar_are_counted_as_grammar_rejected(smol):
    """The prompt repeats 'the answer is 42.'; the grammar allows 'the answer is 7' only, so once the output
    reads 'the answer is' the n-gram drafter proposes ' 4' '2' '.' ..., which the grammar cuts. The unconstrained
    request (same prompt, same drafter) has nothing cut."""
    from forerun.config import CacheConfig, SpecConfig
    from forerun.engine.llm import LLM

    model, tok, _ = smol
    llm = LLM.from_model(model, tok, device="cpu", check_invariants=True, cache=CacheConfig(num_blocks=64),
                         spec=SpecConfig(method="ngram", k=4))
    prompt = "Repeat: the answer is 42. the answer is 42. the answer is 42. the answer is 42.\nthe answer is"
    so = StructuredOutput(choice=["the answer is 7"])
    for temperature in (0.0, 0.8):
        c, u = llm.generate([prompt, prompt], [
            SamplingParams(temperature=temperature, seed=3, max_tokens=16, structured_output=so),
            SamplingParams(temperature=temperature, seed=3, max_tokens=16)], chat=False)
        assert c.text == "the answer is 7" and c.finish_reason == "stop", c.text
        assert c.stats.grammar_rejected > 0, c.stats.as_dict()
        assert u.stats.grammar_rejected == 0 and u.stats.drafted > 0, u.stats.as_dict()


def test_server_usage_speculation_reports_grammar_rejected():
    """The server's usage.speculation (forerun/server/runs.py) sums the choices' stats: grammar_rejected included."""
    from forerun.server.runs import Run
    from forerun.stats import RequestStats

    run = Run(None, [[1, 2, 3]], [SamplingParams(structured_output=SPEC), SamplingParams()], 2, "r", 0.0)
    a, b = RequestStats(), RequestStats()
    a.record(4, 2, 3)
    a.grammar_rejected = 3
    b.record(2, 1, 2)
    run.choices[0].stats, run.choices[1].stats = a, b
    spec = run.usage()["speculation"]
    assert spec["grammar_rejected"] == 3 and spec["drafted"] == 6


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tree_drafter_drafts_from_the_grammar_masked_distribution(tiny_choice_world, temperature):
    """A draft tree under a grammar: each node's children come from q masked by the grammar after the node's path
    (depth first, one-token rollback), so an unrelated random draft model still drafts the only allowed tokens
    and they are accepted; unmasked it would draft random words the target (masked) never picks."""
    from tiny import hf_model, ours_from_hf, tiny_llm, tiny_tokenizer

    from forerun.config import SpecConfig

    hf, prompt = tiny_choice_world
    draft = ours_from_hf(hf_model("llama", seed=11, num_hidden_layers=1)).model
    spec = SpecConfig(method="draft", draft_model=(draft, tiny_tokenizer(hf.config.vocab_size)), tree=(2, 2))
    llm = tiny_llm(hf, spec=spec, check_invariants=True)
    so = StructuredOutput(choice=["t5t6t7"])
    (c,) = llm.generate([prompt], SamplingParams(temperature=temperature, seed=1, max_tokens=8, structured_output=so))
    assert c.token_ids[:3] == [5, 6, 7] and c.finish_reason == "stop", c.token_ids
    assert c.stats.accepted >= 2, c.stats.as_dict()


@pytest.mark.parametrize("tree", [None, (2, 3, 6)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_eagle_drafts_from_the_grammar_masked_distribution(tiny_choice_world, temperature, tree, tmp_path):
    """An EAGLE head (random, untrained) drafting under a grammar, chain and dynamic tree: its draft logits are
    masked by the grammar at each draft position (each tree node: after its path), so it drafts the only allowed
    tokens and they are accepted (unmasked: random words)."""
    from tiny import model_from_hf, random_eagle_head_dir, tiny_llm

    from forerun.config import SpecConfig

    hf, prompt = tiny_choice_world
    head = random_eagle_head_dir(model_from_hf(hf), tmp_path / "head")
    spec = SpecConfig(method="eagle", eagle_head=head, k=3, eagle_tree=tree)
    llm = tiny_llm(hf, spec=spec, check_invariants=True)
    so = StructuredOutput(choice=["t5t6t7"])
    (c,) = llm.generate([prompt], SamplingParams(temperature=temperature, seed=1, max_tokens=8, structured_output=so))
    assert c.token_ids[:3] == [5, 6, 7] and c.finish_reason == "stop", c.token_ids
    assert c.stats.accepted >= 2, c.stats.as_dict()
