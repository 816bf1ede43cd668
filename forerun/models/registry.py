"""Architecture name -> model class, and building a ready model from a checkpoint on a device."""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..config import ModelConfig
from .cpu_linear import pack_linears
from .llama import LlamaForCausalLM
from .loader import Checkpoint, load_checkpoint

MODEL_CLASSES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
                 "qwen3": LlamaForCausalLM}


def model_class(cfg: ModelConfig):
    try:
        return MODEL_CLASSES[cfg.arch]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.arch!r}; supported: {', '.join(MODEL_CLASSES)}") from None


def build_model(ckpt: Checkpoint, device: torch.device | str, dtype: torch.dtype,
                max_positions: int | None = None, pack_cpu: bool = True, progress: bool = True) -> LlamaForCausalLM:
    """Instantiate without random init (meta device), then stream the checkpoint's tensors in.
    On the CPU in fp32, linear weights are then packed for oneDNN (see cpu_linear.py)."""
    cls = model_class(ckpt.config)
    with torch.device("meta"):
        model = cls(ckpt.config, max_positions=max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()  # materialising from meta may replace the shared parameter
    model.reset_rope(device)
    names = ckpt.tensor_names()
    model.load_weights(tqdm(ckpt.tensors(), total=len(names), desc=f"loading {ckpt.source.name}", unit="tensor",
                            disable=not progress, leave=False))
    if pack_cpu and torch.device(device).type == "cpu":
        pack_linears(model)
    return model.eval()


def load_model(path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               max_positions: int | None = None, pack_cpu: bool = True):
    """(model, tokenizer, checkpoint) from a checkpoint directory, a .gguf file or a known model name."""
    from .hub import resolve_model

    ckpt = load_checkpoint(resolve_model(path))
    return build_model(ckpt, device, dtype, max_positions, pack_cpu), ckpt.tokenizer(), ckpt
