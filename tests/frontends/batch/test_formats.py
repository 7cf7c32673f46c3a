"""Batch line parsing, output shapes, resume bookkeeping and the Runner's window, without an engine."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pagebus.bus.messages import FinishReason, GenerateRequest, RequestDelta, SampleDelta
from pagebus.frontends.batch.formats import parse_line
from pagebus.frontends.batch.resume import count_lines, load_answered
from pagebus.frontends.batch.runner import Runner, iter_lines
from pagebus.frontends.openai.handler import Context

CTX = Context("m", vocab_size=1000)


def _batch(cid: Any, url: str = "/v1/completions", **body: Any) -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}).encode()


def test_parse_forms_and_line_errors() -> None:
    ok = parse_line(_batch("a", prompt="hi"), 1)
    assert (ok.form, ok.key, ok.kind, ok.error) == ("batch", "a", "completion", None)
    assert json.loads(ok.body) == {"prompt": "hi"}
    chat = parse_line(_batch("b", url="/v1/chat/completions", messages=[]), 2)
    assert chat.kind == "chat"
    assert parse_line(b"{nope", 3).error[0] == "invalid_json"  # type: ignore[index]
    assert parse_line(b"[1, 2]", 4).error[0] == "invalid_line"  # type: ignore[index]
    assert parse_line(b'{"method": "POST", "url": "/v1/completions", "body": {}}', 5).error == (
        "missing_custom_id",
        "custom_id must be a string",
    )
    assert parse_line(_batch("c", url="/v1/embeddings"), 6).error[0] == "invalid_url"  # type: ignore[index]
    get = parse_line(b'{"custom_id": "d", "method": "GET", "url": "/v1/completions"}', 7)
    assert get.error[0] == "invalid_method"  # type: ignore[index]
    short = parse_line(b'{"prompt": "x", "max_tokens": 2}', 8)
    assert (short.form, short.key, short.kind) == ("short", 8, "completion")
    named = parse_line(b'{"id": "q", "messages": [{"role": "user", "content": "x"}]}', 9)
    assert (named.key, named.kind) == ("q", "chat")
    both = parse_line(b'{"prompt": "x", "messages": []}', 10)
    assert both.api_error is not None and both.api_error.status == 400
    assert parse_line(b'{"foo": 1}', 11, "short").form == "short"  # unrecognisable: neighbours' form


def test_iter_lines_keeps_a_last_line_without_newline(tmp_path: Path) -> None:
    p = tmp_path / "in.jsonl"
    p.write_bytes(b"a\n\nb" + b"x" * 70000 + b"\nlast")
    import os

    fd = os.open(p, os.O_RDONLY)
    assert list(iter_lines(fd)) == [b"a\n", b"\n", b"b" + b"x" * 70000 + b"\n", b"last"]
    os.close(fd)
    assert count_lines(str(p)) == 4


def test_resume_truncates_partial_tail_and_keeps_retryable_lines(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    lines = [
        {"id": "x1", "custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": None},
        {"custom_id": "b", "response": {"status_code": 400, "body": {"error": {"message": "line 2: bad"}}}},
        {"custom_id": None, "response": None, "error": {"code": "invalid_json", "message": "line 3: x"}},
        {"id": "x4", "custom_id": "d", "response": {"status_code": 503, "body": {}}, "error": None},
        {"id": 5, "text": "t", "finish_reason": "length", "usage": {}},
    ]
    out.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in lines) + b'{"id": "x6", "custom_')
    keys = load_answered(str(out))
    assert keys == {("custom_id", "a"), ("custom_id", "b"), ("line", 2), ("line", 3), ("id", 5)}
    assert out.read_bytes().endswith(b"}\n")  # the partial line is gone


# ------------------------------------------------------------------------------- runner
class FakeClient:
    """Answers each prompt with its own text; a prompt named in `hold` waits for `release`."""

    def __init__(self, hold: set[str] | None = None) -> None:
        self.hold, self.release = hold or set(), asyncio.Event()
        self.active = self.peak = 0

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestDelta]:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if req.prompt in self.hold:
                await self.release.wait()
            await asyncio.sleep(0)
            sample = SampleDelta(0, f"<{req.prompt}>", [1], finish_reason=FinishReason.LENGTH)
            yield RequestDelta(req.request_id, [sample], finished=True, num_prompt_tokens=3)
        finally:
            self.active -= 1


class FakeReader:
    def __init__(self, lines: list[bytes]) -> None:
        self.lines, self.reads = lines, 0

    async def next(self) -> tuple[int, bytes] | None:
        if self.reads >= len(self.lines):
            return None
        self.reads += 1
        return self.reads, self.lines[self.reads - 1]


def _run(runner: Runner, reader: FakeReader) -> Any:
    return asyncio.run(asyncio.wait_for(runner.run(reader), 10))  # type: ignore[arg-type]


def test_runner_orders_output_and_bounds_the_window() -> None:
    async def go() -> tuple[list[dict[str, Any]], FakeReader, FakeClient]:
        client, out = FakeClient(hold={"p0"}), io.BytesIO()
        lines = [b'{"prompt": "p%d"}' % i for i in range(20)]
        reader = FakeReader(lines)
        runner = Runner(client, CTX, out, max_inflight=4)
        task = asyncio.create_task(runner.run(reader))  # type: ignore[arg-type]
        for _ in range(50):  # let the loop run until the window is full
            await asyncio.sleep(0)
        assert reader.reads == 4 and out.getvalue() == b""  # the oldest line blocks the window
        assert len(runner.pending) == 3
        client.release.set()
        summary = await asyncio.wait_for(task, 10)
        assert (summary.ok, summary.failed, summary.output_tokens) == (20, 0, 20)
        return [json.loads(x) for x in out.getvalue().splitlines()], reader, client

    rows, _, client = asyncio.run(go())
    assert [r["id"] for r in rows] == list(range(1, 21))
    assert [r["text"] for r in rows] == [f"<p{i}>" for i in range(20)]
    assert client.peak <= 4


def test_runner_unordered_writes_as_lines_complete() -> None:
    async def go() -> list[dict[str, Any]]:
        client, out = FakeClient(hold={"p0"}), io.BytesIO()
        reader = FakeReader([b'{"prompt": "p%d"}' % i for i in range(6)])
        task = asyncio.create_task(Runner(client, CTX, out, max_inflight=8, ordered=False).run(reader))  # type: ignore[arg-type]
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(out.getvalue().splitlines()) == 5  # everything but the held line
        client.release.set()
        await asyncio.wait_for(task, 10)
        return [json.loads(x) for x in out.getvalue().splitlines()]

    rows = asyncio.run(go())
    assert rows[-1]["id"] == 1 and sorted(r["id"] for r in rows) == list(range(1, 7))


def test_runner_error_lines_and_resume_skips() -> None:
    out = io.BytesIO()
    lines = [
        _batch("a", prompt="x"),
        b"garbage",
        _batch("b", prompt="x", stream=True),
        _batch("c", prompt="x", model="other"),
        _batch("d", prompt="x", max_tokens="many"),
        _batch("e", prompt="x"),
    ]
    runner = Runner(FakeClient(), CTX, out, answered={("custom_id", "e")})
    summary = _run(runner, FakeReader(lines))
    assert (summary.ok, summary.failed, summary.skipped) == (1, 4, 1)
    rows = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [r["custom_id"] for r in rows] == ["a", None, "b", "c", "d"]
    assert rows[0]["response"]["status_code"] == 200 and rows[0]["error"] is None
    assert rows[1]["response"] is None and rows[1]["error"]["code"] == "invalid_json"
    assert rows[1]["error"]["message"].startswith("line 2: ")
    statuses = [r["response"]["status_code"] for r in rows[2:]]
    assert statuses == [400, 404, 400]
    assert rows[2]["response"]["body"]["error"]["param"] == "stream"
    assert rows[4]["response"]["body"]["error"]["message"].startswith("line 5: ")


@pytest.mark.parametrize("bad", [0, -3])
def test_runner_rejects_an_empty_window(bad: int) -> None:
    with pytest.raises(ValueError):
        Runner(FakeClient(), CTX, io.BytesIO(), max_inflight=bad)
