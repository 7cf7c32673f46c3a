"""msgpack codec for bus messages: one typed decoder per channel, arrays as zero-copy frames.

A message travels as a list of frames:

    frame 0        msgpack body of the Struct
    frames 1..k    raw bytes of numpy arrays of at least `inline_limit` bytes (aux frames)

An ndarray field is encoded as msgpack ext `EXT_NDARRAY` holding `(dtype, shape, data)`: `data` is
the raw bytes for small arrays, or the index of its aux frame for large ones, so the big buffers are
never copied into the body (the idea of vLLM's `aux_buffers`). `list[int]` fields stay plain msgpack.

Only Structs, builtins, numpy numeric arrays and numpy scalars are encodable. Anything else raises
`TypeError` saying what to do instead; there is no pickle fallback, on purpose.
"""

from __future__ import annotations

import struct
import types
import typing
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

Buffer = bytes | bytearray | memoryview
Frames = list[Buffer]

EXT_NDARRAY = 1
DEFAULT_INLINE_LIMIT = 1024  # bytes; below this an extra frame costs more than the copy into the body
_NUMERIC_KINDS = "biuf"  # bool, int, uint, float; never object/str/void

# msgpack type markers of the first byte, to route a frame to the array_like or the map decoder.
_ARRAY_FIRST = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
_MAP_FIRST = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def union_members(tp: Any) -> tuple[Any, ...]:
    """The members of `A | B` or `Union[A, B]`; a single type is a union of one."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def check_channel_union(tp: Any) -> None:
    """Raise TypeError unless every member is a Struct with an explicit, union-unique tag.

    Explicit tags are what keep the wire stable when a class is renamed (msgspec's `tag=True` would
    use the class name).
    """
    seen: dict[object, str] = {}
    for m in union_members(tp):
        if not _is_struct(m):
            raise TypeError(f"channel union member {m!r} is not a msgspec.Struct")
        tag = m.__struct_config__.tag
        if tag is None or m.__struct_config__.tag_field != "t" or tag == m.__name__:
            raise TypeError(f"{m.__name__} needs an explicit short tag: tag='...', tag_field='t'")
        if tag in seen:
            raise TypeError(f"tag {tag!r} is used by both {seen[tag]} and {m.__name__}")
        seen[tag] = m.__name__


class _ChannelDecoder:
    """A decoder for one channel union, split in two when it mixes array_like and map Structs."""

    def __init__(self, tp: Any, ext_hook: Any, dec_hook: Any) -> None:
        members = union_members(tp)
        if len(members) > 1:
            check_channel_union(tp)
        arrays = [m for m in members if _is_struct(m) and m.__struct_config__.array_like]
        maps = [m for m in members if m not in arrays]

        def make(ms: list[Any]) -> msgspec.msgpack.Decoder[Any] | None:
            if not ms:
                return None
            u = ms[0] if len(ms) == 1 else typing.Union[tuple(ms)]  # noqa: UP007 (runtime union)
            return msgspec.msgpack.Decoder(u, ext_hook=ext_hook, dec_hook=dec_hook)

        mixed = bool(arrays and maps)
        self._single = None if mixed else msgspec.msgpack.Decoder(tp, ext_hook=ext_hook, dec_hook=dec_hook)
        self._array = make(arrays) if mixed else None
        self._map = make(maps) if mixed else None

    def decode(self, body: Buffer) -> Any:
        if self._single is not None:
            return self._single.decode(body)
        first = body[0] if len(body) else -1
        if first in _ARRAY_FIRST:
            return self._array.decode(body)  # type: ignore[union-attr]
        if first in _MAP_FIRST:
            return self._map.decode(body)  # type: ignore[union-attr]
        raise msgspec.DecodeError(f"frame is neither a msgpack array nor a map (first byte {first:#x})")


class Codec:
    """Encode bus messages to frames and decode frames with a cached typed decoder per type.

    Not thread-safe: decoding parks the current frames on the instance for the ext hook (as vLLM's
    decoder does). Use one Codec per thread; it is cheap.
    """

    def __init__(self, inline_limit: int = DEFAULT_INLINE_LIMIT) -> None:
        self.inline_limit = inline_limit
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoders: dict[Any, _ChannelDecoder] = {}
        self._aux_out: Frames = []
        self._aux_in: Sequence[Buffer] = ()

    # ------------------------------------------------------------------------ encode
    def encode(self, msg: Any) -> Frames:
        """Frames for `msg`: the body first, then one frame per large array (not copied).

        The array buffers are referenced, not copied: do not mutate them until the send completes.
        """
        self._aux_out = []
        try:
            body = self._encoder.encode(msg)
            return [body, *self._aux_out]
        finally:
            self._aux_out = []

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in _NUMERIC_KINDS or obj.dtype.hasobject:
                raise TypeError(
                    f"cannot send a numpy array of dtype {obj.dtype}: only bool/int/uint/float arrays "
                    "travel on the bus; convert it (e.g. arr.astype(np.int32))"
                )
            arr = np.ascontiguousarray(obj)
            data: bytes | int
            if arr.nbytes < self.inline_limit:
                data = arr.tobytes()
            else:
                data = len(self._aux_out) + 1  # frame index; frame 0 is the body
                self._aux_out.append(arr.data.cast("B"))  # arr.data is memoryview(arr), typed
            payload = msgspec.msgpack.encode((arr.dtype.str, arr.shape, data))
            return msgspec.msgpack.Ext(EXT_NDARRAY, payload)
        if isinstance(obj, np.integer):  # e.g. a token id from argmax: lossless as int
            return int(obj)
        if isinstance(obj, np.floating):
            return float(obj)
        raise TypeError(
            f"cannot send a {type(obj).__module__}.{type(obj).__qualname__} on the bus: messages carry "
            "msgspec Structs, builtins and numeric numpy arrays only (no pickle). Convert it (tensor: "
            ".numpy() or .tolist()) or add a typed field to a Struct in bus/messages.py."
        )

    # ------------------------------------------------------------------------ decode
    def decoder(self, tp: Any) -> _ChannelDecoder:
        dec = self._decoders.get(tp)
        if dec is None:
            dec = self._decoders[tp] = _ChannelDecoder(tp, self._ext_hook, self._dec_hook)
        return dec

    def decode(self, frames: Sequence[Buffer], tp: Any) -> Any:
        """Decode frames produced by `encode` as `tp` (a Struct or a channel union).

        Large arrays are read-only views on their frames (zero-copy); copy them to write.
        """
        if not frames:
            raise ValueError("no frames to decode")
        self._aux_in = frames
        try:
            return self.decoder(tp).decode(frames[0])
        finally:
            self._aux_in = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != EXT_NDARRAY:
            raise msgspec.DecodeError(f"unknown msgpack ext code {code}")
        dtype, shape, ref = msgspec.msgpack.decode(data)
        if isinstance(ref, int):
            if not 0 < ref < len(self._aux_in):
                raise msgspec.DecodeError(f"array refers to frame {ref}, have {len(self._aux_in)}")
            buf: Buffer = self._aux_in[ref]
            return np.frombuffer(buf, dtype=dtype).reshape(shape)
        # Inline bytes are a view on frame 0, which the caller may reuse (e.g. a shm chunk): copy.
        return np.frombuffer(ref, dtype=dtype).reshape(shape).copy()

    @staticmethod
    def _dec_hook(tp: Any, obj: Any) -> Any:
        if tp is np.ndarray and isinstance(obj, np.ndarray):
            return obj
        raise msgspec.ValidationError(f"expected {tp!r}, got {type(obj).__name__}")


# ----------------------------------------------------------------- one buffer, many frames
# Transports that carry one buffer (the shm ring) pack frames as: u32 count, u64 length each, bytes.
def pack_frames(frames: Sequence[Buffer]) -> bytes:
    header = struct.pack(f"<I{len(frames)}Q", len(frames), *(memoryview(f).nbytes for f in frames))
    return b"".join([header, *frames])


def unpack_frames(buf: Buffer) -> list[memoryview]:
    mv = memoryview(buf).cast("B")
    (n,) = struct.unpack_from("<I", mv, 0)
    lengths = struct.unpack_from(f"<{n}Q", mv, 4)
    out, pos = [], 4 + 8 * n
    for length in lengths:
        out.append(mv[pos : pos + length])
        pos += length
    if pos != mv.nbytes:
        raise ValueError(f"packed frames hold {pos} bytes, buffer has {mv.nbytes}")
    return out
