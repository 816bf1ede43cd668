"""Which draft fits which target, decided from tokenizers and metadata before any draft weights load.

Drafts are token ids: a draft model helps only if it shares the target's vocabulary exactly (same token
for the same id) and its logits index the same vocabulary. Loading a 0.5B draft takes tens of seconds
and gigabytes, so `check_draft_compatible` reads only the draft's tokenizer and its config (for a GGUF
via the gguf reader: metadata, no tensor is dequantized) and raises ValueError on a mismatch.
`default_draft_for` gives each known model a draft known to fit it, else the n-gram drafter, which fits
every model.
"""
from __future__ import annotations

import os
from pathlib import Path

# target (registry name) -> a draft model known to share its tokenizer and vocabulary
KNOWN_DRAFTS: dict[str, str] = {
    "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct",
}


def _known_name(model: str) -> str | None:
    """The registry name of `model`: the name itself, or the cached file of a known model."""
    from .hub import REGISTRY, _models_dir

    names = {src.name for src in REGISTRY}
    if model in names:
        return model
    try:
        p = Path(model).expanduser().resolve()
    except (OSError, RuntimeError):
        return None
    for src in REGISTRY:
        try:
            if p == (_models_dir(None) / src.filename).resolve():
                return src.name
        except OSError:
            continue
    return None


def default_draft_for(model: str) -> str:
    """The default --draft for target `model`: a known compatible draft model, else "ngram" (prompt
    lookup needs no second model and fits every tokenizer)."""
    name = _known_name(os.fspath(model))
    return KNOWN_DRAFTS.get(name, "ngram") if name else "ngram"


def draft_metadata(draft: str) -> tuple[object, int]:
    """(tokenizer, embedding rows) of a draft model, from its tokenizer files / GGUF metadata only."""
    from .hub import resolve_model
    from .loader import load_checkpoint

    ckpt = load_checkpoint(resolve_model(draft))  # metadata only: tensors are read lazily, never here
    return ckpt.tokenizer(), ckpt.config.vocab_size


_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_vocab(path: str | os.PathLike) -> tuple[list[str] | None, int | None]:
    """(tokenizer.ggml.tokens, rows of token_embd.weight) of a GGUF file, by walking its header only.

    gguf's GGUFReader builds a numpy view per string of every array (the 150k tokens and merges of a
    Qwen GGUF: ~12 s on this machine); this reads the same bytes with struct in well under a second and
    never touches tensor data. Raises ValueError for a file that is not GGUF v2/v3."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        off = 24

        def string(o: int) -> tuple[bytes, int]:
            (n,) = struct.unpack_from("<Q", m, o)
            return m[o + 8: o + 8 + n], o + 8 + n

        def skip(vtype: int, o: int) -> int:
            if vtype in _GGUF_SCALAR:
                return o + struct.calcsize(_GGUF_SCALAR[vtype])
            if vtype == 8:
                return string(o)[1]
            if vtype == 9:
                etype, count = struct.unpack_from("<IQ", m, o)
                o += 12
                if etype in _GGUF_SCALAR:
                    return o + count * struct.calcsize(_GGUF_SCALAR[etype])
                for _ in range(count):
                    o = skip(etype, o)
                return o
            raise ValueError(f"{path}: unknown GGUF value type {vtype}")

        tokens = None
        for _ in range(n_kv):
            key, off = string(off)
            (vtype,) = struct.unpack_from("<I", m, off)
            off += 4
            if key == b"tokenizer.ggml.tokens" and vtype == 9:
                etype, count = struct.unpack_from("<IQ", m, off)
                off += 12
                if etype != 8:
                    raise ValueError(f"{path}: tokenizer.ggml.tokens is not a string array")
                tokens = []
                for _ in range(count):
                    b, off = string(off)
                    tokens.append(b.decode("utf-8", "replace"))
            else:
                off = skip(vtype, off)
        rows = None
        for _ in range(n_tensors):
            name, off = string(off)
            (n_dims,) = struct.unpack_from("<I", m, off)
            dims = struct.unpack_from(f"<{n_dims}Q", m, off + 4)
            off += 4 + 8 * n_dims + 12  # dims, then type (uint32) and offset (uint64)
            if name == b"token_embd.weight" and n_dims == 2:
                rows = int(dims[1])  # ggml order: (hidden, vocab)
        return tokens, rows


def _gguf_tokens(draft: str) -> tuple[list[str], int] | None:
    """(token strings by id, embedding rows) straight from a GGUF draft's header, or None if not a GGUF
    (or it stores no token list)."""
    from .hub import resolve_model
    from .loader import _has_gguf_magic

    path = resolve_model(draft)
    if not (path.is_file() and (path.suffix.lower() == ".gguf" or _has_gguf_magic(path))):
        return None
    tokens, rows = read_gguf_vocab(path)
    if tokens is None or rows is None:
        return None
    return tokens, rows


def _vocab_mismatch(tv: dict, dv: dict) -> str:
    diff = sorted(set(tv.items()) ^ set(dv.items()), key=lambda x: x[1])[:3]
    return f"their tokenizers differ ({len(tv)} vs {len(dv)} tokens; e.g. {diff})"


def _disagreements(tv: dict[str, int], draft_by_id: dict[int, str]) -> tuple[int, int]:
    """(ids both tokenizers define, of which how many map to different tokens). Ids only one side has
    (an embedding padded with [PAD] tokens, added specials) are not compared: the other side never
    produces them, and verification works on ids over the same embedding rows."""
    common = differ = 0
    for tok, i in tv.items():
        d = draft_by_id.get(i)
        if d is not None:
            common += 1
            differ += d != tok
    return common, differ


def check_draft_compatible(target_tokenizer, target_vocab_size: int, draft: str) -> None:
    """Raise ValueError unless the draft model `draft` (a name, .gguf file or HF directory) maps every token
    id both tokenizers define to the same token, and has the target's embedding size (the same id space).
    Reads the draft's tokenizer and config only (never its weights); call it before loading the draft.
    A GGUF draft is judged from its header's token list (< 1 s); only when that list nearly matches but
    not exactly is the real tokenizer built (tens of seconds for 150k tokens). Non-model drafters
    ("ngram", "none", "early-exit:N") always fit. An unknown name or a missing path is a ValueError too."""
    if not draft or draft in ("ngram", "none") or str(draft).startswith(("early-exit", "eagle:")):
        return  # (an EAGLE head drafts with the target's own vocabulary or its d2t map)
    tv = target_tokenizer.get_vocab()
    try:
        fast = _gguf_tokens(draft)
        if fast is not None:  # GGUF: compare the stored token list first
            tokens, draft_vocab = fast
            common, differ = _disagreements(tv, dict(enumerate(tokens)))
            if not common or differ > 0.01 * common:  # another tokenizer, not a representation quirk
                raise ValueError(_vocab_mismatch(tv, {t: i for i, t in enumerate(tokens)}))
            if draft_vocab != target_vocab_size:
                raise ValueError(f"its vocabulary has {draft_vocab} rows, the target's {target_vocab_size}")
            if differ == 0:
                return
        draft_tok, draft_vocab = draft_metadata(draft)  # exact check through the real tokenizer
        dv = draft_tok.get_vocab()
        common, differ = _disagreements(tv, {i: t for t, i in dv.items()})
        if not common or differ:
            raise ValueError(_vocab_mismatch(tv, dv))
        if draft_vocab != target_vocab_size:
            raise ValueError(f"its vocabulary has {draft_vocab} rows, the target's {target_vocab_size}")
    except FileNotFoundError as e:
        raise ValueError(f"draft {draft!r}: {e}") from e
    except ValueError as e:
        if str(e).startswith(("their tokenizers", "its vocabulary")):
            raise ValueError(f"draft {draft!r} does not fit this target: {e}; a draft model must share the "
                             "target's tokenizer and vocabulary (or use --draft ngram)") from None
        raise
