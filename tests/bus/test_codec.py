"""bus.codec: array frames, mixed-shape unions, refusals, frame packing."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from pagebus.bus.codec import Codec, check_channel_union, pack_frames, unpack_frames
from pagebus.bus.messages import BatchResult, ExecuteBatch, FromWorker, Shutdown, ToWorker, WorkerFailed


class Tokens(msgspec.Struct, array_like=True, gc=False, frozen=True, tag="tok", tag_field="t"):
    ids: np.ndarray
    small: np.ndarray
    note: str = ""


class Untagged(msgspec.Struct):
    x: int


def test_large_arrays_travel_as_zero_copy_frames() -> None:
    codec = Codec(inline_limit=64)
    ids = np.arange(10_000, dtype=np.int32)
    small = np.array([[1, 2], [3, 4]], dtype=np.int64)
    frames = codec.encode(Tokens(ids=ids, small=small))
    assert len(frames) == 2 and frames[1].nbytes == ids.nbytes  # body + one aux frame
    assert np.shares_memory(np.frombuffer(frames[1], np.int32), ids)  # not copied on encode
    out = codec.decode([bytes(f) for f in frames], Tokens)
    assert out.ids.dtype == np.int32 and np.array_equal(out.ids, ids)
    assert out.small.shape == (2, 2) and np.array_equal(out.small, small)


def test_non_contiguous_and_empty_arrays() -> None:
    codec = Codec(inline_limit=16)
    msg = Tokens(ids=np.arange(100, dtype=np.int32)[::3], small=np.zeros((0, 4), np.float32))
    out = codec.decode(codec.encode(msg), Tokens)
    assert np.array_equal(out.ids, msg.ids) and out.small.shape == (0, 4)


def test_inline_arrays_do_not_alias_the_body() -> None:
    codec = Codec()
    body = bytearray(codec.encode(Tokens(ids=np.arange(4, dtype=np.int32), small=np.ones(2, np.int32)))[0])
    out = codec.decode([body], Tokens)
    body[:] = bytes(len(body))  # a reused buffer (shm chunk) must not change decoded arrays
    assert out.ids.tolist() == [0, 1, 2, 3]


def test_mixed_array_like_and_map_union_decodes_both() -> None:
    codec = Codec()
    plan = ExecuteBatch(step_id=1, new_seqs=[], cached_seqs=[], finished_seq_ids=["a"])
    assert codec.decode(codec.encode(plan), ToWorker) == plan
    assert codec.decode(codec.encode(Shutdown(drain=False)), ToWorker) == Shutdown(drain=False)
    failed = WorkerFailed(rank=2, reason="x")
    assert codec.decode(codec.encode(failed), FromWorker) == failed
    with pytest.raises(msgspec.ValidationError):  # right shape, wrong channel
        codec.decode(codec.encode(BatchResult(step_id=1, seq_ids=[], token_ids=[])), ToWorker)


def test_unknown_types_raise_type_error_with_a_fix() -> None:
    with pytest.raises(TypeError, match="no pickle"):
        Codec().encode(WorkerFailed(rank=0, reason=object()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="astype"):
        Codec().encode(Tokens(ids=np.array(["a"], dtype=object), small=np.zeros(1)))


def test_numpy_scalars_encode_as_python_numbers() -> None:
    codec = Codec()
    msg = BatchResult(step_id=1, seq_ids=["s"], token_ids=[np.int64(7)])  # type: ignore[list-item]
    assert codec.decode(codec.encode(msg), FromWorker).token_ids == [7]


def test_union_members_need_explicit_tags() -> None:
    with pytest.raises(TypeError, match="explicit short tag"):
        check_channel_union(Shutdown | Untagged)
    with pytest.raises(TypeError, match="explicit short tag"):
        Codec().decode([b"\x80"], Shutdown | Untagged)


def test_pack_frames_round_trip() -> None:
    frames = [b"abc", memoryview(b""), memoryview(np.arange(5, dtype=np.int32)).cast("B")]
    out = unpack_frames(pack_frames(frames))
    assert [bytes(f) for f in out] == [bytes(f) for f in frames]
    with pytest.raises(ValueError):
        unpack_frames(pack_frames(frames) + b"x")
