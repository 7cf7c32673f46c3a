"""A GGUF file's key-values and tensors, read straight from its header with `struct`.

gguf.GGUFReader builds a numpy view for every part of every field: for a 49k-token vocabulary
(tokens, types, merges: ~300k parts) that takes 5-8 s per open, most of the default model's
start-up. Here the header is parsed in one pass over bytes (~0.1 s), and each tensor is a view
of a read-only memory map laid out as GGUFReader lays it out (a quantized tensor: uint8
[rows, bytes per row]; a float one: its dtype, [rows, cols]), so gguf.quants still dequantizes it.
Little-endian files only (all that llama.cpp writes on the machines we serve from).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = 0x46554747  # b"GGUF"
# GGUF value types with a fixed size, as struct codes; 8 is a string, 9 an array.
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
_PLAIN: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: [rows, cols] for a matrix (GGUF stores it reversed)
    data: np.ndarray  # read-only view of the file: typed values, or uint8 blocks per row


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]  # strings decoded as UTF-8 (bytes inside arrays), arrays as lists
    tensors: list[GGUFTensor]


class _Header:
    """A cursor over the header bytes; raises struct.error when they run out."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, code: str) -> Any:
        (v,) = struct.unpack_from("<" + code, self.data, self.pos)
        self.pos += struct.calcsize(code)
        return v

    def string(self) -> bytes:
        n = self.take("Q")
        if self.pos + n > len(self.data):
            raise struct.error("short read")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def value(self, kind: int, keep: bool) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.take("I"), self.take("Q")
            if elem in _FIXED:
                code = _FIXED[elem]
                size = struct.calcsize(code) * count
                if self.pos + size > len(self.data):
                    raise struct.error("short read")
                vals = list(struct.unpack_from(f"<{count}{code}", self.data, self.pos)) if keep else []
                self.pos += size
                return vals
            items = [self.value(elem, keep) for _ in range(count)]
            return items if keep else []
        return self.take(_FIXED[kind])


def _parse(
    data: bytes, keep: Callable[[str], bool], with_tensors: bool
) -> tuple[dict[str, Any], list[Any], int]:
    h = _Header(data)
    magic, _version, n_tensors, n_kv = h.take("I"), h.take("I"), h.take("Q"), h.take("Q")
    if magic != _MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = h.string().decode()
        kind = h.take("I")
        wanted = keep(key)
        v = h.value(kind, wanted)
        if wanted:
            fields[key] = v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v
    infos = []
    if with_tensors:
        for _ in range(n_tensors):
            name = h.string().decode()
            dims = [h.take("Q") for _ in range(h.take("I"))]
            infos.append((name, dims, h.take("I"), h.take("Q")))
    return fields, infos, h.pos


def _read_header(
    path: str, keep: Callable[[str], bool], with_tensors: bool
) -> tuple[dict[str, Any], list[Any], int]:
    with open(path, "rb") as f:
        data = f.read(1 << 20)
        while True:
            try:
                return _parse(data, keep, with_tensors)
            except struct.error:  # the header is longer than what was read so far
                more = f.read(max(len(data), 1 << 20))
                if not more:
                    raise ValueError(f"{path}: truncated GGUF header") from None
                data += more


def read_gguf_fields(path: str, keep: Callable[[str], bool] = lambda key: True) -> dict[str, Any]:
    """The key-values `keep` selects (the others are skipped without being decoded)."""
    return _read_header(path, keep, with_tensors=False)[0]


def read_gguf(path: str, keep: Callable[[str], bool] = lambda key: True) -> GGUFFile:
    """Key-values (those `keep` selects) and every tensor, as views of a read-only memory map."""
    fields, infos, end = _read_header(path, lambda k: k == "general.alignment" or keep(k), with_tensors=True)
    align = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
    if not keep("general.alignment"):
        fields.pop("general.alignment", None)
    start = -(-end // align) * align  # tensor data begins at the first aligned offset
    mm = np.memmap(path, mode="r")
    tensors = []
    for name, dims, kind, offset in infos:
        qtype = GGMLQuantizationType(kind)
        block, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(int(d) for d in reversed(dims))
        nbytes = int(np.prod(shape)) // block * type_size
        raw = mm[start + offset : start + offset + nbytes]
        if qtype in _PLAIN:  # values numpy has a type for
            data = raw.view(_PLAIN[qtype]).reshape(shape)
        else:  # quantized (and BF16): uint8 [rows, blocks per row * block bytes]
            data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
        tensors.append(GGUFTensor(name, qtype, shape, data))
    return GGUFFile(fields, tensors)
