"""Open a checkpoint — a Hugging Face directory of safetensors or a GGUF file — as a ModelConfig,
a stream of tensors under Hugging Face parameter names, and a tokenizer.

    ckpt = load_checkpoint(path)
    ckpt.config                   # forerun ModelConfig
    ckpt.hf_config                # transformers-style config.json dict
    for name, t in ckpt.tensors(): # "model.layers.0.self_attn.q_proj.weight", ... one at a time
        ...
    tok = ckpt.tokenizer()        # transformers PreTrainedTokenizerFast, chat_template set if known

Tensor names follow transformers' Llama / Mistral / Qwen2 / Qwen3 ``*ForCausalLM`` state dicts.
``lm_head.weight`` is absent when the head is tied to the embedding (``config.tie_word_embeddings``).

GGUF tensors are dequantized to float32 one at a time (the 1.5B model is ~7 GB in fp32: never
hold more than one tensor at once beyond what the caller keeps). llama.cpp's converter permutes
the rows of Q and K for Llama-architecture GGUFs (interleaved RoPE); that is undone here, exactly
as transformers' GGUF loader does, so the tensors match the original HF weights' layout. Qwen2 /
Qwen3 GGUFs use NeoX RoPE and are not permuted.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from forerun.config import SUPPORTED_ARCHITECTURES, ModelConfig

from .gguf_embedding import FLOAT_TYPES

__all__ = ["Checkpoint", "GGUFQuantized", "load_checkpoint", "load_tokenizer", "check_tokenizer_fits", "expected_tensor_names",
           "SUPPORTED_GGUF_ARCHITECTURES"]

# general.architecture values we read, and the transformers model_type each becomes.
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_HF_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM"}  # fmt: skip

# GGUF tensor component -> HF module (suffix .weight / .bias is carried over).
_GGUF_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_IGNORED = {"rope_freqs.weight"}  # folded into config.rope_scaling (Llama-3 style)
# Non-parameter entries some HF checkpoints carry; never yielded.
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|\.masked_bias$|\.attn\.bias$")


def _arch_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


def expected_tensor_names(config: ModelConfig) -> list[str]:
    """The HF parameter names a checkpoint of this shape must provide, in load (streaming) order."""
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names.append(p + "input_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj"):
            names.append(f"{p}self_attn.{proj}.weight")
            if config.attention_bias:
                names.append(f"{p}self_attn.{proj}.bias")
        names.append(p + "self_attn.o_proj.weight")
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names.append(p + "post_attention_layernorm.weight")
        names += [f"{p}mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _layer_sort_key(name: str) -> tuple:
    """Order names like a model's state dict: embeddings, layer 0, layer 1, ..., final norm, head."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)), name)
    if name.startswith("model.embed_tokens"):
        return (0, 0, name)
    if name.startswith("lm_head"):
        return (3, 0, name)
    return (2, 0, name)


def _dequantize_rows(data: np.ndarray, type_name: str) -> np.ndarray | None:
    """gguf's own dequantization of a quantized 2-D tensor, ~256 KB of blocks per call and the calls spread over
    torch's threads (numpy releases the GIL): gguf.quants.dequantize takes 16 rows a call, one thread, which spends
    ~2 s on a 151k-row embedding. None for types gguf has no row class for (the caller falls back)."""
    from concurrent.futures import ThreadPoolExecutor

    from gguf import quants

    from .gguf_embedding import row_dequantizer

    dequantize_rows = row_dequantizer(type_name)
    if dequantize_rows is None:
        return None
    qtype = getattr(quants, type_name).qtype
    rows = data.reshape(-1, data.shape[-1])
    step = max(16, (1 << 18) // max(1, rows.shape[1]))
    starts = range(0, rows.shape[0], step)
    out = np.empty((rows.shape[0], quants.quant_shape_from_byte_shape(rows.shape, qtype)[-1]), np.float32)

    def one(i: int) -> None:
        out[i:i + step] = dequantize_rows(rows[i:i + step])

    threads = min(torch.get_num_threads(), len(starts))
    if threads <= 1:
        for i in starts:
            one(i)
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, starts))
    return out


@dataclass(frozen=True)
class GGUFQuantized:
    """A GGUF tensor still in its quantized blocks, for loaders that keep weights quantized
    (forerun/models/quant.py). ``dequantize()`` gives exactly what ``Checkpoint.tensors()`` would."""

    data: Any  # np.ndarray: the raw blocks (a view of the memory-mapped file)
    type_name: str  # GGML type, e.g. "Q4_K"
    shape: tuple  # HF order, e.g. (out_features, in_features)
    unpermute_heads: int | None = None  # Llama-arch Q/K rows to un-permute with this many heads
    where: str = ""  # for error messages

    def rows(self) -> "DequantizedRows | None":
        """Row slices dequantized on demand (2-D tensors of a quantized type, rows not permuted), else None."""
        from .gguf_embedding import row_dequantizer

        if self.data.ndim != 2 or self.unpermute_heads or row_dequantizer(self.type_name) is None:
            return None
        return DequantizedRows(self)

    def dequantize(self) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        try:
            w = _dequantize_rows(self.data, self.type_name) if self.data.ndim == 2 else None
            if w is None:
                w = dequantize(self.data, GGMLQuantizationType[self.type_name])
        except NotImplementedError as e:
            raise ValueError(f"{self.where} has GGML type {self.type_name}, which gguf cannot dequantize: {e}") from e
        w = np.asarray(w, dtype=np.float32)
        if w.shape != self.shape:
            w = w.reshape(self.shape)
        if self.unpermute_heads:
            w = _unpermute_qk(w, self.unpermute_heads)
        if not w.flags.writeable or not w.flags.c_contiguous:
            w = np.array(w, dtype=np.float32, order="C")  # own the memory (F32 is a view of the mmap)
        return torch.from_numpy(w)


class DequantizedRows:
    """``w[i:j]``: rows i..j-1 of a 2-D GGUF tensor in fp32, exactly as ``GGUFQuantized.dequantize()[i:j]``;
    ``w.shape``. The int8 / int4 re-quantizers read a matrix a chunk of rows at a time through it."""

    def __init__(self, g: GGUFQuantized) -> None:
        self._g, self.shape = g, torch.Size(g.shape)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("DequantizedRows takes a slice of rows")
        return torch.from_numpy(_dequantize_rows(self._g.data[rows], self._g.type_name))


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint opened for loading. Cheap to create: tensors are read only when iterated."""

    config: ModelConfig
    hf_config: dict
    source: Path
    format: str = "safetensors"  # "safetensors" | "gguf"
    # safetensors: HF name -> (file, name in file); gguf: HF name -> index into reader.tensors
    _index: dict = field(default_factory=dict, repr=False, compare=False)
    _reader: Any = field(default=None, repr=False, compare=False)  # FastGGUFReader (memory-mapped)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------ tensors

    def tensor_names(self) -> list[str]:
        """Names ``tensors()`` yields, in the same order."""
        return list(self._index)

    def tensors(self, dtype: torch.dtype | None = None, keep_quantized: bool = False
                ) -> Iterator[tuple[str, torch.Tensor | GGUFQuantized]]:
        """Yield (HF name, tensor) one at a time. GGUF tensors are float32 (dequantized);
        safetensors keep their stored dtype. ``dtype`` converts each tensor as it is produced.
        ``keep_quantized``: GGUF tensors of quantized types come as `GGUFQuantized` (raw blocks) instead."""
        if self.format == "gguf":
            it = self._gguf_tensors(keep_quantized)
        else:
            it = self._safetensors_tensors()
        for name, t in it:
            if isinstance(t, GGUFQuantized):
                yield name, t
            else:
                yield name, (t.to(dtype) if dtype is not None and t.dtype != dtype else t)

    def _safetensors_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        handles: dict[Path, Any] = {}
        try:
            for name, (file, key) in self._index.items():
                if file not in handles:
                    handles[file] = safe_open(str(file), framework="pt")
                yield name, handles[file].get_tensor(key)
        finally:
            handles.clear()

    def _gguf_tensors(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | GGUFQuantized]]:
        reader = self._reader
        permute = self.hf_config["model_type"] in ("llama", "mistral") and self._cache.get("gguf_arch") == "llama"
        for name, idx in self._index.items():
            t = reader.tensors[idx]
            heads = None
            if permute and (".attn_q." in t.name or ".attn_k." in t.name):
                heads = self.config.num_heads if ".attn_q." in t.name else self.config.num_kv_heads
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF stores dims in ggml (ne) order
            g = GGUFQuantized(t.data, t.tensor_type.name, shape, heads, f"{self.source}: tensor {t.name}")
            if keep_quantized and len(shape) == 2 and t.tensor_type.name not in FLOAT_TYPES:
                yield name, g
            else:
                yield name, g.dequantize()

    # ------------------------------------------------------------ tokenizer

    def tokenizer(self, path: str | Path | None = None):
        """The checkpoint's tokenizer (transformers PreTrainedTokenizerFast); built once and cached.

        A GGUF uses the tokenizer embedded in its own metadata, never tokenizer files that happen to sit
        in the same folder (they may belong to another model: silently garbage output). ``path`` names
        another tokenizer (a directory of tokenizer files, or a .gguf) instead. Either way the tokenizer
        must fit the model's embedding (every token id < vocab_size), else ValueError. Nothing from a
        model folder is ever executed (trust_remote_code=False) and nothing is asked on stdin."""
        key = "tokenizer" if path is None else ("tokenizer", str(path))
        if key in self._cache:
            return self._cache[key]
        if path is not None:
            tok = load_tokenizer(path)
        elif self.format == "gguf":
            tok = _gguf_tokenizer(self.source, self._cache.get("gguf_chat_template"))
        else:
            tok = _dir_tokenizer(self.source)
        check_tokenizer_fits(tok, self.config.vocab_size, str(path or self.source))
        self._cache[key] = tok
        return tok


def load_tokenizer(path: str | Path):
    """A tokenizer on its own: from a .gguf file's metadata (its tensors are not read) or a directory of
    Hugging Face tokenizer files. Never runs code from the folder (trust_remote_code=False)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {str(p)!r} does not exist")
    if p.is_file() and (p.suffix.lower() == ".gguf" or _has_gguf_magic(p)):
        template = None
        try:
            from .gguf_reader import FastGGUFReader

            template = _gguf_value(FastGGUFReader(str(p)), "tokenizer.chat_template")
        except Exception:  # noqa: BLE001 - the tokenizer build below reports a bad file
            pass
        return _gguf_tokenizer(p, template)
    return _dir_tokenizer(p if p.is_dir() else p.parent)


def check_tokenizer_fits(tok, vocab_size: int, where: str = "") -> None:
    """The tokenizer's vocabulary must index the model's embedding ([vocab_size, hidden]); a larger one
    belongs to another model (its ids would index past the table or mean other text). An embedding padded
    beyond the tokenizer (Qwen2.5: 151936 rows, 151665 tokens) is fine. Special tokens that transformers
    adds on its own beyond the files (Qwen2Tokenizer's pad '<|endoftext|>') are not counted: a prompt
    that uses one past the table is refused by the engine's token-id range check."""
    base = getattr(tok, "vocab_size", None) or len(tok)
    if base > vocab_size:
        raise ValueError(
            f"{where + ': ' if where else ''}tokenizer does not fit the model: its vocabulary has {base} tokens "
            f"but the model's embedding has {vocab_size} rows; use the tokenizer that belongs to this model"
        )


TOKENIZER_CACHE_ENTRIES = 16  # converted GGUF tokenizers kept in <cache_dir()>/tokenizers, most recently used
TOKENIZER_CACHE_MIN_SECONDS = 0.5  # ... those whose conversion took at least this long (real vocabularies)


def _tokenizer_cache_entry(p: Path) -> Path | None:
    """Where the converted tokenizer of GGUF file ``p`` is kept: <cache_dir()>/tokenizers/<key>, the key a hash of
    the file's resolved path, size and mtime and of the transformers version that converted it (a changed file
    or another converter gets a new entry). None when FORERUN_TOKENIZER_CACHE=0."""
    if os.environ.get("FORERUN_TOKENIZER_CACHE", "1") == "0":
        return None
    import hashlib

    import transformers

    from ..paths import cache_dir

    st = p.stat()
    key = f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|1"
    return cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _save_tokenizer_entry(tok, entry: Path) -> None:
    """Write a converted tokenizer to its cache entry (a folder renamed into place: readers never see half of
    one), then keep only the TOKENIZER_CACHE_ENTRIES most recently used. A cache that cannot be written is
    skipped: the tokenizer is built again next time."""
    import shutil

    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(tmp))
        os.replace(tmp, entry)
        entries = sorted((d for d in entry.parent.iterdir() if d.is_dir() and ".tmp" not in d.name),
                         key=lambda d: d.stat().st_mtime, reverse=True)
        for old in entries[TOKENIZER_CACHE_ENTRIES:]:
            shutil.rmtree(old, ignore_errors=True)
    except Exception:  # noqa: BLE001 - the cache is optional: a failed write costs a conversion next time, no more
        shutil.rmtree(tmp, ignore_errors=True)


def _gguf_tokenizer(p: Path, chat_template: str | None):
    """Tokenizer from the GGUF's own metadata. transformers converts it (~15 s for a Qwen vocabulary of 151k
    tokens and merges on the 2-core CPU); a conversion that took TOKENIZER_CACHE_MIN_SECONDS or more is saved in
    forerun's cache (_tokenizer_cache_entry) and later loads read it back from there (~0.8 s; the same vocabulary, merges, special tokens and chat template:
    tests/test_loader.py). transformers' ``from_pretrained(dir, gguf_file=...)`` also
    reads tokenizer.json / tokenizer_config.json from ``dir`` when present, so the file is loaded from a
    private temporary folder that holds nothing but a link to it."""
    import tempfile

    import transformers

    import time

    entry = _tokenizer_cache_entry(p)
    if entry is not None and (entry / "tokenizer.json").exists():
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(entry), local_files_only=True,
                                                             trust_remote_code=False)
            os.utime(entry)  # most recently used
            tok.name_or_path = str(p)
            return tok
        except Exception:  # noqa: BLE001 - a damaged entry: convert again below and overwrite it
            import shutil

            shutil.rmtree(entry, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="forerun-gguf-tok-") as tmp:
            link = Path(tmp) / "model.gguf"
            try:
                link.symlink_to(p.resolve())
            except OSError:  # no symlinks here: the folder must then hold no tokenizer files
                link = p
            tok = transformers.AutoTokenizer.from_pretrained(
                str(link.parent), gguf_file=link.name, local_files_only=True, trust_remote_code=False
            )
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ValueError(f"cannot build a tokenizer from the GGUF metadata of {p}: {e}") from e
    try:
        tok.name_or_path = str(p)
    except Exception:  # noqa: BLE001 - cosmetic only
        pass
    if not getattr(tok, "chat_template", None) and chat_template:
        tok.chat_template = chat_template
    if entry is not None and time.perf_counter() - t0 >= TOKENIZER_CACHE_MIN_SECONDS:
        _save_tokenizer_entry(tok, entry)
    return tok


def _dir_tokenizer(d: Path):
    """Tokenizer from a directory of Hugging Face tokenizer files (no code from the folder is run)."""
    import transformers

    if not any((d / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                          "vocab.json")):  # fmt: skip
        raise FileNotFoundError(f"no tokenizer files (tokenizer.json, tokenizer_config.json, ...) in {d}")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True, trust_remote_code=False)
    except ValueError as e:
        if "trust_remote_code" in str(e) or "custom code" in str(e):
            raise ValueError(f"{d}: its tokenizer needs custom code from the folder, which forerun never runs "
                             "(trust_remote_code=False); use a standard tokenizer.json") from e
        raise
    if not getattr(tok, "chat_template", None):
        for fname in ("chat_template.jinja", "chat_template.json"):
            f = d / fname
            if f.exists():
                text = f.read_text()
                tok.chat_template = json.loads(text)["chat_template"] if fname.endswith(".json") else text
                break
    return tok


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` (convert_hf_to_gguf.py LlamaModel.permute):
    GGUF rows are (head, pair, half) -> HF rows (head, half, pair). Works for weights and biases."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot undo the Q/K permutation: {rows} rows for {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ====================================================================== entry point


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Open a Hugging Face checkpoint directory (config.json + model.safetensors, or shards with
    model.safetensors.index.json) or a ``.gguf`` file. Reads metadata only; tensors load lazily."""
    p = Path(path).expanduser()
    if not p.exists():
        hint = ""
        if "/" not in str(path) and os.sep not in str(path) and not p.suffix:  # a bare name, e.g. a registry name
            hint = f" (if {str(path)!r} is a model name: forerun.models.hub.resolve_model({str(path)!r}) gives its file)"
        raise FileNotFoundError(f"checkpoint path {str(p)!r} does not exist{hint}")
    kind, where = checkpoint_kind(p)
    if kind == "gguf":
        return _load_gguf(where)
    if kind == "hf":
        return _load_hf_dir(where)
    raise (FileNotFoundError if kind == "incomplete" else ValueError)(where)


def checkpoint_kind(path: str | Path) -> tuple[str, Path | str]:
    """What an existing path holds, judged from names and four bytes before anything loads: ("gguf", the file),
    ("hf", the checkpoint directory: the path itself, or the directory of its config.json / .safetensors file),
    ("incomplete", why that directory is not a checkpoint) or ("bad", why the path is not one); the reasons are one
    line each."""
    p = Path(path).expanduser()
    if p.suffix.lower() == ".gguf" and not p.is_dir() or (p.is_file() and _has_gguf_magic(p)):
        return "gguf", p
    d = p if p.is_dir() else p.parent if p.name == "config.json" or p.suffix == ".safetensors" else None
    if d is None:
        return "bad", f"{p}: not a checkpoint (expected a directory with config.json + *.safetensors, or a .gguf file)"
    problem = _hf_dir_problem(d)
    return ("incomplete", problem) if problem else ("hf", d)


def checkpoint_problem(path: str | Path) -> str | None:
    """Why an existing path cannot be opened as a checkpoint (one line), or None (`checkpoint_kind`)."""
    kind, where = checkpoint_kind(path)
    return where if kind in ("bad", "incomplete") else None


def _hf_dir_problem(d: Path) -> str | None:
    if (d / "config.json").is_file():
        return None
    ggufs = sorted(x.name for x in d.glob("*.gguf"))
    hint = f" (it has GGUF files {ggufs}: pass one of them instead)" if ggufs else ""
    return f"{d} is not a Hugging Face checkpoint: no config.json{hint}"


def _has_gguf_magic(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# ====================================================================== HF directories


def _load_hf_dir(d: Path) -> Checkpoint:  # d: a directory checkpoint_kind found to hold config.json
    cfg_file = d / "config.json"
    try:
        hf_config = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise ValueError(f"{cfg_file}: invalid JSON: {e}") from e
    if not isinstance(hf_config, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object")
    try:
        config = ModelConfig.from_hf(hf_config)
    except KeyError as e:
        raise ValueError(f"{cfg_file}: missing config field {e.args[0]!r}") from e
    except ValueError as e:
        raise ValueError(f"{d}: {e}") from e

    files = _safetensors_files(d)
    # name in file -> file
    available: dict[str, Path] = {}
    index_file = d / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index_file}: not a valid safetensors index (needs 'weight_map'): {e}") from e
        for name, fname in weight_map.items():
            f = d / fname
            if not f.is_file():
                raise FileNotFoundError(f"{index_file} lists shard {fname!r} (for {name}) but {f} does not exist")
            available[name] = f
    else:
        from safetensors import safe_open

        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    for name in h.keys():
                        available[name] = f
            except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError
                raise ValueError(f"{f}: not a valid safetensors file: {e}") from e

    def lookup(name: str) -> tuple[Path, str] | None:
        for key in (name, name.removeprefix("model.")):
            if key in available:
                return available[key], key
        return None

    index: dict[str, tuple[Path, str]] = {}
    missing = []
    for name in expected_tensor_names(config):
        hit = lookup(name)
        if hit is None:
            missing.append(name)
        else:
            index[name] = hit
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{d}: checkpoint is missing tensor(s) {missing[:5]}{more}")
    # Anything else the files hold (e.g. o_proj.bias of a Llama with attention_bias) is passed on,
    # so the model builder can reject what it does not support instead of silently dropping it.
    used = {key for _, key in index.values()}
    extras = []
    for key, f in available.items():
        if key in used or _HF_IGNORED.search(key):
            continue
        hf_name = key if key.startswith(("model.", "lm_head.")) else f"model.{key}"
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the embedding is the head
        extras.append((hf_name, (f, key)))
    for hf_name, v in extras:
        index[hf_name] = v
    index = dict(sorted(index.items(), key=lambda kv: _layer_sort_key(kv[0])))
    return Checkpoint(config=config, hf_config=hf_config, source=d, format="safetensors", _index=index)


def _safetensors_files(d: Path) -> list[Path]:
    files = sorted(d.glob("*.safetensors"))
    if not files:
        bins = sorted(x.name for x in d.glob("*.bin")) + sorted(x.name for x in d.glob("*.pt*"))
        hint = f"; found {bins[:3]} — convert them to safetensors" if bins else ""
        raise FileNotFoundError(f"no *.safetensors weight files in {d}{hint}")
    return files


# ====================================================================== GGUF


def _gguf_value(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    if isinstance(v, (float, np.floating)):
        # GGUF stores float32: 9.999999747378752e-06 -> 1e-05, like the original config
        return float(str(np.float32(v)))
    if isinstance(v, np.integer):
        return int(v)
    return v


def _gguf_array_len(reader, key: str) -> int | None:
    """Element count of an array field, parsed or left lazy (FastGGUFReader skips long ones)."""
    if key in reader.lazy_arrays:
        return reader.lazy_arrays[key]
    f = reader.fields.get(key)
    return None if f is None else len(f.data)


def _load_gguf(p: Path) -> Checkpoint:
    try:
        from .gguf_reader import FastGGUFReader
    except ImportError as e:  # pragma: no cover
        raise ImportError("reading GGUF files needs the 'gguf' package (pip install gguf)") from e
    try:
        reader = FastGGUFReader(str(p))
        arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
        for t in reader.tensors:  # truncated files give short views of the mmap
            if t.data.nbytes != t.n_bytes:
                raise ValueError(f"tensor {t.name} has {t.data.nbytes} bytes of data, expected {t.n_bytes}")
    except Exception as e:  # noqa: BLE001 - GGUFReader raises ValueError, IndexError, struct/mmap errors...
        raise ValueError(f"{p}: not a valid GGUF file: {type(e).__name__}: {e}") from e
    if arch is None:
        raise ValueError(f"{p}: not a valid GGUF file: no general.architecture in its metadata")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{p}: unsupported architecture {arch!r} (GGUF general.architecture); "
            f"forerun supports GGUF {', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (and HF {_arch_list()})"
        )
    model_type = SUPPORTED_GGUF_ARCHITECTURES[arch]
    by_name = {t.name: i for i, t in enumerate(reader.tensors)}

    def need(key: str):
        v = _gguf_value(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"{p}: GGUF metadata lacks {arch}.{key}")
        return v

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = _gguf_value(reader, f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some GGUFs
        if len(set(kv_heads)) != 1:
            raise ValueError(f"{p}: per-layer head_count_kv {sorted(set(kv_heads))} is not supported")
        kv_heads = kv_heads[0]
    ffn = need("feed_forward_length")
    if isinstance(ffn, list):
        if len(set(ffn)) != 1:
            raise ValueError(f"{p}: per-layer feed_forward_length is not supported")
        ffn = ffn[0]
    head_dim = _gguf_value(reader, f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = _gguf_value(reader, f"{arch}.rope.dimension_count")
    head_dim = int(head_dim or hidden // heads)

    if "token_embd.weight" not in by_name:
        raise ValueError(f"{p}: GGUF is missing tensor token_embd.weight")
    emb = reader.tensors[by_name["token_embd.weight"]]
    vocab = int(emb.shape[1]) if len(emb.shape) > 1 else None
    if not vocab:
        vocab = _gguf_value(reader, f"{arch}.vocab_size") or _gguf_array_len(reader, "tokenizer.ggml.tokens")
    tied = "output.weight" not in by_name
    n_layers = int(need("block_count"))

    hf_config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [_HF_CLASS[model_type]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(ffn),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(_gguf_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_gguf_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_gguf_value(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": tied,
        "attention_bias": "blk.0.attn_q.bias" in by_name,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    rope_scaling = _gguf_rope_scaling(reader, arch, p, hf_config, by_name)
    if rope_scaling:
        hf_config["rope_scaling"] = rope_scaling
    bos = _gguf_value(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        hf_config["bos_token_id"] = int(bos)
    eos = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = _gguf_value(reader, f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in eos:
            eos.append(int(v))
    if eos:
        hf_config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    pad = _gguf_value(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        hf_config["pad_token_id"] = int(pad)

    try:
        config = ModelConfig.from_hf(hf_config)
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from e

    # HF name -> tensor index, in streaming order; every tensor must be understood.
    index: dict[str, int] = {}
    unknown = []
    for i, t in enumerate(reader.tensors):
        if t.name in _GGUF_IGNORED:
            continue
        hf = _gguf_to_hf_name(t.name)
        if hf is None:
            unknown.append(t.name)
        else:
            index[hf] = i
    if unknown:
        raise ValueError(f"{p}: GGUF has tensors forerun does not know how to map: {unknown[:8]}")
    missing = [n for n in expected_tensor_names(config) if n not in index]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{p}: GGUF is missing tensor(s) (HF names) {missing[:5]}{more}")
    index = dict(sorted(index.items(), key=lambda kv: _layer_sort_key(kv[0])))
    cache = {"gguf_arch": arch, "gguf_chat_template": _gguf_value(reader, "tokenizer.chat_template")}
    return Checkpoint(
        config=config, hf_config=hf_config, source=p, format="gguf", _index=index, _reader=reader, _cache=cache
    )


def _gguf_to_hf_name(name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        mod = _GGUF_BLOCK.get(m.group(2))
        return f"model.layers.{m.group(1)}.{mod}.{m.group(3)}" if mod else None
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[m.group(1)]}.{m.group(2)}"
    return None


def _gguf_rope_scaling(reader, arch: str, p: Path, hf_config: dict, by_name: dict) -> dict | None:
    rtype = _gguf_value(reader, f"{arch}.rope.scaling.type")
    factor = _gguf_value(reader, f"{arch}.rope.scaling.factor")
    if rtype not in (None, "none") and factor not in (None, 1.0, 0.0):
        out: dict[str, Any] = {"rope_type": rtype, "factor": float(factor)}
        orig = _gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
        if orig:
            out["original_max_position_embeddings"] = int(orig)
        return out
    if "rope_freqs.weight" in by_name:
        return _llama3_scaling_from_freqs(reader, by_name["rope_freqs.weight"], p, hf_config)
    return None


def _llama3_scaling_from_freqs(reader, idx: int, p: Path, hf_config: dict) -> dict:
    """Llama-3.1-style GGUFs store RoPE scaling as a ``rope_freqs`` tensor of per-frequency divisors
    (computed by llama.cpp's converter from rope_scaling). Recover the parameters it came from,
    trying the usual values and checking they reproduce the tensor exactly."""
    from gguf.quants import dequantize

    t = reader.tensors[idx]
    got = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
    dim, base = hf_config["head_dim"], hf_config["rope_theta"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if got.shape != freqs.shape:
        raise ValueError(f"{p}: rope_freqs has {got.size} entries, expected {freqs.size} for head_dim {dim}")
    if np.allclose(got, 1.0):
        return None
    factor = float(got.max())
    for orig in (8192, 4096, 2048, 16384, 32768, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)):
            wl = 2 * math.pi / freqs
            smooth = (orig / wl - low) / (high - low)
            want = np.where(wl < orig / high, 1.0, np.where(wl > orig / low, factor, 1 / ((1 - smooth) / factor + smooth)))
            if np.allclose(want, got, rtol=1e-4, atol=1e-5):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": orig}  # fmt: skip
    raise ValueError(f"{p}: cannot recover Llama-3 rope_scaling parameters from its rope_freqs tensor")
