"""Raw ASGI plumbing: the request wrapper (body with a size limit, responses) and the helper that
ties a response's lifetime to the client's connection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
from pagebus.frontends.openai.errors import APIError, ErrorCode, bad_request

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
JSON_HEADERS = [(b"content-type", b"application/json")]
_json = msgspec.json.Encoder()


class ClientGone(Exception):
    """The client disconnected while we were reading its body."""


class Request:
    def __init__(self, scope: Scope, receive: Receive, send: Send, max_bytes: int) -> None:
        self.scope, self.receive, self._send, self.max_bytes = scope, receive, send, max_bytes
        self.headers: dict[bytes, bytes] = {k.lower(): v for k, v in scope.get("headers", [])}
        self.started = False

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    async def body(self) -> bytes:
        """The whole body, refused with 413 past `max_bytes` whether or not Content-Length says so."""
        declared = self.headers.get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                raise bad_request("invalid Content-Length header") from None
            if too_big:
                raise _too_large(self.max_bytes)
        chunks, size = [], 0
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _too_large(self.max_bytes)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    async def respond(
        self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": headers or JSON_HEADERS})
        await self.send({"type": "http.response.body", "body": body})

    async def json(self, obj: Any, status: int = 200) -> None:
        await self.respond(status, _json.encode(obj))


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"request body is larger than the limit of {limit} bytes", code=ErrorCode.REQUEST_TOO_LARGE
    )


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(work: Coroutine[Any, Any, None], receive: Receive) -> None:
    """Run `work`; if the client disconnects first, cancel it (closing the engine iterator aborts)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let the abort reach the engine
    if not task.cancelled():
        task.result()
