"""Targets for child processes in the bus tests (module level, so `spawn` can import them)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq
from pagebus.bus.messages import PROTOCOL_VERSION, Hello, ModelFacts, Ready, StartupFailed
from pagebus.bus.proc import spawn
from pagebus.bus.shm import RingHandle, ShmRingReader
from pagebus.bus.sockets import Channel


def _block() -> None:
    """Wait until killed. Not on a multiprocessing.Event: set() hangs if a waiter was SIGKILLed."""
    threading.Event().wait(120.0)


def payload(seed: int, i: int, size: int) -> bytes:
    return random.Random(seed * 1_000_003 + i).randbytes(size)


def payload_sizes(seed: int, n: int, max_chunk: int) -> list[int]:
    """The edges first, then random sizes with about one in six over the chunk (overflow path)."""
    rng = random.Random(seed)
    edges = [0, 1, max_chunk, max_chunk + 1, 0]
    rand = [
        rng.randint(max_chunk + 1, 4 * max_chunk) if rng.random() < 0.17 else rng.randint(0, max_chunk)
        for _ in range(n - len(edges))
    ]
    return edges + rand


# ---------------------------------------------------------------------------- shm readers
def ring_reader(handle: bytes, rank: int, seed: int, sizes: list[int], results: Any) -> None:
    """Read every payload, check content and order, report (rank, n_ok, first_bad_index)."""
    reader = ShmRingReader(msgspec.msgpack.decode(handle, type=RingHandle), rank)
    bad = -1
    for i, size in enumerate(sizes):
        got = reader.read(timeout_s=30.0)
        if bad < 0 and bytes(got) != payload(seed, i, size):
            bad = i
    results.put((rank, len(sizes), bad))
    reader.close()


def stuck_reader(handle: bytes, rank: int) -> None:
    """Attach, then never read: a live reader that is not keeping up (the test terminates it)."""
    reader = ShmRingReader(msgspec.msgpack.decode(handle, type=RingHandle), rank)
    _block()
    reader.close()


def idle_reader(handle: bytes, rank: int, attached: Any, results: Any) -> None:
    """Attach, then block in read() until the writer publishes one payload."""
    reader = ShmRingReader(msgspec.msgpack.decode(handle, type=RingHandle), rank)
    attached.set()
    results.put(bytes(reader.read(timeout_s=60.0)))
    reader.close()


# ------------------------------------------------------------------------- proc children
@contextlib.contextmanager
def _handshake(endpoint: str) -> Iterator[Channel]:
    ctx = zmq.Context()
    ch = Channel.open(ctx, zmq.PUSH, endpoint, bind=False, linger_ms=2000)
    try:
        yield ch
    finally:
        ch.close()
        ctx.term()  # waits up to linger for the handshake messages to leave


def good_child(endpoint: str, role: str, rank: int) -> None:
    with _handshake(endpoint) as ch:
        ch.send(Hello(version=PROTOCOL_VERSION, role=role, rank=rank, pid=os.getpid()))
        ch.send(Ready(role=role, rank=rank, model=model_facts(rank)))
    _block()


def model_facts(rank: int) -> ModelFacts:
    return ModelFacts(
        num_kv_blocks=100 + rank,
        max_model_len=64,
        vocab_size=10,
        eos_token_id=None,
        dtype="float32",
        device="cpu",
        num_threads=1,
    )


def failing_child(endpoint: str, role: str, rank: int) -> None:
    """Say why start-up failed, as a worker does when its model cannot load, then exit non-zero."""
    with _handshake(endpoint) as ch:
        ch.send(Hello(version=PROTOCOL_VERSION, role=role, rank=rank, pid=os.getpid()))
        ch.send(StartupFailed(role=role, rank=rank, reason=f"{role}-{rank} failed during start-up: no GPU"))
    raise SystemExit(1)


def crash_child(endpoint: str, role: str, rank: int) -> None:
    with _handshake(endpoint) as ch:
        ch.send(Hello(version=PROTOCOL_VERSION, role=role, rank=rank, pid=os.getpid()))
    raise RuntimeError("boom while loading weights")


def silent_child(endpoint: str, role: str, rank: int) -> None:
    with _handshake(endpoint) as ch:
        ch.send(Hello(version=PROTOCOL_VERSION, role=role, rank=rank, pid=os.getpid()))
    _block()


def old_version_child(endpoint: str, role: str, rank: int) -> None:
    with _handshake(endpoint) as ch:
        ch.send(Hello(version=PROTOCOL_VERSION + 1, role=role, rank=rank, pid=os.getpid()))
        ch.send(Ready(role=role, rank=rank))
    _block()


def wait_forever() -> None:
    _block()


def ignore_sigterm(started: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    started.set()
    _block()


def report_pid_and_wait(pids: Any) -> None:
    pids.put(os.getpid())
    _block()


def middle(pids: Any) -> None:
    """Spawn a grandchild, then wait to be SIGKILLed by the test."""
    spawn(report_pid_and_wait, "grandchild", "grandchild", 0, (pids,))
    _block()
