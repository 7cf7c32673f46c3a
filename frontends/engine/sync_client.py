"""`Engine` over the multi-process engine: `LLM(..., multiprocess=True)` drives it step by step.

`AsyncEngineClient` runs on a background event-loop thread (which also spawns the engine
processes, so their parent-death signal is tied to a thread that lives as long as this object).
Deltas reach the caller's thread through one queue; `step()` waits for the next and takes
every one that has arrived since.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import GenerateRequest, RequestDelta, SchedulerStats
from pagebus.frontends.engine.client import AsyncEngineClient

T = TypeVar("T")


class MultiprocEngine:
    def __init__(self, cfg: EngineConfig, tokenizer_workers: int = 1) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pagebus-client", daemon=True)
        self.thread.start()
        try:
            self.client: AsyncEngineClient = self.call(
                AsyncEngineClient.start(cfg, tokenizer_workers=tokenizer_workers)
            )
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5.0)
            raise
        self.info = self.client.info
        self._outputs: queue.SimpleQueue[RequestDelta | BaseException] = queue.SimpleQueue()
        self._unfinished: set[str] = set()
        self._finalizer = weakref.finalize(self, _close, self.loop, self.client, self.thread)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the client's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _on_loop(self, fn: Callable[..., T], *args: Any) -> T:
        async def run() -> T:
            return fn(*args)

        return self.call(run())

    # ------------------------------------------------------------------ Engine
    def add(self, req: GenerateRequest) -> None:
        self._unfinished.add(req.request_id)  # first: its last delta may arrive before submit returns
        try:
            self._on_loop(self.client.submit, req, self._outputs.put)
        except BaseException:
            self._unfinished.discard(req.request_id)
            raise

    def abort(self, request_ids: list[str]) -> None:
        async def run() -> None:
            for rid in request_ids:
                await self.client.abort(rid)

        self.call(run())

    def step(self) -> list[RequestDelta]:
        if not self._unfinished:
            return []
        items = [self._outputs.get()]
        while True:
            try:
                items.append(self._outputs.get_nowait())
            except queue.Empty:
                break
        deltas = []
        for item in items:
            if isinstance(item, BaseException):  # the engine died: every request ends with it
                self._unfinished.clear()
                raise item
            deltas.append(item)
            if item.finished:
                self._unfinished.discard(item.request_id)
        return deltas

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def stats(self) -> SchedulerStats:
        return self.client.latest_stats or SchedulerStats()

    def shutdown(self) -> None:
        self._finalizer()


def _close(loop: asyncio.AbstractEventLoop, client: AsyncEngineClient, thread: threading.Thread) -> None:
    if loop.is_closed():
        return
    try:
        asyncio.run_coroutine_threadsafe(client.shutdown(drain=False, timeout=5.0), loop).result(30.0)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5.0)
