"""Raw ASGI plumbing: the request wrapper (body with a size limit, responses) and the async helpers
that tie a response's lifetime to the client's connection."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import msgspec
from pagebus.bus.messages import RequestDelta
from pagebus.frontends.http.errors import APIError, ErrorCode, bad_request

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


@contextlib.asynccontextmanager
async def closing(it: AsyncIterator[Any]) -> AsyncIterator[AsyncIterator[Any]]:
    """Like contextlib.aclosing, for iterators that may lack aclose."""
    try:
        yield it
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


async def merge(gens: list[AsyncIterator[RequestDelta]]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Interleave several requests' deltas as they come, tagged with the prompt index."""
    if len(gens) == 1:
        async with closing(gens[0]) as g:
            async for d in g:
                yield 0, d
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, g: AsyncIterator[RequestDelta]) -> None:
        try:
            async with closing(g):
                async for d in g:
                    queue.put_nowait((i, d, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        else:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, d, err = await queue.get()
            if err is not None:
                raise err
            if d is None:
                remaining -= 1
            else:
                yield i, d
    finally:
        for t in tasks:
            t.cancel()  # closes every still-open delta iterator, which aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)


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
