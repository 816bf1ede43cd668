"""gguf's ``GGUFReader``, parsed ~100x faster (a Qwen GGUF: ~10-16 s -> ~0.1 s on the 2-core CPU).

gguf's reader builds one numpy view per scalar and per string while it parses the metadata, through
``numpy.memmap.__getitem__`` (Python code per view): the 151,936 tokens, 151,387 merges and token types of a
Qwen2.5 GGUF are ~900k views. Two changes, nothing else of the parent class is touched:

* the memory map is held as a plain ndarray view of the same pages (slicing it runs no Python);
* arrays longer than ``LAZY_ARRAY`` elements (the tokenizer's vocabulary, merges, scores, token types) are
  not parsed: their byte span is walked (the string lengths only) and the field is left out of ``fields``;
  ``lazy_arrays[name]`` holds its element count. The model loader needs only their length; the tokenizer is
  built by transformers from the file itself (forerun/models/loader.py).

Tensors (``.tensors``: names, types, shapes, data views of the map) are exactly the parent's.
"""
from __future__ import annotations

import struct

import numpy as np
from gguf import GGUFReader, GGUFValueType

LAZY_ARRAY = 4096  # arrays with more elements than this are skipped (see the module docstring)
_ITEM_BYTES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1, GGUFValueType.UINT16: 2,
               GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
               GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}  # fmt: skip


class FastGGUFReader(GGUFReader):
    """``GGUFReader(path)`` with the two changes of the module docstring; ``lazy_arrays``: {field name:
    element count} of the arrays left out of ``fields``."""

    def __init__(self, path, mode: str = "r"):
        self.lazy_arrays: dict[str, int] = {}
        super().__init__(path, mode)
        for name, f in list(self.fields.items()):
            # a skipped array: its header parts (key length, key, type, item type, count) and no data
            if f.types[:1] == [GGUFValueType.ARRAY] and not f.data and len(f.parts) == 5 and int(f.parts[4][0]):
                self.lazy_arrays[name] = int(f.parts[4][0])
                del self.fields[name]

    # the parent assigns self.data = np.memmap(...) first thing: keep a plain ndarray view of it instead
    @property
    def data(self) -> np.ndarray:
        return self._map

    @data.setter
    def data(self, value) -> None:
        self._map = value.view(np.ndarray) if isinstance(value, np.memmap) else value
        self._mv = memoryview(self._map) if self._map.dtype == np.uint8 and self._map.ndim == 1 else None

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or self._mv is None:
            return super()._get_field_parts(orig_offs, raw_type)
        itype, count = struct.unpack_from("<IQ", self._mv, orig_offs)
        if count <= LAZY_ARRAY or (itype not in _ITEM_BYTES and itype != GGUFValueType.STRING):
            return super()._get_field_parts(orig_offs, raw_type)
        offs = orig_offs + 12
        if itype == GGUFValueType.STRING:
            unpack, mv = struct.unpack_from, self._mv
            for _ in range(count):
                offs += 8 + unpack("<Q", mv, offs)[0]
        else:
            offs += count * _ITEM_BYTES[GGUFValueType(itype)]
        if offs > len(self._mv):
            raise ValueError(f"array of {count} elements at offset {orig_offs} runs past the end of the file")
        header = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        return offs - orig_offs, header, [], [GGUFValueType.ARRAY, GGUFValueType(itype)]
