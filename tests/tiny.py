"""Tiny random transformers checkpoints, built on the fly: the reference nobody here wrote."""
from __future__ import annotations

import torch
import transformers

from forerun.config import CacheConfig, ModelConfig
from forerun.runtime.runner import ModelRunner
from forerun.models.llama import LlamaForCausalLM

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              bos_token_id=0, eos_token_id=1, pad_token_id=0)


def hf_config(arch: str, **over):
    kw = dict(COMMON, **over)
    if arch == "llama":
        return transformers.LlamaConfig(**kw, rope_theta=10000.0)
    if arch == "llama3":
        return transformers.LlamaConfig(**kw, rope_theta=500000.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))
    if arch == "qwen2":
        return transformers.Qwen2Config(**kw, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**kw, head_dim=32)
    if arch == "mistral":
        return transformers.MistralConfig(**kw, sliding_window=None)
    raise ValueError(arch)


def hf_model(arch: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    cfg = hf_config(arch, **over)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases so every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def model_from_hf(hf) -> LlamaForCausalLM:
    """forerun's model with a transformers model's config and weights."""
    model = LlamaForCausalLM(ModelConfig.from_hf(hf.config.to_dict())).eval()
    model.load_weights(hf.state_dict().items())
    return model


def ours_from_hf(hf, block_size: int = 4, num_blocks: int = 256, **runner_kw) -> ModelRunner:
    return ModelRunner(model_from_hf(hf), CacheConfig(block_size=block_size, num_blocks=num_blocks), "cpu",
                       torch.float32, **runner_kw)


def random_eagle_head_dir(target: LlamaForCausalLM, path) -> str:
    """A random EAGLE-1 head for `target` (weights ~ N(0, 0.05), seed 0), saved in the published layout."""
    from forerun.models.eagle_head import EagleConfig, EagleHead, save_eagle_head

    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target.config, version=1), target)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    return str(save_eagle_head(head, path))


def tiny_tokenizer(vocab_size: int = 97, eos: int = 1):
    """A word-level tokenizer over 't0' .. 't{V-1}' (t1 is EOS): decode gives 't5 t17 ...'."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", eos_token=f"t{eos}")


def chat_tokenizer():
    """tiny_tokenizer with a chat template that keeps every turn's words: 't2 <content> t3' per message, then 't4'
    for the answer (the EAGLE data tests)."""
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}"
                         "{% if add_generation_prompt %}t4 {% endif %}")
    return tok


def tiny_llm(hf, spec=None, tokenizer=None, **kw):
    """forerun LLM over a transformers model's weights."""
    from forerun.config import CacheConfig
    from forerun.engine.llm import LLM

    runner = ours_from_hf(hf)
    kw.setdefault("cache", CacheConfig(block_size=4, num_blocks=16384))
    return LLM.from_model(runner.model, tokenizer or tiny_tokenizer(hf.config.vocab_size), spec=spec, device="cpu", **kw)


def sharpen(hf, factor: float):
    """Scale the output head so that the random model's distributions are peaked (more like a trained model)."""
    with torch.no_grad():
        hf.lm_head.weight.mul_(factor)
    return hf
