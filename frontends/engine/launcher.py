"""Starts and stops one engine's processes: the tokenizer processes (`tokenizer_workers` of them)
and the scheduler (which spawns the workers it drives). Synchronous; `AsyncEngineClient` drives
it from the frontend's event loop.

Endpoints are ipc:// sockets in a per-engine runtime dir, so two engines never collide:

    frontend_in        frontend PULL    <- tokenizers PUSH (DeltaBatch, TokenizeResult, EngineDead)
    tok_in_<i>         tokenizer i PULL <- frontend PUSH (and the launcher's Shutdown)
    tok_step_<i>       tokenizer i PULL <- scheduler PUSH (StepOutput, EngineDead)
    scheduler_in       scheduler ROUTER <- tokenizers DEALER "tok-<i>", launcher DEALER "launcher"
    ring / worker_out / worker_handshake   scheduler <-> workers
    handshake          launcher PULL    <- Hello/Ready/StartupFailed of the tokenizers and the scheduler
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from pagebus.bus.codec import Codec
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import Ready, Shutdown
from pagebus.bus.proc import BusProcess, ProcessMonitor, describe_death, shutdown, spawn, wait_ready
from pagebus.bus.sockets import make_runtime_dir, make_socket

log = logging.getLogger(__name__)

CONTROL_LINGER_MS = 500
FRONTEND_HWM = 10_000  # messages per pool queued by the frontend before a send refuses (overload)


class Launcher:
    def __init__(self, cfg: EngineConfig, model_path: str, tokenizer_workers: int = 1) -> None:
        if tokenizer_workers < 1:
            raise ValueError(f"tokenizer_workers must be at least 1, got {tokenizer_workers}")
        self.cfg, self.model_path, self.n_pools = cfg, model_path, tokenizer_workers
        self.rd = make_runtime_dir()
        names = ["handshake", "scheduler_in", "worker_out", "worker_handshake", "ring", "frontend_in"]
        names += [f"tok_in_{i}" for i in range(tokenizer_workers)]
        names += [f"tok_step_{i}" for i in range(tokenizer_workers)]
        self.addrs = {n: self.rd.endpoint(n) for n in names}
        self.ctx: zmq.Context[Any] = zmq.Context()
        self._hs = make_socket(self.ctx, zmq.PULL, self.addrs["handshake"], bind=True, linger_ms=0)
        self._ctl = self.ctx.socket(zmq.DEALER)
        self._ctl.setsockopt(zmq.LINGER, CONTROL_LINGER_MS)
        self._ctl.setsockopt(zmq.ROUTING_ID, b"launcher")
        self._ctl.connect(self.addrs["scheduler_in"])
        self._pools = [
            make_socket(self.ctx, zmq.PUSH, self.addrs[f"tok_in_{i}"], bind=False, hwm=FRONTEND_HWM)
            for i in range(tokenizer_workers)
        ]
        self._codec = Codec()
        self._lock = threading.Lock()  # sockets are used from the loop thread and the teardown thread
        self.procs: list[BusProcess] = []
        self.ready: dict[tuple[str, int], Ready] = {}
        self._monitor: ProcessMonitor | None = None
        self.stopping = False  # planned exits (exit code 0) are not deaths from here on
        self.closed = False
        self.exit_codes: dict[str, int | None] = {}

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        """Spawn every process. Call from a long-lived thread: PR_SET_PDEATHSIG follows the thread."""
        from pagebus.frontends.engine.tokenizer_process import tokenizer_main
        from pagebus.scheduler.main import scheduler_main
        from pagebus.workers.main import worker_main  # imports torch only inside the worker process

        cfg_bytes = msgspec.msgpack.encode(self.cfg)
        for i in range(self.n_pools):
            args = (cfg_bytes, self.model_path, i, self.addrs)
            self.procs.append(spawn(tokenizer_main, f"tokenizer-{i}", "tokenizer", i, args))
        args2 = (cfg_bytes, self.model_path, self.addrs, self.n_pools, worker_main)
        self.procs.append(spawn(scheduler_main, "scheduler-0", "scheduler", 0, args2))

    def wait_ready(self, timeout: float) -> Ready:
        """Block until every process is Ready; return the scheduler's (the model's facts and the
        worker pids). StartupError names the process that failed, workers included."""
        expected = {("tokenizer", i) for i in range(self.n_pools)} | {("scheduler", 0)}
        t0 = time.monotonic()
        self.ready = wait_ready(self._hs, self.procs, expected, timeout)
        log.info("engine processes ready in %.1fs", time.monotonic() - t0)
        return self.ready[("scheduler", 0)]

    def monitor(self, on_death: Callable[[str], object]) -> None:
        """Call `on_death(reason)` (from a monitor thread) when any child dies unexpectedly."""

        def cb(p: BusProcess) -> None:
            if self.stopping and p.exitcode == 0:
                return
            on_death(describe_death(p.role, p.rank, p.exitcode))

        self._monitor = ProcessMonitor(self.procs, cb).start()

    # ------------------------------------------------------------------ messages
    def send_pool(self, index: int, msg: Any) -> None:
        """Queue one message for pool `index` without blocking the event loop."""
        frames = self._codec.encode(msg)
        with self._lock:
            if self.closed:
                raise RuntimeError("the engine is closed")
            try:
                self._pools[index].send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                raise RuntimeError(f"tokenizer {index} is not keeping up (queue full); retry later") from None

    # ------------------------------------------------------------------ teardown
    def close(self, timeout: float = 10.0) -> dict[str, int | None]:
        """Stop every process (Shutdown, then terminate, then kill) and remove the runtime dir.

        Idempotent; safe from any thread. Returns exit codes by process name.
        """
        with self._lock:
            if self.closed:
                return self.exit_codes
            self.closed = self.stopping = True
            for sock in (self._ctl, *self._pools):
                with contextlib.suppress(zmq.ZMQError):
                    sock.send_multipart(self._codec.encode(Shutdown(drain=False)), zmq.NOBLOCK)
        if self._monitor is not None:
            self._monitor.stop()
        self.exit_codes = shutdown(self.procs, timeout=timeout, kill_grace_s=2.0)
        for sock in (self._hs, self._ctl, *self._pools):
            sock.close(linger=0)
        self.ctx.term()
        self.rd.close()
        log.info("engine processes stopped: %s", self.exit_codes)
        return self.exit_codes
