"""bus.shm: the broadcast ring across real processes: order, overflow, dead readers, idle CPU."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator

import msgspec
import psutil
import pytest
from pagebus.bus.proc import shutdown, spawn
from pagebus.bus.shm import PeerDied, ShmRingReader, ShmRingWriter
from pagebus.bus.sockets import RuntimeDir, make_runtime_dir

from tests.bus import _children as kids

CTX = multiprocessing.get_context("spawn")


@pytest.fixture
def rd() -> Iterator[RuntimeDir]:
    with make_runtime_dir() as d:
        yield d


def _shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_two_reader_processes_get_every_payload_in_order(rd: RuntimeDir) -> None:
    max_chunk, seed = 4096, 1234
    sizes = kids.payload_sizes(seed, 400, max_chunk)
    assert sum(s > max_chunk for s in sizes) > 20
    ring = ShmRingWriter(2, rd.endpoint("ring"), n_chunks=4, max_chunk_bytes=max_chunk)
    handle = msgspec.msgpack.encode(ring.handle)
    results = CTX.Queue()
    procs = [
        spawn(kids.ring_reader, f"reader-{r}", "reader", r, (handle, r, seed, sizes, results))
        for r in range(2)
    ]
    try:
        ring.wait_for_readers(timeout_s=30.0)
        for i, size in enumerate(sizes):
            ring.write(kids.payload(seed, i, size), timeout_s=30.0)
        got = sorted(results.get(timeout=30.0) for _ in procs)
        assert got == [(0, len(sizes), -1), (1, len(sizes), -1)]  # -1: no payload differed
    finally:
        shutdown(procs, timeout=10.0)
        name = ring.handle.name
        ring.close()
    assert not _shm_exists(name)  # the creator unlinked it; readers exiting did not


def test_writer_fails_fast_when_a_reader_dies_and_times_out_when_one_stalls(rd: RuntimeDir) -> None:
    ring = ShmRingWriter(2, rd.endpoint("ring"), n_chunks=4, max_chunk_bytes=256)
    handle = msgspec.msgpack.encode(ring.handle)
    procs = [spawn(kids.stuck_reader, f"stuck-{r}", "reader", r, (handle, r)) for r in range(2)]
    try:
        ring.wait_for_readers(timeout_s=30.0)
        for i in range(4):  # fills the ring: nobody reads
            ring.write(b"x%d" % i, timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="did not consume") as err:
            ring.write(b"late", timeout_s=0.5)  # alive but stuck: the deadline fires
        assert not isinstance(err.value, PeerDied) and 0.5 <= time.monotonic() - t0 < 2.0
        assert ring.lagging_readers() == [0, 1] and ring.dead_readers() == []

        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(10.0)
        assert ring.dead_readers() == [1]
        t0 = time.monotonic()
        with pytest.raises(PeerDied, match=r"\[1\]"):
            ring.write(b"late", timeout_s=20.0)  # dead reader: fails long before the deadline
        assert time.monotonic() - t0 < 2.0
    finally:
        shutdown(procs, timeout=0.0)
        ring.close()


def test_idle_reader_blocks_and_wakes(rd: RuntimeDir) -> None:
    ring = ShmRingWriter(1, rd.endpoint("ring"), n_chunks=4, max_chunk_bytes=256)
    attached, results = CTX.Event(), CTX.Queue()
    proc = spawn(
        kids.idle_reader, "idle", "reader", 0, (msgspec.msgpack.encode(ring.handle), 0, attached, results)
    )
    try:
        assert attached.wait(30.0)
        ring.wait_for_readers(timeout_s=30.0)
        reader = psutil.Process(proc.pid)
        reader.cpu_percent()  # let it settle into its blocking read
        cpu0, t0 = sum(reader.cpu_times()[:2]), time.monotonic()
        threading.Event().wait(1.5)  # the idle window being measured, not a synchronisation
        cpu = sum(reader.cpu_times()[:2]) - cpu0
        assert cpu < 0.1 * (time.monotonic() - t0), f"idle reader used {cpu:.3f}s CPU"
        ring.write(b"wake up", timeout_s=5.0)
        assert results.get(timeout=10.0) == b"wake up"
    finally:
        shutdown([proc], timeout=10.0)
        ring.close()


def test_reader_sees_writer_death_and_handle_mismatch(rd: RuntimeDir) -> None:
    ring = ShmRingWriter(1, rd.endpoint("ring"), n_chunks=2, max_chunk_bytes=64)
    reader = ShmRingReader(ring.handle, 0)
    with pytest.raises(TimeoutError):
        reader.read(timeout_s=0.05)
    reader._writer_pid = 2**22 + 12345  # a pid that does not exist stands in for a dead writer
    with pytest.raises(PeerDied, match="writer"):
        reader.read(timeout_s=5.0)
    bad = msgspec.structs.replace(ring.handle, n_chunks=3)
    with pytest.raises(ValueError, match="does not match"):
        ShmRingReader(bad, 0)
    reader.close()
    ring.close()


def test_in_process_round_trip_with_overflow(rd: RuntimeDir) -> None:
    ring = ShmRingWriter(1, rd.endpoint("ring"), n_chunks=2, max_chunk_bytes=8)
    reader = ShmRingReader(ring.handle, 0)
    ring.wait_for_readers(timeout_s=5.0)
    for payload in [b"", b"12345678", b"123456789", bytearray(b"big" * 10), b"z"]:
        ring.write(payload, timeout_s=1.0)
        assert bytes(reader.read(timeout_s=1.0)) == bytes(payload)
    reader.close()
    ring.close()
