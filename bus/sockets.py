"""ZeroMQ helpers: sockets with deliberate limits, per-engine endpoints, and a typed `Channel`.

Named `sockets.py`, not `zmq.py`, so it never shadows pyzmq.

Why the explicit options:
- `linger`: libzmq's default can keep a process alive forever on exit with unsent messages; a
  process's last message (EngineDead, WorkerFailed) needs a bounded linger to actually leave.
- `SNDHWM`/`RCVHWM`: at the high-water mark PUSH/DEALER block but ROUTER and PUB *drop silently*
  (measured: of 50,000 sent past the mark, about 4,000 arrived). Callers bound the messages in flight; the default
  here is large enough for one message per engine step with a deep backlog.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import weakref
from typing import Any

import zmq
from pagebus.bus.codec import Codec

logger = logging.getLogger(__name__)

DEFAULT_HWM = 10_000  # messages per peer
DEFAULT_LINGER_MS = 1_000
_MAX_IPC_PATH = 107  # sun_path is 108 bytes on Linux, including the NUL


class RuntimeDir:
    """A private directory for one engine's ipc:// sockets, removed on `close()` or collection.

    Two engines on one host never collide, unlike a fixed path or port.
    """

    def __init__(self, base: str | None = None, prefix: str = "pagebus-") -> None:
        self.path = tempfile.mkdtemp(prefix=prefix, dir=_pick_base(base))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, True)

    def endpoint(self, name: str) -> str:
        """`ipc://<dir>/<name>.sock`, checked against the unix socket path limit."""
        path = os.path.join(self.path, f"{name}.sock")
        if len(path.encode()) > _MAX_IPC_PATH:
            raise ValueError(f"ipc path {path!r} exceeds {_MAX_IPC_PATH} bytes; use a shorter base dir")
        return f"ipc://{path}"

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> RuntimeDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pick_base(base: str | None) -> str | None:
    # XDG_RUNTIME_DIR is the platform's place for sockets (tmpfs, per user); it is a location
    # convention, not a pagebus setting, hence read here rather than in bus/config.py.
    for cand in (base, os.environ.get("XDG_RUNTIME_DIR")):
        if cand and os.path.isdir(cand) and os.access(cand, os.W_OK | os.X_OK):
            return cand
    return None  # tempfile's default (TMPDIR or /tmp)


def make_runtime_dir(base: str | None = None) -> RuntimeDir:
    """A unique per-engine directory under `base`, $XDG_RUNTIME_DIR or /tmp."""
    return RuntimeDir(base)


def make_endpoint(name: str, runtime_dir: RuntimeDir | None, address: str | None = None) -> str:
    """`tcp://<address>` when an address ("host:port") is configured, else an ipc path in runtime_dir."""
    if address:
        return address if "://" in address else f"tcp://{address}"
    if runtime_dir is None:
        raise ValueError(f"endpoint {name!r} needs a runtime dir or a tcp address")
    return runtime_dir.endpoint(name)


def make_socket(
    ctx: zmq.Context[Any],
    kind: int,
    endpoint: str,
    *,
    bind: bool,
    hwm: int = DEFAULT_HWM,
    linger_ms: int = DEFAULT_LINGER_MS,
) -> zmq.Socket[Any]:
    """A socket of `kind` (zmq.PUSH, ...) bound or connected to `endpoint`, options set first."""
    sock: zmq.Socket[Any] = ctx.socket(kind)  # Context[Any] makes socket() return Any
    try:
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


class Channel:
    """One socket, one codec, one receive type: `send(msg)` and `recv(timeout_s)`.

    Waits block in zmq.Poller (no busy polling). Not thread-safe, like the zmq socket it wraps.
    """

    def __init__(self, sock: zmq.Socket[Any], recv_type: Any = None, codec: Codec | None = None) -> None:
        self.sock = sock
        self.recv_type = recv_type
        self.codec = codec or Codec()
        self._pollin = zmq.Poller()
        self._pollin.register(sock, zmq.POLLIN)
        self._pollout = zmq.Poller()
        self._pollout.register(sock, zmq.POLLOUT)

    @classmethod
    def open(
        cls,
        ctx: zmq.Context[Any],
        kind: int,
        endpoint: str,
        *,
        bind: bool,
        recv_type: Any = None,
        hwm: int = DEFAULT_HWM,
        linger_ms: int = DEFAULT_LINGER_MS,
    ) -> Channel:
        return cls(make_socket(ctx, kind, endpoint, bind=bind, hwm=hwm, linger_ms=linger_ms), recv_type)

    def send(self, msg: Any, timeout_s: float | None = None) -> None:
        """Send one message; with a timeout, raise TimeoutError if the peer queue stays full."""
        frames = self.codec.encode(msg)
        if timeout_s is not None and not self._pollout.poll(_ms(timeout_s)):
            raise TimeoutError(
                f"send of {type(msg).__name__} blocked for {timeout_s:.3g}s (peer gone or full)"
            )
        # copy=False: large array frames go out without a copy; pyzmq still copies small frames.
        self.sock.send_multipart(frames, copy=False)

    def recv(self, timeout_s: float | None = None) -> Any:
        """The next message decoded as `recv_type`; TimeoutError if none arrives in time."""
        if not self._pollin.poll(None if timeout_s is None else _ms(timeout_s)):
            raise TimeoutError(f"no message within {timeout_s:.3g}s")
        return self.recv_now()

    def recv_now(self) -> Any:
        """Receive a message known to be ready (after an outside poll) without blocking."""
        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        if self.recv_type is None:
            raise TypeError("this Channel has no recv_type; pass the channel union it receives")
        return self.codec.decode([f.buffer for f in frames], self.recv_type)

    def close(self, linger_ms: int | None = None) -> None:
        self.sock.close(linger=linger_ms)


def _ms(timeout_s: float) -> int:
    return max(0, math.ceil(timeout_s * 1000))  # ceil: a tiny positive timeout still waits
