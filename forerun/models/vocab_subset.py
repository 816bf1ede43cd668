"""A draft model's output head over part of the vocabulary (`SpecConfig(draft_vocab=N)`, `--draft-vocab N`).

Why: a separate draft model pays for its whole output head every draft step (the 0.5B Qwen2.5-Coder draft's head is
151,936 x 896, int8 on the CPU: a large share of its step, docs/quantization.md), yet a drafter only proposes tokens.
The verification rules stay exact for any draft distribution, so the draft may rank part of the vocabulary only,
as EAGLE-3's reduced draft vocabulary does:

* which part: the first N token ids and every token the tokenizer marks special (end of turn, end of text, ...).
  In a byte-level BPE vocabulary (Qwen2, Llama 3, SmolLM2) ids follow the merge order, earliest first, and the
  earliest merges are the most frequent pieces of the tokenizer's training text: no corpus is needed to choose.
* what the head returns: logits for the whole vocabulary, -inf outside the subset, so greedy argmax, top-k / top-p
  and softmax all pick within it, and a sampled draft's q is zero outside it (the exact rule never proposes those
  tokens; the target's mass on them comes back through the residual distribution). Greedy output stays the
  target's own: only acceptance can change.
* the subset's rows are taken from the head as loaded: float heads by slicing, quantized ones (CPU int8 / int4,
  CUDA int4) from their dequantized rows, in the same layout (int8: the rows' own codes and scales, exact; int4
  groups re-fit to their own dequantized values).
"""
from __future__ import annotations

import torch
from torch import nn


def subset_ids(vocab_size: int, first: int, special_ids: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
    """The ids [0, first) and the special ids (deduplicated, sorted), int64."""
    if not 1 <= first <= vocab_size:
        raise ValueError(f"draft vocabulary must be 1..{vocab_size} tokens, got {first}")
    extra = [i for i in special_ids if first <= i < vocab_size]
    return torch.tensor(sorted(set(range(first)) | set(extra)), dtype=torch.int64)


def _rows(head: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A linear of the same kind as `head` holding only the rows `ids`."""
    from . import quant

    if type(head) is nn.Linear:
        sub = nn.Linear(head.in_features, len(ids), bias=head.bias is not None, device=head.weight.device,
                        dtype=head.weight.dtype)
        with torch.no_grad():
            sub.weight.copy_(head.weight[ids.to(head.weight.device)])
            if head.bias is not None:
                sub.bias.copy_(head.bias[ids.to(head.bias.device)])
        sub.weight.requires_grad_(False)
        return sub
    if isinstance(head, quant.Q6KLinear):  # the rows' own blocks (exact)
        return head.select_rows(ids)
    if not hasattr(head, "dequantized"):
        raise ValueError(f"cannot take rows of a {type(head).__name__} output head")
    full = head.dequantized()  # [V, K]
    w = full[ids.to(full.device)]
    bias = getattr(head, "bias", None)
    bias = None if bias is None else bias[ids.to(bias.device)]
    if isinstance(head, quant.Int8Linear):  # the rows' own codes and scales (exact)
        scale = head.w_scale[ids]
        codes = torch.round(w.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return quant.Int8Linear(codes, scale, bias)
    if isinstance(head, quant.Q8Linear):  # the rows' own codes and scales (exact)
        codes, scale = head.codes()
        return quant.Q8Linear(codes[ids], scale[ids].float(), bias)
    if isinstance(head, (quant.Q4Linear, quant.Int4Linear)):
        return quant.make_quantized_linear([w.float()], bias, "int4")
    from .quant_cuda import CudaQ4Linear, CudaQ8Linear

    if isinstance(head, (CudaQ4Linear, CudaQ8Linear)):
        return type(head).from_float(w, bias)
    raise ValueError(f"cannot take rows of a {type(head).__name__} output head")


class SubsetHead(nn.Module):
    """Logits [R, V] from the rows `ids` of a head; -inf for every other token (module docstring)."""

    def __init__(self, head: nn.Module, ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.head = _rows(head, ids)
        self.vocab_size = vocab_size
        self.in_features, self.out_features = head.in_features, vocab_size
        # the ids live where the head's rows do: `scatter` runs inside the CUDA graphs of a GPU draft, where a copy
        # from the CPU cannot be captured (draft_vocab_gpu.py failed so before this)
        dev = next(iter([*self.head.parameters(), *self.head.buffers()]), ids).device
        self.register_buffer("ids", ids.clone().to(dev), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., V]
        return self.scatter(self.head(x))

    def scatter(self, part: torch.Tensor) -> torch.Tensor:
        """[..., n] logits of the subset -> [..., V], -inf elsewhere (FusedLayerOps runs `head` through its own
        kernels, then this)."""
        out = torch.full((*part.shape[:-1], self.vocab_size), float("-inf"), dtype=part.dtype, device=part.device)
        return out.index_copy_(-1, self.ids.to(part.device), part)


def special_token_ids(tok) -> list[int]:
    """The ids a tokenizer marks special or added (end of turn, end of text, chat markers, fill-in-the-middle)."""
    ids = set(getattr(tok, "all_special_ids", []) or [])
    ids |= set((getattr(tok, "added_tokens_decoder", None) or {}).keys())
    return sorted(int(i) for i in ids)


def restrict_head(model: nn.Module, first: int, special_ids=()) -> int:
    """Replace model.lm_head by a SubsetHead over the first `first` ids and the special ids; returns its size.
    A head already restricted to the same ids is left as it is; to other ids: ValueError."""
    vocab = model.config.vocab_size
    ids = subset_ids(vocab, first, special_ids)
    if isinstance(model.lm_head, SubsetHead):
        if torch.equal(model.lm_head.ids.cpu(), ids):
            return len(ids)
        raise ValueError(f"the draft model's head already ranks {len(model.lm_head.ids)} tokens, not these {len(ids)}")
    model.lm_head = SubsetHead(model.lm_head, ids, vocab)
    return len(ids)
