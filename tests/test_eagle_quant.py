"""EAGLE heads held quantized on the CPU (forerun.drafters.eagle.quantize_eagle_head): the head's linears in the
target's int4 / int8 layout (forerun.models.quant's modules), logits close to the fp32 head's, greedy speculative
output still equal to plain greedy, and the switch that keeps fp32."""
from __future__ import annotations

import pytest
import torch

from forerun.config import CacheConfig, SpecConfig
from forerun.drafters.eagle import EagleDrafter, head_layout, quantize_eagle_head
from forerun.engine.llm import LLM
from forerun.kernels import cpu_q4
from forerun.models.eagle_head import load_eagle_head, save_eagle_head
from forerun.models import quant
from forerun.models.quant import Int8Linear, Q4Linear, Q8Linear, weight_bytes

# the 8-bit linear this CPU gets: oneDNN's Int8Linear with VNNI, Q8Linear (cpu_q4.c's int8 layout) without
INT8_KIND = type(quant.int8_linear(torch.zeros(64, 64)))


def _linear_kinds(mod) -> set:
    return {type(m) for m in mod.modules() if isinstance(m, (Q4Linear, Int8Linear, Q8Linear))}
from forerun.models.registry import build_model
from forerun.models.loader import load_checkpoint
from forerun.sampling_params import SamplingParams
from test_eagle import _request, plain_greedy, random_head, run_rounds
from test_loader import save
from tiny import hf_model, ours_from_hf, tiny_tokenizer

LAYOUTS = ["int8"] + (["int4"] if cpu_q4.available() else [])


def _tiny_target(**over):
    hf = hf_model("qwen2", hidden_size=128, intermediate_size=256, **over)
    return hf, ours_from_hf(hf, num_blocks=512)


def _head_logits(head, ids, feats):
    with torch.no_grad():
        out = head.forward_dense(ids, feats, True)
        return head.logits(out[0])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("version", [1, 3])
def test_quantized_head_logits_close_to_fp32(layout, version):
    _, target = _tiny_target()
    head = random_head(target.model, version, draft_vocab=64 if version == 3 else None)
    for p in head.parameters():  # smaller weights: the random head's logits are less saturated
        if p.dim() > 1:
            p.data.mul_(0.5)
    torch.manual_seed(1)
    ids = torch.randint(2, 97, (1, 24))
    feats = torch.randn(1, 24, head.eagle.feature_size)
    ref = _head_logits(head, ids, feats)
    before = weight_bytes(head)["total_bytes"]
    quantize_eagle_head(head, layout)
    lin = [m for m in head.modules() if type(m) is torch.nn.Linear]
    assert not lin, "every linear of the head is quantized"
    assert _linear_kinds(head) == ({Q4Linear} if layout == "int4" else {INT8_KIND})
    assert weight_bytes(head)["total_bytes"] < 0.5 * before
    got = _head_logits(head, ids, feats)
    err = ((got - ref).norm() / ref.norm()).item()
    # random weights are the hard case for 4 bits; measured 0.017 (int8) / 0.12-0.13 (int4), top-1 0.79-1.0
    assert 0 < err < (0.05 if layout == "int8" else 0.25), err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.7
    # the paged (drafting) forward of the quantized head = its dense forward
    from test_eagle import paged_outputs

    out, logits = paged_outputs(head, ids[0], feats[0])
    dense = head.to_target_vocab(got)
    assert torch.equal(torch.isinf(logits), torch.isinf(dense))
    finite = torch.isfinite(dense)
    gap = torch.where(finite, (logits - dense).abs(), torch.zeros_like(dense)).amax(-1)
    # The two forwards' attention sums in different orders (~5e-7). The int4 CPU kernel quantizes its activations
    # to int8 per 32 values, so such a difference can flip one activation's rounding and move a row by a step of
    # that grid times a weight (measured 3.5e-3 after gate/up, 7.9e-3 in the logits, on an AVX2 Zen 2); a token
    # or position read wrongly moves a row by O(1). Most rows must still agree to float rounding.
    assert gap.max() < 3e-2, gap
    assert (gap < 1e-4 * (1 + dense.abs().nan_to_num(0, 0, 0).amax(-1))).float().mean() >= 0.8, gap


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_is_lossless_with_quantized_head(layout, tree):
    _, target = _tiny_target()
    head = random_head(target.model, 3, draft_vocab=50)
    drafter = EagleDrafter(target, head, cache=CacheConfig(block_size=4, num_blocks=512), tree_topk=3,
                           tree_steps=3, tree_nodes=8, quantize=layout)
    assert drafter.head_layout == layout and isinstance(drafter.head.lm_head, (Q4Linear, INT8_KIND))
    prompts = [[5, 6, 7, 8, 9], [11, 3, 90, 2, 2, 2, 40, 41]]
    reqs = [_request(i, p) for i, p in enumerate(prompts)]
    stats = run_rounds(target, drafter, reqs, 20, k=3, tree=tree)
    assert stats["drafted"] > 0
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == plain_greedy(target, p, 20)


def test_head_layout_follows_the_target_and_the_switch(monkeypatch):
    _, target = _tiny_target()
    monkeypatch.delenv("FORERUN_EAGLE_QUANTIZE", raising=False)
    assert head_layout(target) == "none"  # an fp32 target: the head stays as loaded
    monkeypatch.setattr(target.model, "quantization", "int4", raising=False)
    assert head_layout(target) == "int4" and head_layout(target, "auto") == "int4"
    assert head_layout(target, "none") == "none" and head_layout(target, "int8") == "int8"
    monkeypatch.setenv("FORERUN_EAGLE_QUANTIZE", "none")
    assert head_layout(target) == "none"
    drafter = EagleDrafter(target, random_head(target.model, 3, draft_vocab=50),
                           cache=CacheConfig(block_size=4, num_blocks=64))
    assert drafter.head_layout == "none" and type(drafter.head.lm_head) is torch.nn.Linear
    with pytest.raises(ValueError, match="must be one of"):
        head_layout(target, "int3")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_quantized_target_quantizes_the_head(tmp_path, layout, monkeypatch):
    """Through the engine (`--draft eagle:DIR`): a quantized target gets a head in its layout by default, and
    greedy chain and tree output equal plain greedy; FORERUN_EAGLE_QUANTIZE=none keeps the fp32 head."""
    monkeypatch.delenv("FORERUN_EAGLE_QUANTIZE", raising=False)
    hf = hf_model("qwen2", hidden_size=128, intermediate_size=256)
    model = build_model(load_checkpoint(save(hf, tmp_path / "m")), "cpu", torch.float32, progress=False,
                        quantize=layout)
    head = random_head(model, 3, draft_vocab=64)
    head_dir = save_eagle_head(head, tmp_path / "head")
    tok = tiny_tokenizer(model.config.vocab_size)
    prompts = ["t5 t6 t7 t5 t6 t7 t5 t6", "t9 t10 t11 t12 t9 t10 t11"]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = [o.token_ids for o in LLM.from_model(model, tok, device="cpu").generate(prompts, sp)]
    for spec in (SpecConfig(method="eagle", eagle_head=str(head_dir), k=3),
                 SpecConfig(method="eagle", eagle_head=str(head_dir), eagle_tree=(3, 3, 8))):
        llm = LLM.from_model(model, tok, device="cpu", spec=spec)
        assert llm.engine.drafter.head_layout == layout
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == plain
        assert llm.aggregate_stats(outs).drafted > 0
    monkeypatch.setenv("FORERUN_EAGLE_QUANTIZE", "none")
    llm = LLM.from_model(model, tok, device="cpu", spec=SpecConfig(method="eagle", eagle_head=str(head_dir), k=3))
    assert llm.engine.drafter.head_layout == "none"
    assert [o.token_ids for o in llm.generate(prompts, sp)] == plain


def test_quantized_head_loads_from_a_checkpoint_unchanged(tmp_path):
    """Quantizing happens after loading: the checkpoint on disk stays fp32 (training resumes from it)."""
    _, target = _tiny_target()
    head = random_head(target.model, 3, draft_vocab=50)
    d = save_eagle_head(head, tmp_path / "h")
    drafter = EagleDrafter(target, d, cache=CacheConfig(block_size=4, num_blocks=64), quantize="int8")
    assert isinstance(drafter.head.fc, INT8_KIND)
    again = load_eagle_head(d, target.model)
    assert torch.equal(again.fc.weight, head.fc.weight)


@pytest.mark.slow
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_is_lossless_real_smollm2_quantized(tree):
    """The real SmolLM2 (GGUF) kept quantized, a random EAGLE-3 head quantized in the target's layout (auto):
    greedy output equals plain greedy."""
    from forerun.models.registry import load_model
    from forerun.runtime.runner import ModelRunner
    from test_eagle import REAL_PROMPTS

    model, tok, _ = load_model("smollm2-135m-instruct", "cpu", torch.float32, quantize="auto", progress=False)
    target = ModelRunner(model, CacheConfig(block_size=16, num_blocks=64), "cpu", torch.float32)
    drafter = EagleDrafter(target, random_head(model, 3, draft_vocab=4096),
                           cache=CacheConfig(block_size=16, num_blocks=64), tree_topk=3, tree_steps=3, tree_nodes=10)
    assert drafter.head_layout == model.quantization != "none"
    prompts = [tok(p)["input_ids"] for p in REAL_PROMPTS]
    reqs = [_request(i, p) for i, p in enumerate(prompts)]
    run_rounds(target, drafter, reqs, 20, k=3, tree=tree)
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == plain_greedy(target, p, 20)
