"""What a prompt may be, checked once at the door: text, or a flat sequence of token ids.

`normalize_prompt` turns every accepted form into a `str` or a `list[int]` and refuses everything else
with one message that says what is accepted. Without it, `bytes` iterate as small ints and were read as
token ids, and None / float arrays / nested lists failed later with TypeErrors that named nothing.
"""
from __future__ import annotations

import numbers
from typing import Any

ACCEPTED = ("a prompt must be a str, or a 1-D sequence of token ids: a list/tuple of ints, "
            "a 1-D numpy integer array or a 1-D torch integer tensor")


def _refuse(what: str) -> ValueError:
    return ValueError(f"{ACCEPTED}; got {what}")


def _describe(prompt: Any) -> str:
    shape = getattr(prompt, "shape", None)
    dtype = getattr(prompt, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(prompt).__module__.split('.')[0]}.{type(prompt).__name__} of shape {tuple(shape)} and dtype {dtype}"
    return type(prompt).__name__


def normalize_prompt(prompt: Any) -> str | list[int]:
    """str -> itself; list/tuple of ints, 1-D numpy integer array or 1-D torch integer tensor -> list[int].

    Raises ValueError (one line, saying what is accepted) for None, bytes/bytearray, floats or bools,
    nested lists, 0-D or 2-D arrays/tensors and anything else. An empty sequence is returned as [] (the
    engine reports an empty prompt with the request it belongs to). Range checks against the
    vocabulary are the engine's, which knows the model."""
    if isinstance(prompt, str):
        return prompt
    if prompt is None:
        raise _refuse("None")
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise _refuse(f"{type(prompt).__name__} (decode it to str first, e.g. prompt.decode('utf-8'))")
    mod = type(prompt).__module__.split(".")[0]
    if mod in ("numpy", "torch") and hasattr(prompt, "shape") and hasattr(prompt, "dtype"):
        return _array_ids(prompt, mod)
    if isinstance(prompt, (list, tuple)):
        out = []
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                if isinstance(t, (list, tuple)) or hasattr(t, "shape") and getattr(t, "ndim", 0) > 0:
                    raise _refuse(f"a nested sequence (element {i} is a {type(t).__name__}); pass one prompt "
                                  "per list entry to generate()")
                raise _refuse(f"{type(prompt).__name__} whose element {i} is {t!r} ({type(t).__name__})")
            out.append(int(t))
        return out
    raise _refuse(_describe(prompt))


def _array_ids(a: Any, mod: str) -> list[int]:
    if a.ndim != 1:
        raise _refuse(f"{_describe(a)} (it must be 1-D: one prompt)")
    if mod == "numpy":
        import numpy as np

        ok = np.issubdtype(a.dtype, np.integer)
    else:
        import torch

        ok = not a.dtype.is_floating_point and not a.dtype.is_complex and a.dtype != torch.bool
    if not ok:
        raise _refuse(f"{_describe(a)} (token ids must be integers)")
    return [int(t) for t in a.tolist()]
