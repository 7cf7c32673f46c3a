"""Start a real `pagebus serve` subprocess on a free port and wait for /health, with a deadline."""

from __future__ import annotations

import contextlib
import http.client
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import psutil

from bench.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STARTUP_DEADLINE = 180.0


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: str
    api_key: str | None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def request(
        self,
        method: str,
        path: str,
        body: bytes | Any = None,
        headers: dict[str, str] | None = None,
        auth: bool = True,
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        hdrs = dict(headers or {})
        if auth and self.api_key:
            hdrs.setdefault("Authorization", f"Bearer {self.api_key}")
        raw = body if body is None or isinstance(body, bytes) else msgspec.json.encode(body)
        try:
            conn.request(method, path, body=raw, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """Every sample as name{labels} -> value, parsed by prometheus_client."""
        from prometheus_client.parser import text_string_to_metric_families

        status, _, body = self.request("GET", "/metrics")
        assert status == 200, body
        out = {}
        for fam in text_string_to_metric_families(body.decode()):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
        return out


@contextlib.contextmanager
def run_server(*extra: str, api_key: str | None = None) -> Iterator[Server]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="pagebus-serve-", suffix=".log", delete=False)  # noqa: SIM115
    cmd = [sys.executable, "-m", "pagebus.frontends.cli", "serve", "--dtype", "float32", "--port", str(port)]
    cmd += [*extra, *(["--api-key", api_key] if api_key else [])]
    # A new session: signals meant for pytest's process group never reach the server (and the
    # drain test signals only the server, as an orchestrator would).
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, port, log.name, api_key)
    try:
        _wait_healthy(server)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_DEADLINE
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"pagebus serve exited with {server.proc.returncode}:\n{server.log()}")
        with contextlib.suppress(OSError):
            if server.request("GET", "/health", auth=False)[0] == 200:
                return
        time.sleep(0.2)  # polling interval, not a synchronisation sleep
    raise TimeoutError(f"pagebus serve not healthy after {STARTUP_DEADLINE}s:\n{server.log()}")


def wait_until(cond: Any, deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(0.05)


def living(pids: Iterable[int]) -> list[int]:
    """The pids whose process still runs (a zombie has exited; only its parent has not reaped it)."""
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


def wait_all_exited(pids: list[int], deadline_s: float, what: str) -> None:
    """No orphans: engine processes die of PR_SET_PDEATHSIG, and multiprocessing's resource
    tracker when its pipe from the server closes, both a moment after the server exits."""
    wait_until(lambda: not living(pids), deadline_s, what)


def engine_pid(server: Server, role: str, rank: int = 0) -> int:
    """The pid of the server's `pagebus::<role>-<rank>` process."""
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if f"pagebus::{role}-{rank}" in " ".join(p.cmdline()):
                return p.pid
    raise AssertionError(f"no {role}-{rank} process under the server")
