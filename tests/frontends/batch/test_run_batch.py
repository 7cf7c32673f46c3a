"""End to end: real `pagebus run-batch` processes (default model, fp32 on CPU) over a 1,000-line batch."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.frontends.http.server_proc import ROOT, run_server, wait_until

pytestmark = pytest.mark.slow
MAX_LEN = "256"
N_LINES = 1000
BAD_KINDS = ("not_json", "no_custom_id", "bad_url", "bad_type", "stream", "too_long", "bad_model")
WORDS = ("river", "mountain", "city", "garden", "engine", "window", "forest", "ocean", "violin", "castle")


@dataclass
class Expect:
    custom_id: str | None
    status: int | None  # HTTP status in `response`, or None for a top-level error
    code: str | None = None  # top-level error code
    body: dict[str, Any] | None = None
    url: str = "/v1/completions"


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagebus.frontends.cli", "run-batch", "--dtype", "float32", "--max-model-len", MAX_LEN, *args]  # fmt: skip


def _valid(i: int, rng: random.Random) -> tuple[str, dict[str, Any]]:
    # Short prompts and few chat lines (the chat template adds ~30 tokens): prefill dominates on CPU.
    word = rng.choice(WORDS)
    if i % 10 == 1:
        msgs = [{"role": "user", "content": f"The {word} {i}?"}]
        return "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "temperature": 0}
    return "/v1/completions", {"prompt": f"{i}: the {word} is", "max_tokens": 4, "temperature": 0}


def _bad(kind: str, cid: str, i: int, rng: random.Random) -> tuple[bytes, Expect]:
    url, body = _valid(i, rng)
    e = Expect(cid, 400, url=url)
    if kind == "not_json":
        return b'{"custom_id": "%s", "method": "POST", ' % cid.encode(), Expect(None, None, "invalid_json")
    if kind == "no_custom_id":
        return json.dumps({"method": "POST", "url": url, "body": body}).encode(), Expect(
            None, None, "missing_custom_id"
        )
    if kind == "bad_url":
        url, e = "/v1/embeddings", Expect(cid, None, "invalid_url")
    elif kind == "bad_type":
        body["max_tokens"] = "four"
    elif kind == "stream":
        body["stream"] = True
    elif kind == "too_long":  # over --max-model-len: refused by the scheduler, a 400 as over HTTP
        body.pop("messages", None)
        body["prompt"], url, e.url = "hello " * 300, "/v1/completions", "/v1/completions"
    elif kind == "bad_model":
        body["model"], e.status = "no-such-model", 404
    e.body = body
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}).encode(), e


def make_batch(path: Path) -> list[Expect]:
    rng, expects, lines = random.Random(0), [], []
    for i in range(N_LINES):
        cid = f"req-{i}"
        if i % 20 == 7:  # 5% bad, every kind
            raw, e = _bad(BAD_KINDS[(i // 20) % len(BAD_KINDS)], cid, i, rng)
        else:
            url, body = _valid(i, rng)
            raw, e = json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}).encode(), None
            e = Expect(cid, 200, body=body, url=url)
        lines.append(raw)
        expects.append(e)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return expects


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_bytes().splitlines()]


def _line_of(row: dict[str, Any]) -> int | None:
    err = row["error"] or ((row["response"] or {}).get("body") or {}).get("error") or {}
    m = re.match(r"line (\d+): ", err.get("message", ""))
    return int(m.group(1)) if m else None


def _result(row: dict[str, Any]) -> Any:
    """What must match across runs: status and choices/usage, or the error (ids and times differ)."""
    if row["response"] is None:
        return row["error"]["code"]
    body = row["response"]["body"]
    if "error" in body:
        return row["response"]["status_code"], body["error"]
    return 200, body["choices"], _usage(body["usage"])


def _usage(u: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in u.items() if k != "prompt_tokens_details"}  # cache hits depend on history


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Expect]]:
    d = tmp_path_factory.mktemp("batch")
    return d / "in.jsonl", make_batch(d / "in.jsonl")


@pytest.fixture(scope="module")
def ordered(
    batch: tuple[Path, list[Expect]],
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    inp, _ = batch
    out = inp.with_name("ordered.jsonl")
    proc = subprocess.run(_cmd("-i", str(inp), "-o", str(out)), cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    return proc, _rows(out)


def test_every_line_answered_in_order(batch: tuple[Path, list[Expect]], ordered: Any) -> None:
    _, expects = batch
    proc, rows = ordered
    assert proc.returncode == 1, proc.stderr[-3000:]  # some lines failed
    assert "950 ok, 50 failed" in proc.stderr
    assert len(rows) == N_LINES
    for n, (e, row) in enumerate(zip(expects, rows, strict=True), 1):
        assert row["custom_id"] == e.custom_id, (n, row)
        assert row["id"].startswith("batch_req_")
        if e.status is None:
            assert row["response"] is None and row["error"]["code"] == e.code, (n, row)
        else:
            assert row["error"] is None and row["response"]["status_code"] == e.status, (n, row)
        if e.status != 200:
            assert _line_of(row) == n, row
        else:
            choice = row["response"]["body"]["choices"][0]
            assert choice["finish_reason"] in ("length", "stop")
    assert rows[7]["response"] is None  # line 8: not JSON
    too_long = next(r for r, e in zip(rows, expects, strict=True) if e.body and e.body.get("prompt", "").startswith("hello "))  # fmt: skip
    assert "max_model_len" in too_long["response"]["body"]["error"]["message"]


def test_results_equal_the_http_server(batch: tuple[Path, list[Expect]], ordered: Any) -> None:
    _, expects = batch
    _, rows = ordered
    picks = [0, 1, 2, 3, 500, 999]  # a few successes of both kinds, and one bad line of each HTTP kind
    seen: set[str] = set()
    for i in range(len(expects)):
        kind = BAD_KINDS[(i // 20) % len(BAD_KINDS)] if i % 20 == 7 else None
        # (stream: true is valid over HTTP, it streams; only a batch refuses it)
        if kind in ("bad_type", "too_long", "bad_model") and kind not in seen:
            seen.add(kind)
            picks.append(i)
    with run_server("--max-model-len", MAX_LEN) as server:
        for i in picks:
            e = expects[i]
            status, _, raw = server.request("POST", e.url, e.body)
            got = json.loads(raw)
            row = rows[i]
            assert row["response"]["status_code"] == status, (i, row, got)
            if status == 200:
                assert (got["choices"], _usage(got["usage"])) == _result(row)[1:], i
            else:
                err = row["response"]["body"]["error"]
                assert err["message"] == f"line {i + 1}: {got['error']['message']}"
                assert {**err, "message": ""} == {**got["error"], "message": ""}


def test_sigkill_then_resume_unordered(batch: tuple[Path, list[Expect]], ordered: Any) -> None:
    full, expects = batch
    _, in_order = ordered
    # The first 300 lines keep this test's two runs short; every bad kind is among them.
    n = 300
    expects, in_order = expects[:n], in_order[:n]
    inp = full.with_name("head.jsonl")
    inp.write_bytes(b"".join(full.read_bytes().splitlines(keepends=True)[:n]))
    out = inp.with_name("killed.jsonl")
    args = ("-i", str(inp), "-o", str(out), "--unordered", "--quiet")
    # A smaller window than the resumed run's, so the kill surely lands mid-batch.
    proc = subprocess.Popen(_cmd(*args, "--max-inflight", "64"), cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        wait_until(lambda: out.exists() and out.read_bytes().count(b"\n") >= 50, 300, "50 answers")
    finally:
        proc.kill()  # SIGKILL: no chance to finish the line being written
        proc.wait(30)
    before = out.read_bytes().count(b"\n")
    assert before < n, "the batch finished before the kill"
    resumed = subprocess.run(_cmd(*args, "--resume"), cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 1, resumed.stderr[-3000:]
    rows = _rows(out)  # every line parses: resume cut a partial last line off
    ids = Counter(r["custom_id"] for r in rows if r["custom_id"] is not None)
    assert ids == Counter(e.custom_id for e in expects if e.custom_id is not None)
    anonymous = Counter(_line_of(r) for r in rows if r["custom_id"] is None)
    assert anonymous == Counter(n for n, e in enumerate(expects, 1) if e.custom_id is None)
    assert len(rows) == n
    # Unordered results, sorted back into input order, equal the in-order run's.
    key = {e.custom_id or f"line-{n}": n for n, e in enumerate(expects, 1)}
    by_line = sorted(rows, key=lambda r: key[r["custom_id"] or f"line-{_line_of(r)}"])
    assert [_result(r) for r in by_line] == [_result(r) for r in in_order]


def test_stdin_to_stdout_short_form_exit_0() -> None:
    lines = [
        {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
        {"id": "chat-1", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0},
        {"prompt": "One, two, three,", "max_tokens": 3, "temperature": 0, "stop": ["\n"]},
    ]
    stdin = "".join(json.dumps(x) + "\n" for x in lines)
    proc = subprocess.Popen(
        _cmd(), cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = proc.communicate(stdin, timeout=300)
    assert proc.returncode == 0, err[-3000:]
    rows = [json.loads(x) for x in out.splitlines()]
    assert [r["id"] for r in rows] == [1, "chat-1", 3]
    assert rows[0]["text"] and rows[0]["usage"]["completion_tokens"] == 4
    assert rows[1]["message"]["role"] == "assistant" and rows[1]["message"]["content"]
    assert all(r["finish_reason"] in ("length", "stop") for r in rows)
    assert "3 ok, 0 failed" in err


@pytest.mark.parametrize(
    "args",
    [
        ("-i", "/nonexistent/in.jsonl"),
        ("--max-inflight", "0"),
        ("--no-such-flag",),
        ("-i", os.devnull, "--resume"),  # --resume needs an output file
    ],
)
def test_usage_errors_exit_2(args: tuple[str, ...]) -> None:
    proc = subprocess.run(_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "error" in proc.stderr


def test_sigterm_finishes_in_flight_and_exits_130() -> None:
    # bufsize=0: readline() must not pull later lines into a Python buffer that communicate(),
    # which reads the raw pipe, would never see.
    proc = subprocess.Popen(
        _cmd("--max-inflight", "4"), cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        bufsize=0,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    body = {"max_tokens": 4, "temperature": 0}
    proc.stdin.write(
        b"".join(json.dumps({"prompt": f"Count {i}:", **body}).encode() + b"\n" for i in range(3))
    )
    proc.stdin.flush()
    first = json.loads(proc.stdout.readline())  # stdin stays open: the batch is mid-way
    assert first["id"] == 1 and first["text"]
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    ids = [json.loads(x)["id"] for x in rest.splitlines()]
    assert ids == [2, 3]  # in-flight lines finished, nothing lost
    assert b"3 ok, 0 failed" in err and b"interrupted" in err
