"""`LLM(..., multiprocess=True)`: the sync Python API over `AsyncEngineClient`.

The client runs on a background event-loop thread (which also spawns the engine processes, so
their parent-death signal is tied to a thread that lives as long as the LLM).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import GenerateRequest, RequestDelta, SamplingParams
from pagebus.frontends.engine.client import AsyncEngineClient
from pagebus.frontends.outputs import CompletionOutput, Logprob, RequestOutput

T = TypeVar("T")


class MultiprocessBackend:
    def __init__(self, cfg: EngineConfig, tokenizer_workers: int = 1) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pagebus-client", daemon=True)
        self.thread.start()
        self.client: AsyncEngineClient = self._call(
            AsyncEngineClient.start(cfg, tokenizer_workers=tokenizer_workers)
        )
        self.vocab_size = self.client.info.vocab_size
        self._finalizer = weakref.finalize(self, _close, self.loop, self.client, self.thread)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def generate(self, reqs: list[tuple[GenerateRequest, str | None]]) -> list[RequestOutput]:
        """Run every request to completion; outputs in input order."""

        async def one(req: GenerateRequest, text: str | None) -> RequestOutput:
            deltas = [d async for d in self.client.generate(req)]
            return to_request_output(req, text, deltas)

        async def run_all() -> list[RequestOutput]:
            return list(await asyncio.gather(*(one(r, t) for r, t in reqs)))

        return self._call(run_all())

    def close(self) -> None:
        self._finalizer()

    # The step-level API needs the scheduler in this process.
    def has_unfinished(self) -> bool:
        return False

    def _step_api(self, *args: Any) -> Any:
        raise NotImplementedError("the step-level API runs in-process only (multiprocess=False)")

    add = abort = step = _step_api


def _close(loop: asyncio.AbstractEventLoop, client: AsyncEngineClient, thread: threading.Thread) -> None:
    if loop.is_closed():
        return
    try:
        asyncio.run_coroutine_threadsafe(client.shutdown(drain=False, timeout=5.0), loop).result(30.0)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5.0)


def to_request_output(req: GenerateRequest, text: str | None, deltas: list[RequestDelta]) -> RequestOutput:
    """Fold a request's deltas into the RequestOutput the in-process engine returns."""
    p: SamplingParams = req.params
    samples = [CompletionOutput(index=i) for i in range(p.n)]
    if p.logprobs is not None:
        for s in samples:
            s.logprobs, s.cumulative_logprob = [], 0.0
    out = RequestOutput(req.request_id, text, list(req.prompt_token_ids or []), samples)
    for d in deltas:
        if d.prompt_token_ids is not None:
            out.prompt_token_ids = list(d.prompt_token_ids)
        out.num_cached_tokens = max(out.num_cached_tokens, d.num_cached_tokens)
        out.finished = out.finished or d.finished
        if d.error:
            out.error = d.error
        for sd in d.samples:
            s = samples[sd.index]
            s.text += sd.text_delta
            s.token_ids.extend(sd.new_token_ids)
            for lp in sd.logprobs:
                assert s.logprobs is not None
                entry = {
                    t: Logprob(v, r)
                    for r, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1)
                }
                entry[lp.token_id] = Logprob(lp.logprob, lp.rank)
                s.logprobs.append(entry)
                s.cumulative_logprob = (s.cumulative_logprob or 0.0) + lp.logprob
            if sd.finish_reason is not None:
                s.finish_reason, s.stop_reason = sd.finish_reason.value, sd.stop_reason
    if out.error:
        for s in samples:
            s.finish_reason = s.finish_reason or "error"
    return out
