"""`pagebus serve` as a systemd service would run it, on one served engine (a tiny random-weight
Llama with the default tokenizer, so start-up is quick), with a test-owned NOTIFY_SOCKET:

READY=1 only once the port answers, WATCHDOG=1 at half of WATCHDOG_USEC, stall detection on a
SIGSTOPped worker (and none on a slow but moving one), SIGHUP key rotation, JSON logs, and
STOPPING=1 at SIGTERM (last: it stops the server). The tests run in file order.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from pagebus.frontends.model_files import default_model_path

from bench.gpu_e2e import TINY, write_llama_config
from tests.frontends.http.server_proc import ROOT, STARTUP_DEADLINE, Server, free_port, wait_until
from tests.frontends.service.notify_listener import NotifyListener

pytestmark = pytest.mark.slow
STALL_TIMEOUT = 4.0
WATCHDOG_USEC = 1_000_000  # pings every 0.5 s
OLD_KEY, NEW_KEY = "sk-old-key-1234", "sk-new-key-5678"
CANARY = "zebra canary prompt"  # must never appear in the log (no --log-requests)


@dataclass
class Served:
    server: Server
    notify: NotifyListener
    key_file: Path
    port_open_before_ready: list[bool] = field(default_factory=list)
    health_at_ready: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def worker(self) -> psutil.Process:
        procs = psutil.Process(self.server.proc.pid).children(recursive=True)
        (w,) = [p for p in procs if "pagebus::worker-0" in " ".join(p.cmdline())]
        return w

    def health(self) -> tuple[int, bytes]:
        status, _, body = self.server.request("GET", "/health", auth=False)
        return status, body

    def stalls(self) -> float:
        return self.server.metrics()["pagebus:engine_stalls_total{}"]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _health_status(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    tmp = Path(tempfile.mkdtemp(prefix="pagebus-service-"))
    model = tmp / "model"
    model.mkdir()
    write_llama_config(str(model), dict(TINY, vocab_size=49152, max_position_embeddings=4096))
    key_file = tmp / "api-key"
    key_file.write_text(OLD_KEY + "\n")
    config = tmp / "pagebus.toml"
    config.write_text(
        f'model = "{model}"\nload_format = "dummy"\ntokenizer = "{default_model_path()}"\n'
        f"stall_timeout = {STALL_TIMEOUT}\nstats_interval = 1.0\n"
    )
    port = free_port()
    state: dict[str, Served] = {}

    def on_message(msg: str) -> None:
        s = state.get("s")
        if s is None:
            return
        if "READY=1" in msg.split("\n") and not s.health_at_ready:
            s.health_at_ready.append(_health_status(port))
        elif not s.health_at_ready:
            s.port_open_before_ready.append(_port_open(port))

    notify = NotifyListener(str(tmp / "notify.sock"), on_message)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEBUS_")}
    env.update(NOTIFY_SOCKET=notify.path, WATCHDOG_USEC=str(WATCHDOG_USEC), PAGEBUS_LOG_FORMAT="json")
    cmd = [sys.executable, "-m", "pagebus.frontends.cli", "serve", "--config", str(config)]
    cmd += [
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        "200000000",
    ]
    cmd += ["--max-num-batched-tokens", "16", "--api-key-file", str(key_file), "--health-probe-timeout", "2"]
    log = open(tmp / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    s = state["s"] = Served(Server(proc, port, log.name, OLD_KEY), notify, key_file)
    try:
        notify.wait_for("READY=1", timeout=STARTUP_DEADLINE)
        yield s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in psutil.process_iter():  # a SIGSTOPped child must not outlive a failed test
            with contextlib.suppress(psutil.Error):
                if p.status() == psutil.STATUS_STOPPED and "pagebus::" in " ".join(p.cmdline()):
                    p.resume()
        notify.close()
        log.close()


def _stream(
    server: Server, prompt: str, max_tokens: int, key: str
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    conn.request(
        "POST", "/v1/completions", body=json.dumps(body),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return conn, resp


def _finish(resp: http.client.HTTPResponse, conn: http.client.HTTPConnection) -> str:
    """The rest of an SSE stream: its text; asserts it ended with [DONE] and finish_reason length."""
    rest = resp.read().decode()
    conn.close()
    assert rest.rstrip().endswith("data: [DONE]"), rest[-500:]
    assert '"finish_reason":"length"' in rest, rest[-500:]
    return rest


def test_ready_only_once_the_port_answers(served: Served) -> None:
    assert served.health_at_ready == [200]
    # While the engine loads, the port is closed (later STATUS lines may race the bind).
    assert served.port_open_before_ready[0] is False
    msgs = [m for _, m in served.notify.messages]
    ready = next(m for m in msgs if "READY=1" in m.split("\n"))
    assert f"MAINPID={served.server.proc.pid}" in ready.split("\n")
    assert any(m.startswith("STATUS=KV cache:") for m in msgs)  # start-up progress went out first


def test_watchdog_pings_at_half_the_interval(served: Served) -> None:
    start = served.notify.wait_for("WATCHDOG=1", after=time.monotonic())
    end = served.notify.wait_for("WATCHDOG=1", after=start + 2.0)
    pings = served.notify.times("WATCHDOG=1", since=start - 1e-9, until=end)
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    mean = sum(gaps) / len(gaps)
    # 0.5 s apart; the bounds only rule out a wrong rate (a tick late here and there is fine).
    assert 0.4 <= mean <= 0.8, gaps


def test_a_slow_but_moving_long_prefill_is_not_a_stall(served: Served) -> None:
    """An 1800-token prompt prefills in 16-token chunks on a worker stopped for half a stall
    timeout before each step (for 2.5 stall timeouts, then at full speed): no token for over two
    stall timeouts, but every step finishes within one."""
    w = served.worker()
    stop, stopped = threading.Event(), threading.Event()
    states: list[int] = []

    def steps() -> float:
        return served.server.metrics()["pagebus:engine_steps_total{}"]

    def slow_worker() -> None:
        # Stopped before the request goes out, so no step runs at full speed before the window.
        # Between stops it runs in 2 ms bursts until a step is seen: a full-speed step of this tiny
        # model is shorter than one poll of the metrics, so waiting on a poll lets dozens through.
        # Even so a slow poll can let ~20 steps through one burst (seen twice in ~15 runs: all 113
        # within 6 s), so each stop is half a stall timeout: 5 stops in the window, and finishing
        # within two stall timeouts would take ~28 steps a burst.
        start = time.monotonic()
        while not stop.is_set() and time.monotonic() < start + 2.5 * STALL_TIMEOUT:
            before = steps()
            w.suspend()
            stopped.set()
            stop.wait(STALL_TIMEOUT / 2)  # the rest of the timeout is the step's, even on a loaded box
            while not stop.is_set() and steps() <= before:  # polled while stopped
                w.resume()
                time.sleep(0.002)
                w.suspend()
        w.resume()

    def watch_health() -> None:
        while not stop.is_set():
            states.append(served.health()[0])
            stop.wait(0.2)

    # 1800 tokens, 113 steps of 16: a few steps in each of 5 stops leave most of it.
    prompt = " ".join(["hello world"] * 900)
    threads = [threading.Thread(target=slow_worker), threading.Thread(target=watch_health)]
    for t in threads:
        t.start()
    stopped.wait(30)
    t0 = time.monotonic()
    try:
        conn, resp = _stream(served.server, prompt, 1, OLD_KEY)  # returns at the first token
        served.timings["slow_prefill_s"] = time.monotonic() - t0
        _finish(resp, conn)
    finally:
        stop.set()
        for t in threads:
            t.join()
        w.resume()
    assert served.timings["slow_prefill_s"] > 2 * STALL_TIMEOUT  # so the case is the one meant
    assert states and set(states) == {200}
    assert served.stalls() == 0


def test_sigstop_worker_stalls_then_recovers(served: Served) -> None:
    conn, resp = _stream(served.server, CANARY, 30, OLD_KEY)
    resp.readline()  # the first chunk: the request is running
    w = served.worker()
    w.suspend()
    stopped = time.monotonic()
    try:
        wait_until(lambda: served.health()[0] == 503, STALL_TIMEOUT + 1.0, "/health 503")
        at_503 = time.monotonic()
        status, body = served.health()
        assert status == 503 and "engine stalled" in json.loads(body)["reason"]
        # Pings stopped: none arrives in the next 1.5 s (three intervals).
        time.sleep(1.5)  # the absence of pings is what is observed; no event to wait for
        pings = served.notify.times("WATCHDOG=1", since=stopped)
        assert not pings or pings[-1] < at_503, pings
        assert served.stalls() == 1
        assert "STALLED" in served.server.log()
    finally:
        w.resume()
    resumed = time.monotonic()
    wait_until(lambda: served.health()[0] == 200, 30, "/health 200 again")
    served.notify.wait_for("WATCHDOG=1", after=resumed, timeout=30)
    _finish(resp, conn)  # the stream completes, every token of it
    last_ping = max(served.notify.times("WATCHDOG=1", since=0, until=stopped + STALL_TIMEOUT + 1.0))
    served.timings["stall_to_503_s"] = at_503 - stopped
    served.timings["stall_to_last_ping_s"] = last_ping - stopped
    print(f"\nstall timeline: {served.timings}")


def test_generate_probe_finds_a_stopped_worker_that_plain_health_cannot(served: Served) -> None:
    assert served.server.request("GET", "/health?probe=generate", auth=False)[0] == 200
    w = served.worker()
    w.suspend()
    try:
        assert served.health()[0] == 200  # idle: nothing to make progress on, nothing stalled
        status, _, body = served.server.request("GET", "/health?probe=generate", auth=False)
        assert status == 503 and json.loads(body)["reason"] == "health probe: no token within 2s"
    finally:
        w.resume()
    wait_until(
        lambda: served.server.request("GET", "/health?probe=generate", auth=False)[0] == 200, 30, "probe"
    )
    assert served.stalls() == 1  # the one of the SIGSTOP test: a probe is not a stall


def test_sighup_rotates_the_key_without_dropping_a_stream(served: Served) -> None:
    conn, resp = _stream(served.server, "a running stream", 20, OLD_KEY)
    resp.readline()
    served.key_file.write_text(NEW_KEY + "\n")
    sent = time.monotonic()
    served.server.proc.send_signal(signal.SIGHUP)
    reloading = served.notify.wait_for("RELOADING=1", after=sent)
    served.notify.wait_for("READY=1", after=reloading)
    old = served.server.request("GET", "/v1/models", headers={"Authorization": f"Bearer {OLD_KEY}"})
    new = served.server.request("GET", "/v1/models", headers={"Authorization": f"Bearer {NEW_KEY}"})
    assert (old[0], new[0]) == (401, 200)
    _finish(resp, conn)
    served.server.api_key = NEW_KEY
    # A reload that fails (an empty key file) keeps the running configuration, and says so.
    served.key_file.write_text("\n")
    sent = time.monotonic()
    served.server.proc.send_signal(signal.SIGHUP)
    served.notify.wait_for("READY=1", after=served.notify.wait_for("RELOADING=1", after=sent))
    ready = next(m for t, m in served.notify.messages if t > sent and "READY=1" in m.split("\n"))
    assert "STATUS=serving model: reload failed, kept the old configuration" in ready
    assert served.server.request("GET", "/v1/models")[0] == 200  # still the new key


def test_json_logs_one_object_per_line_with_request_ids(served: Served) -> None:
    lines = served.server.log().splitlines()
    records = [json.loads(line) for line in lines]  # every line parses
    assert all({"time", "level", "process", "pid", "logger", "msg"} <= r.keys() for r in records)
    assert {r["process"] for r in records} >= {"http-0", "scheduler-0", "worker-0"}
    done = [r for r in records if r["msg"].startswith("request finished")]
    assert len(done) >= 3 and all(r["request_id"].startswith("cmpl-") for r in done)
    for r in done:  # each request's start line carries the same id
        assert any(
            x["request_id"] == r["request_id"] and x["msg"].startswith("request received") for x in records
        )
    stats = [r for r in records if r["logger"] == "pagebus.stats"]
    assert stats and {"generation_tps", "running", "kv_usage", "stalled"} <= stats[0]["stats"].keys()
    assert any(r["msg"].startswith("start-up: engine Ready") for r in records)
    assert any("Maximum concurrency for 2,048 tokens per request" in r["msg"] for r in records)
    text = "\n".join(lines)
    assert CANARY not in text and "hello world" not in text
    assert OLD_KEY not in text and NEW_KEY not in text


def test_sigterm_sends_stopping_after_ready_and_pings(served: Served) -> None:
    # Last: it stops the shared server.
    sent = time.monotonic()
    served.server.proc.send_signal(signal.SIGTERM)
    stopping = served.notify.wait_for("STOPPING=1", after=sent)
    assert served.server.proc.wait(60) == 0
    first_ready = served.notify.wait_for("READY=1")
    first_ping = served.notify.wait_for("WATCHDOG=1")
    assert first_ready <= first_ping < stopping
    print(f"notify transcript (first 12): {served.notify.messages[:12]}")
