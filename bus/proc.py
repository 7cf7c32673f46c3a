"""Process lifecycle for the launcher: spawn, handshake, death monitor, shutdown.

Every child starts in `_child_main`, which, before running its target:
1. makes the kernel kill it when its parent dies (PR_SET_PDEATHSIG), with a thread watching the
   parent pid as a fallback, so no orphan keeps holding a GPU or a port;
2. sets its process title (`pagebus::worker-0`) and a log prefix with role and rank;
3. leaves the cores to the workers: one torch thread in the light roles, lower priority for the
   tokenizer pool;
4. logs any exception from the target and exits non-zero.

The child then sends `Hello` at once and `Ready` after heavy init (or `StartupFailed` with the
reason); `wait_ready` collects them while watching every child's sentinel, so a child that dies
during start-up fails fast.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.context import SpawnProcess
from typing import Any, Protocol

import msgspec
import zmq
from pagebus.bus.codec import Codec
from pagebus.bus.logs import LogFormat, configure_logging, current_format
from pagebus.bus.messages import PROTOCOL_VERSION, Handshake, Hello, Ready, StartupFailed

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


class StartupError(RuntimeError):
    """A child died, failed or stayed silent during start-up; the message names it, and `role` and
    `rank` say which process failed when one did."""

    def __init__(self, message: str, role: str | None = None, rank: int | None = None) -> None:
        super().__init__(message)
        self.role, self.rank = role, rank


class Stoppable(Protocol):
    """What `shutdown` needs of a child."""

    @property
    def name(self) -> str: ...
    @property
    def exitcode(self) -> int | None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class Child(Stoppable, Protocol):
    """A started child as the launcher and the scheduler watch it: a spawned process (BusProcess) or
    a Ray actor (bus/ray_executor.py). `sentinel` is a file descriptor that becomes readable once
    the child has exited."""

    role: str
    rank: int

    @property
    def pid(self) -> int | None: ...
    @property
    def sentinel(self) -> int: ...
    @property
    def tag(self) -> str: ...
    def describe_death(self) -> str: ...


class BusProcess(SpawnProcess):
    """A spawned child that knows its role and rank, for error messages and titles."""

    def __init__(self, *, role: str, rank: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.role, self.rank = role, rank

    @property
    def tag(self) -> str:
        return f"{self.role}-{self.rank}"

    def describe_death(self) -> str:
        return describe_death(self.role, self.rank, self.exitcode)


def spawn(
    target: Callable[..., object], name: str, role: str, rank: int, args: Sequence[Any] = ()
) -> BusProcess:
    """Start `target(*args)` in a fresh interpreter (spawn: no inherited locks, threads or CUDA state).

    `target` must be a module-level function and `args` picklable; pass configs msgspec-encoded and
    addresses as strings, never live objects. Spawn from a long-lived thread: PR_SET_PDEATHSIG fires
    when the *thread* that forked the child exits, not only the process.
    """
    level = logging.getLogger().getEffectiveLevel()
    p = BusProcess(
        role=role,
        rank=rank,
        name=name,
        target=_child_main,
        args=(target, role, rank, os.getpid(), level, current_format(), tuple(args)),
        daemon=False,  # daemonic processes may not have children; the scheduler spawns workers
    )
    p.start()
    return p


def _child_main(
    target: Callable[..., object],
    role: str,
    rank: int,
    parent_pid: int,
    level: int,
    log_format: LogFormat,
    args: tuple[Any, ...],
) -> None:
    tag = f"{role}-{rank}"
    install_parent_death_protection(parent_pid)
    # Ctrl+C in a terminal signals the whole process group; only the launcher may react, so
    # that it can drain in-flight work through Shutdown messages instead of losing it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(level, log_format, tag)
    _yield_cores_to_workers(role)
    with contextlib.suppress(ImportError):  # a missing title is cosmetic
        import setproctitle

        setproctitle.setproctitle(f"pagebus::{tag}")
    try:
        target(*args)
    except SystemExit as e:
        if e.code not in (None, 0):
            logger.error("%s exiting with status %s", tag, e.code)
        raise
    except BaseException:
        logger.exception("%s failed", tag)
        raise SystemExit(1) from None


# Roles that run on the cores the workers compute on, with nothing heavy to do: a small CPU
# engine's step is a barrier across all its threads, so a light process that preempts one of them
# stalls the whole step. They keep one torch thread, and the tokenizer pool also yields the CPU
# (it spawns nothing; the scheduler does not lower its priority, as its workers would inherit it).
_NICE = {"tokenizer": 5}


def _yield_cores_to_workers(role: str) -> None:
    if role == "worker":
        return
    if "torch" in sys.modules:  # imported by the target's module; the threads start on first use
        sys.modules["torch"].set_num_threads(1)
    if role in _NICE:
        with contextlib.suppress(OSError):
            os.nice(_NICE[role])


def freeze_heap() -> None:
    """A child process's last act of start-up: collect what start-up left, then move every live
    object out of the collector's reach. A worker holds ~200k objects once loaded (modules, the
    model's parameters and their wrappers), and a full collection walked them all: 76 ms, a
    pause of the step in flight whenever one came due. What is allocated afterwards is collected
    as before. Only for the engine's own processes: frozen cycles are never freed, so a caller's
    process (LLM in-process, the frontends) that builds and drops engines must not freeze."""
    gc.collect()
    gc.freeze()


def install_parent_death_protection(parent_pid: int) -> None:
    """Die with the parent: PR_SET_PDEATHSIG on Linux, else (and also) a thread watching the parent."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    try:  # Linux >= 5.3: block until the parent exits, no polling
        fd = os.pidfd_open(parent_pid)
        select.select([fd], [], [])
    except (AttributeError, OSError):
        while os.getppid() == parent_pid:
            time.sleep(1.0)
    logging.getLogger(__name__).error("parent %d died; exiting", parent_pid)
    os._exit(1)  # no cleanup can be trusted once the launcher is gone


# --------------------------------------------------------------------------- handshake
def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        hint = ", likely the OOM killer" if code == -signal.SIGKILL else ""
        return f"was killed by signal {-code} ({name}{hint}; exit code {code})"
    return f"exited with code {code}"


def describe_death(role: str, rank: int, code: int | None) -> str:
    """The one description of a process that died, for logs and for the clients' error messages."""
    return f"{role} {rank} {describe_exit(code)}"


def wait_ready(
    handshake_socket: zmq.Socket[Any],
    procs: Sequence[Child],
    expected: Iterable[tuple[str, int]],
    deadline_s: float,
) -> dict[tuple[str, int], Ready]:
    """Collect Hello then Ready from every expected (role, rank); return the Ready per (role, rank).

    One zmq.Poller watches the handshake socket and every child's sentinel, so a child that dies
    during start-up (import error, OOM kill during weight load) raises StartupError at once instead
    of after the deadline; a `StartupFailed` raises StartupError with its reason. The caller tears
    the rest down (`shutdown`).
    """
    codec = Codec()
    pending = set(expected)
    hello: dict[tuple[str, int], Hello] = {}
    ready: dict[tuple[str, int], Ready] = {}
    poller = zmq.Poller()
    poller.register(handshake_socket, zmq.POLLIN)
    for p in procs:
        poller.register(p.sentinel, zmq.POLLIN)
    deadline = time.monotonic() + deadline_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            who = ", ".join(f"{r}-{k}" for r, k in sorted(pending))
            role, rank = min(pending)
            raise StartupError(f"start-up timed out after {deadline_s:.0f}s waiting for {who}", role, rank)
        events = dict(poller.poll(max(1, int(min(left, 1.0) * 1000))))
        if handshake_socket in events:
            _drain_handshake(handshake_socket, codec, hello, ready, pending)
        dead = _first_dead(procs)  # even a child that is already Ready must not die before the others are
        if dead is not None:
            # A child that failed said why just before exiting; give its StartupFailed a moment to
            # arrive, so the error carries the reason rather than only the exit code.
            if handshake_socket.poll(500):
                _drain_handshake(handshake_socket, codec, hello, ready, pending)
            raise StartupError(
                f"{dead.tag} (pid {dead.pid}) {describe_exit(dead.exitcode)} during start-up; "
                "see the traceback above",
                dead.role,
                dead.rank,
            )
    return ready


def _drain_handshake(
    sock: zmq.Socket[Any],
    codec: Codec,
    hello: dict[tuple[str, int], Hello],
    ready: dict[tuple[str, int], Ready],
    pending: set[tuple[str, int]],
) -> None:
    while True:  # several children may have spoken
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        try:
            msg = codec.decode([f.buffer for f in frames], Handshake)
        except msgspec.DecodeError as e:  # e.g. a child from another pagebus version
            raise StartupError(f"malformed handshake message ({e}): mixed pagebus installs?") from None
        _on_handshake(msg, hello, ready, pending)


def _on_handshake(
    msg: Hello | Ready | StartupFailed,
    hello: dict[tuple[str, int], Hello],
    ready: dict[tuple[str, int], Ready],
    pending: set[tuple[str, int]],
) -> None:
    key = (msg.role, msg.rank)
    if isinstance(msg, StartupFailed):
        raise StartupError(msg.reason, msg.role, msg.rank)
    if isinstance(msg, Hello):
        if msg.version != PROTOCOL_VERSION:
            raise StartupError(
                f"{msg.role}-{msg.rank} (pid {msg.pid}) speaks bus protocol v{msg.version}, this launcher "
                f"v{PROTOCOL_VERSION}: mixed pagebus installs? Reinstall so both sides match.",
                msg.role,
                msg.rank,
            )
        hello[key] = msg
        logger.debug("hello from %s-%d pid %d", msg.role, msg.rank, msg.pid)
        return
    if key not in hello:
        raise StartupError(
            f"{msg.role}-{msg.rank} sent Ready before Hello (protocol error)", msg.role, msg.rank
        )
    if key not in pending:
        logger.warning("unexpected or repeated Ready from %s-%d ignored", msg.role, msg.rank)
        return
    pending.discard(key)
    ready[key] = msg
    logger.info("%s-%d ready %s", msg.role, msg.rank, msg.model or "")


def _first_dead(procs: Sequence[Child]) -> Child | None:
    for p in procs:
        if p.exitcode is None and multiprocessing.connection.wait([p.sentinel], 0):
            p.join(1.0)  # the sentinel closes a moment before the child can be reaped
        if p.exitcode is not None:
            return p
    return None


# ----------------------------------------------------------------------------- monitor
class ProcessMonitor:
    """A daemon thread that blocks on the children's sentinels and reports each death once.

    Catches deaths that send no message (SIGKILL, the OOM killer). `stop()` before a planned
    shutdown so that expected exits are not reported.
    """

    def __init__(self, procs: Sequence[BusProcess], on_death: Callable[[BusProcess], None]) -> None:
        self._procs = list(procs)
        self._on_death = on_death
        self._stop_r, self._stop_w = multiprocessing.Pipe(duplex=False)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="proc-monitor", daemon=True)

    def start(self) -> ProcessMonitor:
        self._thread.start()
        return self

    def _run(self) -> None:
        alive = {p.sentinel: p for p in self._procs}
        while alive:
            ready = multiprocessing.connection.wait([self._stop_r, *alive])
            if self._stop_r in ready or self._stopped:
                return
            for s in ready:
                p = alive.pop(s)  # type: ignore[arg-type]  # wait() typed wide; here only sentinels (ints)
                p.join(1.0)
                logger.error("%s (pid %s) %s", p.tag, p.pid, describe_exit(p.exitcode))
                try:
                    self._on_death(p)
                except Exception:
                    logger.exception("process monitor callback failed")

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._stop_w.send_bytes(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._stop_r.close()
        self._stop_w.close()


# ----------------------------------------------------------------------------- shutdown
def shutdown(
    procs: Sequence[Stoppable], timeout: float = 10.0, kill_grace_s: float = 2.0
) -> dict[str, int | None]:
    """Join every child within `timeout`, then terminate() stragglers, then kill(); exit codes by name.

    The caller sends Shutdown first; this only bounds how long a child may take to obey it.
    """
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for how in ("terminate", "kill"):  # SIGTERM lets a child flush; SIGKILL cannot be ignored
        late = [p for p in procs if p.exitcode is None]
        if not late:
            break
        logger.warning("%s %s: did not exit within %.1fs", how, [p.name for p in late], timeout)
        for p in late:
            getattr(p, how)()
        for p in late:
            p.join(kill_grace_s)
    return {p.name: p.exitcode for p in procs}
