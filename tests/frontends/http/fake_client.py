"""FakeEngineClient: the AsyncEngineClient interface with scripted outputs, for unit tests of the
HTTP layers only (parsing, SSE building, errors, auth, metrics). End-to-end tests use real processes.

Scripted by prompt text: "hang" yields one delta then waits until closed; "too long" is rejected
as invalid; "dead" raises EngineDeadError; anything else yields "Hello", " world" per sample.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from pagebus.bus.messages import (
    ErrorKind,
    FinishReason,
    GenerateRequest,
    RequestDelta,
    SampleDelta,
    SchedulerStats,
    TokenizeRequest,
    TokenizeResult,
    TokenLogprobs,
)
from pagebus.frontends.engine.interface import EngineDeadError, EngineInfo


def fake_info() -> EngineInfo:
    return EngineInfo("fake-model", "/models/fake-model.gguf", 64, 100, 16, 0.0)


@dataclass
class FakeEngineClient:
    info: EngineInfo = field(default_factory=fake_info)
    latest_stats: SchedulerStats | None = None
    is_ready: bool = True
    is_dead: bool = False
    dead_reason: str | None = None
    requests: list[GenerateRequest] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)  # request ids whose iterator was closed early
    streaming: asyncio.Event | None = None

    @property
    def num_unfinished(self) -> int:
        return 0

    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestDelta]:
        self.requests.append(req)
        return self._gen(req)

    async def _gen(self, req: GenerateRequest) -> AsyncIterator[RequestDelta]:
        p = req.params
        prompt = req.prompt or ""
        if prompt == "dead":
            raise EngineDeadError("the engine died; see the server log")
        if prompt == "too long":
            yield RequestDelta(
                req.request_id,
                [],
                finished=True,
                error=f"prompt is 99 tokens, longer than max_model_len {self.info.max_model_len}",
                error_kind=ErrorKind.INVALID_REQUEST,
            )
            return
        n_prompt = len(req.prompt_token_ids or []) or 3
        first = True
        finished = False
        try:
            for step, text in enumerate(["Hello", " world"]):
                last = step == 1
                samples = [
                    SampleDelta(
                        i,
                        text,
                        [10 + step],
                        [TokenLogprobs(10 + step, -0.5, 1, [10 + step, 20], [-0.5, -1.5])]
                        if p.logprobs is not None
                        else [],
                        FinishReason.LENGTH if last else None,
                    )
                    for i in range(p.n)
                ]
                yield RequestDelta(
                    req.request_id,
                    samples,
                    finished=last,
                    num_prompt_tokens=n_prompt,
                    num_cached_tokens=1,
                    prompt_text="PROMPT " if first and req.echo else None,
                )
                first = False
                if prompt == "hang":
                    if self.streaming is not None:
                        self.streaming.set()
                    await asyncio.Event().wait()
            finished = True
        finally:
            if not finished:
                self.closed.append(req.request_id)

    async def abort(self, request_id: str) -> None:
        self.closed.append(request_id)

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResult:
        text = req.prompt if req.prompt is not None else msgspec.json.encode(req.messages).decode()
        return TokenizeResult(request_id=req.request_id, token_ids=[ord(c) % 100 for c in text])

    async def detokenize(self, token_ids: list[int]) -> str:
        return "".join(chr(65 + t % 26) for t in token_ids)

    async def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        pass


# ------------------------------------------------------------------------- ASGI driver
@dataclass
class Reply:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def json(self) -> Any:
        return msgspec.json.decode(self.body)


async def call(
    app: Any,
    method: str,
    path: str,
    body: bytes | Any = b"",
    headers: dict[str, str] | None = None,
    chunks: list[bytes] | None = None,
    disconnect: asyncio.Event | None = None,
) -> Reply:
    """Drive the ASGI app like uvicorn does: body messages, then http.disconnect when asked.
    Status 0: the app sent no response (the client had gone)."""
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    parts = chunks if chunks is not None else [raw]
    hdrs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if chunks is None:
        hdrs.append((b"content-length", str(len(raw)).encode()))
    queue = [
        {"type": "http.request", "body": c, "more_body": i < len(parts) - 1} for i, c in enumerate(parts)
    ]
    sent: list[dict[str, Any]] = []
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        await (disconnect.wait() if disconnect is not None else done.wait())
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": method, "path": path, "headers": hdrs}
    await app(scope, receive, send)
    done.set()
    start = next((m for m in sent if m["type"] == "http.response.start"), {"status": 0, "headers": []})
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return Reply(start["status"], dict(start["headers"]), data)


def sse_events(body: bytes) -> list[Any]:
    """The decoded `data:` payloads of an SSE body; the final [DONE] stays a string."""
    out: list[Any] = []
    for block in body.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            out.append(payload if payload == "[DONE]" else msgspec.json.decode(payload))
    return out
