"""A draft model ranking part of the vocabulary (models/vocab_subset.py, SpecConfig.draft_vocab): the head's rows,
-inf elsewhere, every head layout, the engine's greedy identity and exact sampling with such a draft (the latter in
tests/test_spec.py's variants)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from forerun.config import SpecConfig
from forerun.models import quant
from forerun.models.vocab_subset import SubsetHead, restrict_head, special_token_ids, subset_ids
from forerun.sampling_params import SamplingParams
from tiny import hf_model, ours_from_hf, tiny_llm, tiny_tokenizer


def test_subset_ids_are_the_first_ids_and_the_special_ones():
    assert subset_ids(10, 4, [9, 2, 9, 12]).tolist() == [0, 1, 2, 3, 9]  # 12 is past the vocabulary: dropped
    assert subset_ids(10, 10).tolist() == list(range(10))
    for bad in (0, 11):
        with pytest.raises(ValueError, match="draft vocabulary must be 1..10"):
            subset_ids(10, bad)


def test_special_token_ids_of_a_tokenizer():
    tok = tiny_tokenizer(97)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    ids = special_token_ids(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids and tok.eos_token_id in ids


def _check_head(head: nn.Module, ids: torch.Tensor, exact: bool) -> None:
    torch.manual_seed(1)
    x = torch.randn(5, head.in_features)
    sub = SubsetHead(head, ids, head.out_features)
    full, got = head(x).float(), sub(x).float()
    assert got.shape == full.shape
    outside = torch.ones(head.out_features, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(got[:, outside]).all()
    if exact:  # the same rows (the product's blocking may differ with the row count: float rounding only)
        torch.testing.assert_close(got[:, ids], full[:, ids], rtol=1e-5, atol=1e-5 * full.abs().max().item())
        if hasattr(head, "dequantized"):
            assert torch.equal(sub.head.dequantized(), head.dequantized()[ids])
    else:
        torch.testing.assert_close(got[:, ids], full[:, ids], rtol=0.05, atol=0.05 * full.abs().max().item())
    # argmax and softmax stay inside the subset
    assert all(int(i) in set(ids.tolist()) for i in got.argmax(-1))
    assert torch.softmax(got, -1)[:, outside].sum() == 0


def test_subset_head_over_every_cpu_layout():
    torch.manual_seed(0)
    w = torch.randn(160, 64)
    ids = subset_ids(160, 40, [150, 159])
    lin = nn.Linear(64, 160, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    _check_head(lin, ids, exact=True)
    _check_head(quant.Int8Linear.from_float(w), ids, exact=True)  # rows re-quantized from their own values
    q4 = quant.make_quantized_linear([w], None, "int4")
    _check_head(q4, ids, exact=False)  # int4 groups re-fit to their dequantized values


def test_restrict_head_is_idempotent_and_refuses_other_ids():
    runner = ours_from_hf(hf_model("llama", num_hidden_layers=1))
    model = runner.model
    assert restrict_head(model, 30, [96]) == 31
    head = model.lm_head
    assert restrict_head(model, 30, [96]) == 31 and model.lm_head is head
    with pytest.raises(ValueError, match="already ranks 31 tokens"):
        restrict_head(model, 20)


def test_config_refuses_draft_vocab_without_a_draft_model():
    with pytest.raises(ValueError, match="draft_vocab needs method 'draft'"):
        SpecConfig(method="ngram", draft_vocab=100)
    with pytest.raises(ValueError, match="draft_vocab needs method 'draft'"):
        SpecConfig(method="draft", draft_model="m", draft_vocab=0)
    assert SpecConfig.from_flags("m", "4", None, None, draft_vocab=500).draft_vocab == 500


def test_greedy_output_with_a_restricted_draft_equals_plain_and_drafts_stay_in_the_subset():
    """The draft (another random model) ranks the first 40 of 97 ids: output == plain greedy, drafts were
    proposed and accepted, and every drafted token is in the subset."""
    target = hf_model("llama")
    draft = ours_from_hf(hf_model("llama", seed=7, num_hidden_layers=1)).model
    prompts = [[5, 9, 13, 22, 40, 7, 5, 9, 13], list(range(10, 60, 3))]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = tiny_llm(target).generate(prompts, sp)
    spec = SpecConfig(method="draft", draft_model=(draft, tiny_tokenizer(97)), k=4, draft_vocab=40)
    llm = tiny_llm(target, spec=spec, check_invariants=True)
    proposed = []
    real = llm.engine.drafter.propose
    llm.engine.drafter.propose = lambda *a, **kw: (lambda out: proposed.append(out) or out)(real(*a, **kw))
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    assert isinstance(draft.lm_head, SubsetHead)
    agg = llm.aggregate_stats(outs)
    assert agg.drafted > 0
    allowed = set(subset_ids(97, 40, special_token_ids(tiny_tokenizer(97))).tolist())
    tokens = [t for out in proposed for t in _drafted_tokens(out)]
    assert tokens and set(tokens) <= allowed


def _drafted_tokens(out) -> list[int]:
    """Every token id of a DraftProposal (host lists, or device tokens read back)."""
    return [t for ts in out.resolve() for t in ts]


def test_subset_ids_live_on_the_heads_device():
    """The ids move with the head's rows (a GPU draft scatters inside its CUDA graphs, where copying them from the
    CPU cannot be captured): a head on the meta device gets its ids there too."""
    head = nn.Linear(8, 32, bias=False, device="meta")
    sub = SubsetHead(head, subset_ids(32, 10, [31]), 32)
    assert sub.ids.device.type == "meta" and sub.head.weight.device.type == "meta"
    assert SubsetHead(nn.Linear(8, 32, bias=False), subset_ids(32, 10), 32).ids.device.type == "cpu"
