"""End to end over raw HTTP: every error status, the waiting-queue limit, and SIGTERM drain.

The server runs one sequence at a time (--max-num-seqs 1) with --max-waiting 0, so a second
request queued behind a running one makes a third deterministically get 429.
"""

from __future__ import annotations

import http.client
import signal
import threading
from collections.abc import Iterator

import msgspec
import pytest

from tests.frontends.http.server_proc import Server, run_server, wait_until

pytestmark = pytest.mark.slow
KEY = "sk-errors"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    extra = [
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "0",
        "--max-request-bytes",
        "4096",
    ]
    with run_server(*extra, api_key=KEY) as s:
        yield s


def error_of(body: bytes) -> dict[str, object]:
    err = msgspec.json.decode(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_error_statuses(server: Server) -> None:
    assert server.request("GET", "/health", auth=False)[0] == 200
    status, _, body = server.request("GET", "/v1/models", auth=False)
    assert status == 401 and error_of(body)["code"] == "invalid_api_key"
    assert server.request("GET", "/v1/models", headers={"Authorization": "Bearer nope"})[0] == 401
    status, _, body = server.request("POST", "/v1/completions", {"model": "gpt-x", "prompt": "a"})
    assert status == 404 and error_of(body)["param"] == "model"
    assert server.request("GET", "/v2/nothing")[0] == 404
    status, headers, _ = server.request("GET", "/v1/chat/completions")
    assert status == 405 and headers["allow"] == "POST"
    status, _, body = server.request("POST", "/v1/completions", b'{"prompt": "a",')
    assert status == 400 and "malformed JSON" in str(error_of(body)["message"])
    status, _, body = server.request("POST", "/v1/completions", {"prompt": "a", "max_tokens": "lots"})
    assert status == 400 and error_of(body)["param"] == "max_tokens"
    status, _, body = server.request("POST", "/v1/completions", {"prompt": "a", "temperature": -1})
    assert status == 400 and error_of(body)["param"] == "temperature"
    status, _, body = server.request("POST", "/v1/completions", {"prompt": "hello " * 300, "max_tokens": 4})
    assert status == 400 and "256" in str(error_of(body)["message"]), body
    status, _, body = server.request("POST", "/v1/completions", {"prompt": "x" * 5000})
    assert status == 413 and error_of(body)["code"] == "request_too_large"
    assert b"Traceback" not in body


def test_413_without_content_length(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    chunks = iter([b'{"prompt": "', b"x" * 3000, b"y" * 3000, b'"}'])
    conn.request("POST", "/v1/completions", chunks, {"Authorization": f"Bearer {KEY}"}, encode_chunked=True)
    assert conn.getresponse().status == 413
    conn.close()


def test_tokenize_detokenize_openapi(server: Server) -> None:
    status, _, body = server.request("POST", "/tokenize", {"prompt": "Hello world"})
    tok = msgspec.json.decode(body)
    assert status == 200 and tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 256
    status, _, body = server.request("POST", "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and msgspec.json.decode(body)["prompt"].endswith("Hello world")
    status, _, body = server.request("GET", "/openapi.json")
    assert status == 200 and "/v1/chat/completions" in msgspec.json.decode(body)["paths"]


def _stream(server: Server, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", msgspec.json.encode(body), {"Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read1(65536).startswith(b"data: ")
    return conn, resp


def test_429_when_waiting_exceeds_max_waiting(server: Server) -> None:
    running, _ = _stream(server, 200)  # holds the only running slot
    queued: list[int] = []
    t = threading.Thread(
        target=lambda: queued.append(
            server.request("POST", "/v1/completions", {"prompt": "b", "max_tokens": 1})[0]
        )
    )
    t.start()
    wait_until(
        lambda: server.metrics()["pagebus:num_requests_waiting{}"] >= 1, 30, "the second request to queue"
    )
    status, headers, body = server.request("POST", "/v1/completions", {"prompt": "c", "max_tokens": 1})
    assert status == 429 and headers["retry-after"] == "1", body
    running.close()  # disconnect: the running request aborts and the queued one runs
    t.join(60)
    assert queued == [200]


def test_sigterm_drains_in_flight_stream_then_exits_0(server: Server) -> None:
    # Last in this module: it stops the shared server.
    conn, resp = _stream(server, 24)
    server.proc.send_signal(signal.SIGTERM)
    rest = resp.read()
    assert rest.rstrip().endswith(b"data: [DONE]"), rest[-300:]
    assert b'"finish_reason":"length"' in rest
    conn.close()
    assert server.proc.wait(60) == 0, server.log()[-3000:]
