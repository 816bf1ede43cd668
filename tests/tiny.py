"""Tiny random transformers checkpoints, built on the fly: the reference nobody here wrote."""
from __future__ import annotations

import torch
import transformers

from forerun.config import CacheConfig, ModelConfig
from forerun.engine.runner import ModelRunner
from forerun.models.llama import LlamaForCausalLM

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


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


def ours_from_hf(hf, block_size: int = 4, num_blocks: int = 256, **runner_kw) -> ModelRunner:
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    model = LlamaForCausalLM(cfg).eval()
    model.load_weights(hf.state_dict().items())
    return ModelRunner(model, CacheConfig(block_size=block_size, num_blocks=num_blocks), "cpu", torch.float32, **runner_kw)
