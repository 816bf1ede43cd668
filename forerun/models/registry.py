"""Architecture name -> model class, and building a ready model from a checkpoint on a device."""
from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from ..config import SUPPORTED_ARCHITECTURES, ModelConfig
from .cpu_linear import pack_linears
from .gguf_embedding import GGUFEmbedding, row_dequantizer
from .llama import LlamaForCausalLM
from .loader import Checkpoint, GGUFQuantized, load_checkpoint
from .quant import available, make_quantized_linear, parse_quantize

MODEL_CLASSES = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}  # one decoder (llama.py) for all


def model_class(cfg: ModelConfig):
    try:
        return MODEL_CLASSES[cfg.arch]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.arch!r}; supported: {', '.join(MODEL_CLASSES)}") from None


def build_model(ckpt: Checkpoint, device: torch.device | str, dtype: torch.dtype,
                max_positions: int | None = None, pack_cpu: bool = True, progress: bool = True,
                quantize: str | None = "none") -> LlamaForCausalLM:
    """Instantiate without random init (meta device), then stream the checkpoint's tensors in.
    On the CPU in fp32, linear weights are then packed for oneDNN (see cpu_linear.py).
    ``quantize``: "none" (weights as ``dtype``), "int8" / "int4" (linear weights kept quantized, CPU; see
    quant.py), or None / "auto" (GGUF files stay quantized: int4 / int8 on the CPU, int4 on CUDA; safetensors
    as "none"). On CUDA the quantized layouts are int4 and int8 (`CudaQ4Linear` / `CudaQ8Linear`, gguf_cuda.py)."""
    layout = parse_quantize(quantize, ckpt.format, device)
    if layout != "none":
        if torch.device(device).type != "cpu":
            return build_cuda_quantized_model(ckpt, device, dtype, layout, max_positions, progress)
        return build_quantized_model(ckpt, device, layout, max_positions, progress)
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


def build_cuda_quantized_model(ckpt, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                               layout: str = "int4", max_positions: int | None = None, progress: bool = True):
    """The checkpoint with its linears as CudaQ4Linear / CudaQ8Linear (see gguf_cuda.py's doc) on ``device``,
    everything else in ``dtype``. On cuda ``dtype`` must be bf16; any device and dtype are accepted for tests."""
    from .gguf_cuda import CUDA_LAYOUTS, check_cuda_layout, make_cuda_linear

    if torch.device(device).type == "cuda":
        check_cuda_layout(layout, device, dtype)
    elif layout not in CUDA_LAYOUTS:
        raise ValueError(f"quantize={layout!r} has no CUDA layout")
    model = build_quantized_model(
        ckpt, device, layout, max_positions, progress, dtype=dtype,
        make_linear=lambda parts, bias, path: make_cuda_linear(parts, bias, device, dtype,
                                                               tied_head=(path == "lm_head"
                                                                          and ckpt.config.tie_word_embeddings),
                                                               layout=layout))
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return model


def load_model(path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               max_positions: int | None = None, pack_cpu: bool = True, quantize: str | None = "none",
               progress: bool = True):
    """(model, tokenizer, checkpoint) from a checkpoint directory, a .gguf file or a known model name.
    ``quantize``: see build_model ("none" keeps today's behaviour: GGUF dequantized to ``dtype``)."""
    from .hub import resolve_model

    ckpt = load_checkpoint(resolve_model(path))
    return (build_model(ckpt, device, dtype, max_positions, pack_cpu, progress=progress, quantize=quantize),
            ckpt.tokenizer(), ckpt)


def _linear_parts(model: LlamaForCausalLM) -> dict[str, list[str]]:
    """Module path of every nn.Linear -> the HF weight names it is made of, in row order."""
    out = {}
    for path, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        base, _, leaf = path.rpartition(".")
        parts = model.FUSED.get(leaf)
        out[path] = [f"{base}.{p}" for p in parts] if parts else [path]
    return out


@torch.no_grad()
def build_quantized_model(ckpt: Checkpoint, device: torch.device | str, layout: str,
                          max_positions: int | None = None, progress: bool = True, dtype: torch.dtype = torch.float32,
                          make_linear=None) -> LlamaForCausalLM:
    """Stream the checkpoint in with every linear layer built straight into its quantized module (quant.py),
    so peak memory stays ~ the quantized model plus one fused fp32 matrix. Norms stay fp32; on the CPU a GGUF's
    quantized embedding stays in its blocks (GGUFEmbedding), other embeddings are fp32.
    ``make_linear(parts, bias, module_path)``: another layout's builder (gguf_cuda.py) with the rest as ``dtype``
    on ``device``; it may return None for a tied head to stay tied to the embedding."""
    cpu = make_linear is None  # the CPU layouts (quant.py); their GGUF embedding stays in its blocks too
    if make_linear is None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"quantize={layout!r} is implemented for the CPU and CUDA only (got device {device})")
        if not available(layout):
            raise ValueError(f"quantize={layout!r} needs a torch CPU kernel this build lacks")
        device, dtype = "cpu", torch.float32
        make_linear = lambda parts, bias, path: make_quantized_linear(parts, bias, layout)  # noqa: E731
    cfg = ckpt.config
    cls = model_class(cfg)
    with torch.device("meta"):
        model = cls(cfg, max_positions=max_positions)
    parts = _linear_parts(model)
    biases = {p: model.get_submodule(p).bias is not None for p in parts}
    owner = {}  # HF tensor name -> (module path, part index, "weight" | "bias")
    for path, names in parts.items():
        for i, n in enumerate(names):
            owner[f"{n}.weight"] = (path, i, "weight")
            if biases[path]:
                owner[f"{n}.bias"] = (path, i, "bias")
    tied = cfg.tie_word_embeddings
    for path in parts:  # placeholders without parameters: nothing fp32 gets allocated for the linears
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, nn.Identity())
    model = model.to_empty(device=device).to(dtype)
    model.reset_rope(device)
    params = dict(model.named_parameters())
    pending: dict[str, dict] = {p: {} for p in parts}
    seen: set[str] = set()

    def install(path: str) -> None:
        got = pending.pop(path)
        n = len(parts[path])
        w = [got[(i, "weight")] for i in range(n)]
        b = torch.cat([got[(i, "bias")] for i in range(n)]) if biases[path] else None
        mod = make_linear(w, b, path)
        if mod is None:  # a float head tied to the embedding: share its parameter
            mod = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
            mod.weight = model.model.embed_tokens.weight
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, mod)

    it = tqdm(ckpt.tensors(keep_quantized=True), total=len(ckpt.tensor_names()), desc=f"loading {ckpt.source.name}",
              unit="tensor", disable=not progress, leave=False)
    for name, t in it:
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        if name in owner:
            path, i, kind = owner[name]
            pending[path][(i, kind)] = t
            if len(pending[path]) == len(parts[path]) * (2 if biases[path] else 1):
                install(path)
        elif name in params:
            if name == "model.embed_tokens.weight" and cpu and isinstance(t, GGUFQuantized) \
                    and row_dequantizer(t.type_name) is not None:  # kept in its blocks (gguf_embedding.py)
                model.model.embed_tokens = GGUFEmbedding(t)
                del params[name]  # (the float table placeholder goes now)
            else:
                src = t.dequantize() if isinstance(t, GGUFQuantized) else t
                dst = params[name]
                if tuple(dst.shape) != tuple(src.shape):
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, "
                                     f"expected {tuple(dst.shape)}")
                dst.copy_(src)
            if tied and name == "model.embed_tokens.weight":  # the head is the (still quantized) embedding
                pending["lm_head"][(0, "weight")] = t
                install("lm_head")
        else:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter in {cfg.arch} model")
        seen.add(name)
    missing = [p for p in pending] + [n for n in params if n not in seen]
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    model.quantization = layout
    _release_freed_memory()
    return model.eval()


def _release_freed_memory() -> None:
    """Hand the float temporaries of loading back to the OS (glibc keeps freed heap otherwise, so RSS would
    stay at the load peak)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
