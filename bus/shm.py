"""A shared-memory broadcast ring: one writer, N readers, each reader sees every payload in order.

The idea follows vLLM's `ShmRingBuffer` (shm_broadcast.py); the code is ours. The segment is
created by the writer with a unique per-engine name and unlinked by it (weakref.finalize).

Memory layout (one `multiprocessing.shared_memory` segment; N readers, C chunks, M max bytes)::

    0                64             64+16N           64+16N+C(1+N)  (aligned to 64)
    +----------------+--------------+-----------------+------+------------------+-----+
    | header         | reader table | chunk flags     | pad  | chunk 0          | ... chunk C-1
    | magic, N, C, M | pid(8) sleep | w r0 r1 .. rN-1 |      | len(8) payload(M)|
    | writer pid     | (1) pad(7)   | one row/chunk   |      |                  |
    +----------------+--------------+-----------------+------+------------------+-----+

Per-chunk flag states (w = written flag, r_i = reader i has read it)::

    w  r_0 .. r_N-1   meaning                                     who may act
    0  0   ..  0      never written (initial)                    writer writes
    1  some 0         written; readers with r_i = 0 still owe it  reader i (r_i = 0) reads
    1  all 1          every reader has read it                   writer overwrites

Ordering. The writer copies `len` and the payload, fences, clears every r_i and then sets w;
a reader checks w and r_i, fences, copies the payload out, fences and only then sets r_i. Only
byte-sized stores are used, so no flag is ever torn. We rely on program order plus explicit fences
(a lock acquire/release: a locked instruction, i.e. a full barrier, in CPython's pthread/semaphore
lock). On x86-64 (TSO) stores are not reordered with stores nor loads with loads, so the fences are
only strictly needed for the sleep/wake handshake below (a store then a load of another location,
which TSO may reorder); they keep weakly ordered CPUs (arm64) correct too.

Overflow. A payload over M bytes stores `len = OVERFLOW` in its chunk and travels on the ring's
ZMQ XPUB socket (topic b"o") instead; the chunk still orders it. Each reader's SUB queue holds at
most C overflow payloads and C wake-ups, because the writer cannot run more than C chunks ahead.

Idle readers block. A reader spins for at most `spin_s` (tens of microseconds), then sets its
`sleep` byte, fences, re-checks the chunk and blocks in zmq.Poller on its SUB socket. After each
write the writer fences and sends topic b"w<rank>" to every reader whose `sleep` byte is set. A
spinning reader would steal a core from the worker on a 2-core box.

Failure. The writer waits for a free chunk with sleeps that back off to 1 ms, warns every
`log_every_s`, raises `PeerDied` (a TimeoutError) as soon as a lagging reader's pid is gone, and
TimeoutError at its deadline. `dead_readers()` lets the owner check at any time. A blocked reader
likewise raises `PeerDied` when the writer's pid is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import struct
import sys
import threading
import time
import weakref
from collections import deque
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import msgspec
import psutil
import zmq

logger = logging.getLogger(__name__)

MAGIC = 0x50424752  # "PBGR"
OVERFLOW = 2**64 - 1
_HEADER = struct.Struct("<IIIIQQ")  # magic, n_readers, n_chunks, pad, max_chunk_bytes, writer pid
_READER_ROW = 16  # pid (8), sleep (1), pad (7)
_LEN = struct.Struct("<Q")
_SAFETY_POLL_S = 0.1  # a blocked reader re-checks this often: bounds any missed wake-up, costs ~0 CPU


class PeerDied(TimeoutError):
    """The process on the other side of the ring is gone; waiting longer cannot help."""


class RingHandle(msgspec.Struct, frozen=True):
    """What a reader process needs to attach: send it to the child (it is msgspec-encodable)."""

    name: str
    endpoint: str
    n_readers: int
    n_chunks: int
    max_chunk_bytes: int


class _Layout:
    def __init__(self, n_readers: int, n_chunks: int, max_chunk_bytes: int) -> None:
        self.n, self.c, self.m = n_readers, n_chunks, max_chunk_bytes
        self.readers = 64
        self.flags = self.readers + _READER_ROW * n_readers
        self.row = 1 + n_readers
        self.data = _align(self.flags + n_chunks * self.row)
        self.stride = _align(_LEN.size + max_chunk_bytes)
        self.size = self.data + n_chunks * self.stride

    def written(self, chunk: int) -> int:
        return self.flags + chunk * self.row

    def read_flag(self, chunk: int, rank: int) -> int:
        return self.flags + chunk * self.row + 1 + rank

    def pid(self, rank: int) -> int:
        return self.readers + _READER_ROW * rank

    def sleep(self, rank: int) -> int:
        return self.readers + _READER_ROW * rank + 8

    def chunk(self, chunk: int) -> int:
        return self.data + chunk * self.stride


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def _mapped(shm: SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:  # typed Optional: None only after close(), never for a segment just opened
        raise ValueError(f"shm segment {shm.name} is closed")
    return buf


def _pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wake_topic(rank: int) -> bytes:
    return b"w%04d" % rank  # fixed width: "w1" must not prefix-match "w10"


class _Fence:
    """A full memory barrier: acquiring and releasing a lock executes locked (atomic) instructions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self) -> None:
        self._lock.acquire()
        self._lock.release()


class ShmRingWriter:
    """The single writer. Create it in the process that owns the segment; pass `handle` to readers."""

    def __init__(
        self,
        n_readers: int,
        endpoint: str,
        *,
        n_chunks: int = 8,
        max_chunk_bytes: int = 1 << 20,
        ctx: zmq.Context[Any] | None = None,
        log_every_s: float = 10.0,
    ) -> None:
        if n_readers < 1 or n_chunks < 2 or max_chunk_bytes < 1:
            raise ValueError(
                f"need n_readers>=1, n_chunks>=2, max_chunk_bytes>=1: {n_readers, n_chunks, max_chunk_bytes}"
            )
        self._lay = lay = _Layout(n_readers, n_chunks, max_chunk_bytes)
        name = f"pagebus_{os.getpid()}_{secrets.token_hex(4)}"  # unique per engine, never fixed
        self._shm = SharedMemory(name=name, create=True, size=lay.size)
        self._buf = _mapped(self._shm)
        self._buf[: lay.data] = bytes(lay.data)
        _HEADER.pack_into(self._buf, 0, MAGIC, n_readers, n_chunks, 0, max_chunk_bytes, os.getpid())
        # Queue bound: per reader at most n_chunks overflow payloads plus n_chunks wake-ups (see top).
        self._pub = (ctx or zmq.Context.instance()).socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 4 * n_chunks + 64)
        self._pub.bind(endpoint)
        self.handle = RingHandle(self._shm.name, endpoint, n_readers, n_chunks, max_chunk_bytes)
        self._fence = _Fence()
        self._idx = 0
        self._subscribed: set[int] = set()
        self.log_every_s = log_every_s
        self._finalizer = weakref.finalize(self, _close_writer, self._shm, self._pub)

    def wait_for_readers(self, timeout_s: float) -> None:
        """Block until every reader has attached and subscribed (else overflow payloads would be lost)."""
        deadline = time.monotonic() + timeout_s
        want = {_wake_topic(r): r for r in range(self._lay.n)}
        while len(self._subscribed) < self._lay.n:
            left = deadline - time.monotonic()
            if left <= 0 or not self._pub.poll(max(1, int(left * 1000)), zmq.POLLIN):
                missing = sorted(set(range(self._lay.n)) - self._subscribed)
                raise TimeoutError(
                    f"shm ring {self.handle.name}: readers {missing} did not attach in {timeout_s}s"
                )
            ev = self._pub.recv()
            if ev[:1] == b"\x01" and ev[1:] in want:
                self._subscribed.add(want[ev[1:]])

    def write(self, payload: bytes | bytearray | memoryview, timeout_s: float = 60.0) -> None:
        """Publish one payload to every reader; TimeoutError if a chunk does not free up in time."""
        lay, buf = self._lay, self._buf
        if len(self._subscribed) < lay.n:
            self.wait_for_readers(timeout_s)
        idx = self._idx
        self._wait_free(idx, timeout_s)
        mv = memoryview(payload).cast("B")  # slice assignment needs a flat byte view
        n = mv.nbytes
        base = lay.chunk(idx)
        if n <= lay.m:
            buf[base + _LEN.size : base + _LEN.size + n] = mv
            _LEN.pack_into(buf, base, n)
        else:  # queue the payload first, so a reader that sees the marker finds it waiting
            _LEN.pack_into(buf, base, OVERFLOW)
            self._pub.send_multipart([b"o", payload], copy=not isinstance(payload, bytes))
        self._fence()  # payload before flags
        w = lay.written(idx)
        buf[w + 1 : w + 1 + lay.n] = bytes(lay.n)
        buf[w] = 1
        self._fence()  # flags before reading the sleep bytes (store then load: needs a real fence)
        for r in range(lay.n):
            if buf[lay.sleep(r)]:
                self._pub.send(_wake_topic(r))
        self._idx = (idx + 1) % lay.c

    def _free(self, idx: int) -> bool:
        w = self._lay.written(idx)
        return self._buf[w] == 0 or self._buf[w + 1 : w + 1 + self._lay.n].tobytes().count(0) == 0

    def _wait_free(self, idx: int, timeout_s: float) -> None:
        if self._free(idx):
            return
        start = time.monotonic()
        deadline, next_log, next_check, delay = start + timeout_s, start + self.log_every_s, start, 1e-5
        while not self._free(idx):
            now = time.monotonic()
            if now >= next_check:  # a dead reader will never free the chunk: fail now, not at deadline
                dead = [r for r in self.lagging_readers() if r in self.dead_readers()]
                if dead:
                    raise PeerDied(
                        f"shm ring {self.handle.name}: reader(s) {dead} died; chunk {idx} never frees"
                    )
                next_check = now + 0.1
            if now >= deadline:
                raise TimeoutError(
                    f"shm ring {self.handle.name}: readers {self.lagging_readers()} did not consume "
                    f"chunk {idx} within {timeout_s}s"
                )
            if now >= next_log:
                logger.warning("shm ring: waited %.0fs for readers %s", now - start, self.lagging_readers())
                next_log = now + self.log_every_s
            time.sleep(delay)  # a full ring is rare and means readers are busy: no need to spin
            delay = min(delay * 2, 1e-3)

    def lagging_readers(self) -> list[int]:
        """Readers that still owe the chunk the writer will overwrite next."""
        w = self._lay.written(self._idx)
        if self._buf[w] == 0:
            return []
        return [r for r in range(self._lay.n) if self._buf[w + 1 + r] == 0]

    def dead_readers(self) -> list[int]:
        """Readers that attached and whose process is gone (SIGKILL, OOM kill, crash)."""
        pids = [struct.unpack_from("<q", self._buf, self._lay.pid(r))[0] for r in range(self._lay.n)]
        return [r for r, pid in enumerate(pids) if pid > 0 and not _pid_alive(pid)]

    def close(self) -> None:
        """Close the socket and unlink the segment (also runs when the writer is collected)."""
        self._buf = None  # type: ignore[assignment]  # drop our export so the mmap can close
        self._finalizer()


def _close_writer(shm: SharedMemory, sock: zmq.Socket[Any]) -> None:
    sock.close(linger=0)
    with contextlib.suppress(BufferError):  # a view is still alive somewhere; unlinking is what matters
        shm.close()
    shm.unlink()


def _attach(name: str) -> SharedMemory:
    """Attach without registering with the resource tracker (which would unlink at our exit)."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg,unused-ignore]
    # Before 3.13 every attach registers the segment, so a reader's exit unlinks the writer's
    # segment (cpython gh-82300). Skip registration for this call only.
    register = resource_tracker.register
    resource_tracker.register = lambda *a, **k: None
    try:
        return SharedMemory(name=name)
    finally:
        resource_tracker.register = register


class ShmRingReader:
    """Reader `rank` of a ring; `read()` returns the next payload, blocking when idle."""

    def __init__(
        self, handle: RingHandle, rank: int, *, spin_s: float = 50e-6, ctx: zmq.Context[Any] | None = None
    ) -> None:
        if not 0 <= rank < handle.n_readers:
            raise ValueError(f"reader rank {rank} out of range for {handle.n_readers} readers")
        self.rank, self.spin_s = rank, spin_s
        self._lay = lay = _Layout(handle.n_readers, handle.n_chunks, handle.max_chunk_bytes)
        self._shm = _attach(handle.name)
        self._buf = _mapped(self._shm)
        magic, n, c, _, m, self._writer_pid = _HEADER.unpack_from(self._buf, 0)
        if (magic, n, c, m) != (MAGIC, lay.n, lay.c, lay.m):
            self._shm.close()
            raise ValueError(f"shm segment {handle.name} does not match its handle {handle}")
        struct.pack_into("<q", self._buf, lay.pid(rank), os.getpid())
        self._sub = (ctx or zmq.Context.instance()).socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 4 * lay.c + 64)
        self._sub.connect(handle.endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"o")  # first: the writer waits for the wake topic, after it
        self._sub.setsockopt(zmq.SUBSCRIBE, _wake_topic(rank))
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._overflow: deque[zmq.Frame] = deque()  # payloads drained while looking for wake-ups
        self._fence = _Fence()
        self._idx = 0
        self._finalizer = weakref.finalize(self, _close_reader, self._shm, self._sub)

    def _ready(self) -> bool:
        lay, buf, idx = self._lay, self._buf, self._idx
        return buf[lay.written(idx)] == 1 and buf[lay.read_flag(idx, self.rank)] == 0

    def read(self, timeout_s: float | None = None) -> bytes | memoryview:
        """The next payload (bytes copied out of the chunk, or a view on the overflow frame)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._ready():
            self._wait(deadline)
        self._fence()  # flags before payload
        lay, buf, idx = self._lay, self._buf, self._idx
        base = lay.chunk(idx)
        (n,) = _LEN.unpack_from(buf, base)
        if n == OVERFLOW:
            payload: bytes | memoryview = self._next_overflow(deadline)
        else:
            payload = buf[base + _LEN.size : base + _LEN.size + n].tobytes()
        self._fence()  # payload copied out before the writer may reuse the chunk
        buf[lay.read_flag(idx, self.rank)] = 1
        self._idx = (idx + 1) % lay.c
        return payload

    def _wait(self, deadline: float | None) -> None:
        spin_end = time.perf_counter() + self.spin_s
        while time.perf_counter() < spin_end:
            if self._ready():
                return
        sleep_at = self._lay.sleep(self.rank)
        while True:
            self._buf[sleep_at] = 1
            self._fence()  # publish "sleeping" before re-checking: pairs with the writer's fence
            if self._ready():
                self._buf[sleep_at] = 0
                return
            wait = _SAFETY_POLL_S if deadline is None else min(_SAFETY_POLL_S, deadline - time.monotonic())
            if wait <= 0:
                self._buf[sleep_at] = 0
                raise TimeoutError(f"shm ring reader {self.rank}: no payload in time")
            events = self._poller.poll(max(1, int(wait * 1000)))
            self._buf[sleep_at] = 0
            if events:
                self._drain()
            elif not _pid_alive(self._writer_pid):
                raise PeerDied(f"shm ring reader {self.rank}: the writer (pid {self._writer_pid}) is gone")
            if self._ready():
                return

    def _drain(self) -> None:
        while True:
            try:
                topic, *rest = self._sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if topic.bytes == b"o":
                self._overflow.append(rest[0])

    def _next_overflow(self, deadline: float | None) -> memoryview:
        while not self._overflow:
            left = None if deadline is None else max(1, int((deadline - time.monotonic()) * 1000))
            if not self._poller.poll(left):
                raise TimeoutError(f"shm ring reader {self.rank}: overflow payload did not arrive")
            self._drain()
        return self._overflow.popleft().buffer

    def close(self) -> None:
        self._buf = None  # type: ignore[assignment]  # drop our export so the mmap can close
        self._finalizer()


def _close_reader(shm: SharedMemory, sock: zmq.Socket[Any]) -> None:
    sock.close(linger=0)
    with contextlib.suppress(BufferError):
        shm.close()
