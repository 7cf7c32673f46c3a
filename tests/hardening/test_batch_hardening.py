"""run-batch under hostile input and engine death: duplicate custom_ids, hypothesis-generated
bodies (error lines, never a crash), and a worker killed mid-batch on the real engine."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagebus.frontends.batch.formats import answered_keys
from pagebus.frontends.batch.runner import LineReader, Runner, Summary
from pagebus.frontends.openai import handler as H

from tests.frontends.http.fake_client import FakeEngineClient
from tests.frontends.http.server_proc import ROOT, wait_until


def run_lines(lines: list[bytes], answered: set[Any] | None = None) -> tuple[list[dict[str, Any]], Summary]:
    """Lines through the batch runner over the fake engine; the output rows and the summary."""

    async def go() -> tuple[bytes, Summary]:
        r, w = os.pipe()
        os.write(w, b"".join(x + b"\n" for x in lines))
        os.close(w)
        out = io.BytesIO()
        runner = Runner(FakeEngineClient(), H.Context("fake", 100), out, max_inflight=8, answered=answered)
        reader = LineReader(r, asyncio.get_running_loop())
        reader.start()
        summary = await runner.run(reader)
        os.close(r)
        return out.getvalue(), summary

    raw, summary = asyncio.run(go())
    return [json.loads(x) for x in raw.splitlines()], summary


def batch_line(cid: str, body: dict[str, Any] | None = None) -> bytes:
    body = body or {"prompt": "hi", "max_tokens": 2}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}).encode()


def test_duplicate_custom_ids_are_error_lines_and_the_first_wins() -> None:
    lines = [batch_line("a"), batch_line("b"), batch_line("a"), batch_line("c"), batch_line("b")]
    rows, summary = run_lines(lines)
    assert [r["custom_id"] for r in rows] == ["a", "b", "a", "c", "b"]
    assert [r["error"] is None for r in rows] == [True, True, False, True, False]
    assert rows[2]["error"]["code"] == "duplicate_custom_id" and "line 1" in rows[2]["error"]["message"]
    assert rows[4]["error"]["message"].startswith("line 5: ") and "line 2" in rows[4]["error"]["message"]
    assert (summary.ok, summary.failed, summary.duplicates) == (3, 2, 2)
    assert "2 with a duplicate custom_id" in summary.line()
    # A duplicate's error answers its own line, never the first line's custom_id (--resume).
    assert answered_keys(json.dumps(rows[2]).encode()) == [("line", 3)]


def test_resume_skips_answered_duplicates_and_reruns_an_unanswered_first() -> None:
    lines = [batch_line("a"), batch_line("a")]
    first, _ = run_lines(lines)
    # As if a killed --unordered run had written only the duplicate's error line.
    answered = set(answered_keys(json.dumps(first[1]).encode()))
    rows, summary = run_lines(lines, answered)
    assert [r["custom_id"] for r in rows] == ["a"] and rows[0]["error"] is None
    assert (summary.ok, summary.skipped, summary.duplicates) == (1, 1, 0)


# Hypothesis-generated bodies: JSON values of every shape in and around the request fields.
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8,
)
_fields = st.sampled_from(
    ["prompt", "messages", "n", "max_tokens", "temperature", "top_p", "stop", "logprobs", "stream", "seed",
     "top_logprobs", "priority", "model", "min_tokens", "stop_token_ids", "echo", "stream_options"]
)  # fmt: skip
_messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["user", "system", "assistant", "tool", "wizard", ""]) | _json,
            "content": st.text(max_size=8) | _json,
            "tool_call_id": st.text(max_size=4) | _json,
        },
    ),
    max_size=3,
)
BODIES = st.one_of(
    st.dictionaries(_fields, _json, max_size=6),
    st.fixed_dictionaries({"messages": _messages}, optional={"n": _json, "max_tokens": _json}),
    st.fixed_dictionaries({"prompt": _json}, optional={"n": _json, "max_tokens": _json}),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies=st.lists(st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), BODIES), min_size=1, max_size=6))  # fmt: skip
def test_fuzzed_bodies_get_one_answer_each_and_never_a_500(bodies: list[tuple[str, Any]]) -> None:
    lines = [
        json.dumps({"custom_id": f"f{i}", "method": "POST", "url": url, "body": body}).encode()
        for i, (url, body) in enumerate(bodies)
    ]
    rows, summary = run_lines(lines)
    assert [r["custom_id"] for r in rows] == [f"f{i}" for i in range(len(bodies))]
    for r in rows:
        if r["error"] is None:
            status = r["response"]["status_code"]
            assert status in (200, 400, 404), r
            if status != 200:
                err = r["response"]["body"]["error"]
                assert set(err) == {"message", "type", "param", "code"}, r
    assert summary.ok + summary.failed == len(bodies)


def _engine_pid(root: int, role: str) -> int:
    """The pid of an engine process by its title (`pagebus::worker-0`), among root's descendants."""
    for p in psutil.Process(root).children(recursive=True):
        try:
            if f"pagebus::{role}" in " ".join(p.cmdline()):
                return p.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no {role} process under {root}")


@pytest.mark.slow
def test_worker_death_mid_batch_gives_every_in_flight_line_an_error_then_resume_completes(
    tmp_path: Path,
) -> None:
    n = 10
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"".join(batch_line(f"r{i}", {"prompt": f"{i}: once", **body}) + b"\n" for i in range(n)))
    cmd = [sys.executable, "-m", "pagebus.frontends.cli", "run-batch", "--dtype", "float32",
           "--max-model-len", "128", "--num-kv-blocks", "64", "-i", str(inp), "-o", str(out), "--quiet",
           "--max-inflight", "4"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: out.exists() and out.read_bytes().count(b"\n") >= 2, 240, "2 answers")
        os.kill(_engine_pid(proc.pid, "worker"), 9)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err.decode()[-2000:]
    assert b"rerun with --resume" in err
    rows = [json.loads(x) for x in out.read_bytes().splitlines()]
    dead = [r for r in rows if r["response"]["status_code"] == 503]
    assert dead and all(r["response"]["body"]["error"]["code"] == "engine_dead" for r in dead)
    ok = {r["custom_id"] for r in rows if r["response"]["status_code"] == 200}
    # In order, at most the window (4) was open: every line read was answered, ok or engine_dead.
    assert [r["custom_id"] for r in rows] == [f"r{i}" for i in range(len(rows))]
    assert len(rows) < n
    resumed = subprocess.run([*cmd, "--resume"], cwd=ROOT, capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    rows = [json.loads(x) for x in out.read_bytes().splitlines()]
    final = {r["custom_id"]: r["response"]["status_code"] for r in rows}  # later lines win
    assert final == {f"r{i}": 200 for i in range(n)}
    assert not ok & {r["custom_id"] for r in rows[len(ok) + len(dead) :]}  # no ok line ran twice
