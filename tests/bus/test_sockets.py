"""bus.sockets: per-engine runtime dirs, endpoints, and the Channel send/recv contract."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from pagebus.bus.messages import AbortRequest, ToScheduler
from pagebus.bus.sockets import Channel, make_endpoint, make_runtime_dir, make_socket


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_runtime_dirs_are_unique_and_removed(tmp_path: os.PathLike[str]) -> None:
    a, b = make_runtime_dir(str(tmp_path)), make_runtime_dir(str(tmp_path))
    assert a.path != b.path and os.path.isdir(a.path)
    assert a.endpoint("sched") == f"ipc://{a.path}/sched.sock"
    a.close()
    b.close()
    assert not os.path.exists(a.path) and not os.path.exists(b.path) and a.closed


def test_endpoint_choice_and_path_limit(tmp_path: os.PathLike[str]) -> None:
    with make_runtime_dir(str(tmp_path)) as rd:
        assert make_endpoint("x", rd, "127.0.0.1:5555") == "tcp://127.0.0.1:5555"
        assert make_endpoint("x", rd).startswith("ipc://")
        with pytest.raises(ValueError, match="exceeds"):
            rd.endpoint("n" * 120)
    with pytest.raises(ValueError):
        make_endpoint("x", None)


def test_socket_options_are_explicit(ctx: zmq.Context, tmp_path: os.PathLike[str]) -> None:
    with make_runtime_dir(str(tmp_path)) as rd:
        s = make_socket(ctx, zmq.PULL, rd.endpoint("p"), bind=True, hwm=123, linger_ms=45)
        assert (s.getsockopt(zmq.LINGER), s.getsockopt(zmq.SNDHWM), s.getsockopt(zmq.RCVHWM)) == (
            45,
            123,
            123,
        )
        s.close()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_channel_round_trip(ctx: zmq.Context, tmp_path: os.PathLike[str], transport: str) -> None:
    with make_runtime_dir(str(tmp_path)) as rd:
        ep = rd.endpoint("in") if transport == "ipc" else "tcp://127.0.0.1:*"
        rx = Channel.open(ctx, zmq.PULL, ep, bind=True, recv_type=ToScheduler)
        ep = rx.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        tx = Channel.open(ctx, zmq.PUSH, ep, bind=False)
        msgs = [AbortRequest(request_ids=[str(i)]) for i in range(100)]
        for msg in msgs:
            tx.send(msg, timeout_s=5.0)
        assert [rx.recv(timeout_s=5.0) for _ in msgs] == msgs
        tx.close()
        rx.close()


def test_recv_times_out_without_spinning(ctx: zmq.Context, tmp_path: os.PathLike[str]) -> None:
    with make_runtime_dir(str(tmp_path)) as rd:
        rx = Channel.open(ctx, zmq.PULL, rd.endpoint("in"), bind=True, recv_type=ToScheduler)
        cpu0, t0 = time.process_time(), time.monotonic()
        with pytest.raises(TimeoutError):
            rx.recv(timeout_s=0.3)
        assert time.monotonic() - t0 >= 0.29
        assert time.process_time() - cpu0 < 0.1  # blocked in poll, not busy-waiting
        rx.close()


def test_send_times_out_when_nobody_listens(ctx: zmq.Context, tmp_path: os.PathLike[str]) -> None:
    with make_runtime_dir(str(tmp_path)) as rd:
        # A connecting PUSH queues up to its HWM for a peer that may bind later; then it blocks.
        tx = Channel.open(ctx, zmq.PUSH, rd.endpoint("nobody"), bind=False, hwm=2)
        with pytest.raises(TimeoutError, match="AbortRequest"):
            for _ in range(10):
                tx.send(AbortRequest(request_ids=[]), timeout_s=0.1)
        tx.close(linger_ms=0)


def test_array_frames_cross_a_socket(ctx: zmq.Context, tmp_path: os.PathLike[str]) -> None:
    import msgspec

    class Arr(msgspec.Struct, tag="arr", tag_field="t"):
        a: np.ndarray

    with make_runtime_dir(str(tmp_path)) as rd:
        rx = Channel.open(ctx, zmq.PULL, rd.endpoint("a"), bind=True, recv_type=Arr)
        tx = Channel.open(ctx, zmq.PUSH, rd.endpoint("a"), bind=False)
        a = np.arange(100_000, dtype=np.int32)
        tx.send(Arr(a=a))
        assert np.array_equal(rx.recv(timeout_s=5.0).a, a)
        tx.close()
        rx.close()
