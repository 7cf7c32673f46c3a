"""The service parts in process: sd_notify datagrams (path and abstract sockets, no-op when unset,
WATCHDOG_USEC/WATCHDOG_PID), the per-step progress tracker, and the log formatters."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from pagebus.bus.logs import JsonFormatter, TextFormatter, _Context, request_id_var, set_secrets
from pagebus.frontends.service.notify import Notifier
from pagebus.frontends.service.progress import ProgressTracker


def test_notify_path_and_abstract_sockets(tmp_path: Path) -> None:
    path = str(tmp_path / "n.sock")
    abstract = f"pagebus-test-{os.getpid()}"
    for address, bind in ((path, path), ("@" + abstract, "\0" + abstract)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.bind(bind)
            n = Notifier({"NOTIFY_SOCKET": address})
            n.ready("serving")
            n.watchdog()
            assert s.recv(4096).decode().split("\n") == [
                "READY=1",
                "STATUS=serving",
                f"MAINPID={os.getpid()}",
            ]
            assert s.recv(4096) == b"WATCHDOG=1"
            n.close()


def test_notify_is_a_noop_without_a_socket_and_never_raises(tmp_path: Path) -> None:
    n = Notifier({})
    assert not n.enabled and n.send("READY=1") is False and n.watchdog_interval is None
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    assert gone.send("READY=1") is False  # logged once, not raised


def test_watchdog_interval_is_half_of_watchdog_usec_for_this_pid() -> None:
    assert Notifier({"WATCHDOG_USEC": "4000000"}).watchdog_interval == 2.0
    mine = {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(mine).watchdog_interval == 0.5
    assert Notifier({**mine, "WATCHDOG_PID": str(os.getpid() + 1)}).watchdog_interval is None


def test_progress_is_per_step_not_per_request() -> None:
    p = ProgressTracker(stall_timeout=5.0)
    p.observe(10, busy=False, now=0.0)
    assert p.stalled_for(100.0) is None  # idle for long is not a stall
    p.observe(10, busy=True, now=100.0)  # work arrives: the clock starts now
    assert p.stalled_for(104.0) is None
    for t in range(1, 30):  # a long prefill: no token for 29 s, but a step every 4 s
        p.observe(10 + t, busy=True, now=100.0 + 4 * t)
        assert p.stalled_for(100.0 + 4 * t + 3.9) is None
    last = 100.0 + 4 * 29
    assert p.stalled_for(last + 5.5) == pytest.approx(5.5)  # no step for over the timeout
    p.observe(40, busy=True, now=last + 6.0)
    assert p.stalled_for(last + 6.0) is None  # recovered at the next step
    assert ProgressTracker(stall_timeout=0).stalled_for(1e9) is None  # 0: off


@pytest.fixture
def capture() -> Iterator[tuple[logging.Logger, io.StringIO, logging.StreamHandler[io.StringIO]]]:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.addFilter(_Context("http-0"))
    log = logging.getLogger("pagebus.test.service")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    yield log, buf, handler
    log.removeHandler(handler)
    set_secrets([])


def test_json_lines_carry_process_request_id_and_extras_and_mask_secrets(capture) -> None:  # type: ignore[no-untyped-def]
    log, buf, handler = capture
    handler.setFormatter(JsonFormatter())
    set_secrets(["sk-123"])
    token = request_id_var.set("cmpl-1")
    try:
        log.info("key was %s", "sk-123", extra={"stats": {"running": 2}})
    finally:
        request_id_var.reset(token)
    try:
        raise ValueError('bad "quote"\nsk-123')
    except ValueError:
        log.exception("failed")
    first, second = (json.loads(line) for line in buf.getvalue().splitlines())
    assert first["process"] == "http-0" and first["request_id"] == "cmpl-1" and first["level"] == "INFO"
    assert first["msg"] == "key was ***" and first["stats"] == {"running": 2}
    assert first["time"].endswith("Z") and first["pid"] == os.getpid()
    assert second["request_id"] is None and "ValueError" in second["exc"] and "sk-123" not in second["exc"]


def test_text_lines_show_the_request_id(capture) -> None:  # type: ignore[no-untyped-def]
    log, buf, handler = capture
    handler.setFormatter(TextFormatter())
    log.info("hello", extra={"request_id": "chatcmpl-9"})
    line = buf.getvalue()
    assert "[http-0 pid=" in line and "pagebus.test.service [chatcmpl-9]: hello" in line


@pytest.mark.parametrize("log_requests", [False, True])
def test_request_contents_are_logged_only_with_log_requests(
    log_requests: bool, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    from pagebus.frontends.http.app import App, Settings

    from tests.frontends.http.fake_client import FakeEngineClient, call

    app = App(FakeEngineClient(), Settings(served_model_name="fake", log_requests=log_requests))
    caplog.handler.addFilter(_Context("http-0"))  # what stamps the request id on each record
    with caplog.at_level(logging.INFO, logger="pagebus.http"):
        res = asyncio.run(call(app, "POST", "/v1/completions", {"prompt": "secret-prompt", "max_tokens": 3}))
    assert res.status == 200
    # Only this request's records: a server left by an earlier test may still be logging.
    mine = [r for r in caplog.records if getattr(r, "request_id", None) == res.json()["id"]]
    start, end = (r for r in mine if r.getMessage().startswith("request "))
    assert start.request_id == end.request_id and str(start.request_id).startswith("cmpl-")  # type: ignore[attr-defined]
    text = "\n".join(r.getMessage() for r in mine)
    assert ("secret-prompt" in text) == log_requests
    assert ("prompts" in start.__dict__) == log_requests and ("outputs" in end.__dict__) == log_requests
