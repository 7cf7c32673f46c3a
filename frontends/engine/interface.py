"""What a frontend needs of an engine, whichever way the engine runs.

Both engines speak the same messages: a `GenerateRequest` in (text, token ids or chat messages),
`RequestDelta`s out (what each of its samples gained, the last one `finished`).

- `Engine`, step by step: `LLM` is written once against it. `InprocEngine` runs one engine step per
  `step()`; `MultiprocEngine` returns what the engine processes produced since the last call.
- `AsyncEngine`, one async iterator per request: the HTTP server and the batch pipe are written
  against it; `AsyncEngineClient` (the multi-process engine) implements it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from pagebus.bus.config import RequestLimits
from pagebus.bus.messages import (
    GenerateRequest,
    RequestDelta,
    SchedulerStats,
    TokenizeRequest,
    TokenizeResult,
)


class EngineDeadError(RuntimeError):
    """The engine stopped; the message is safe to show a client."""


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    startup_seconds: float
    startup_phases: dict[str, float] = field(default_factory=dict)  # worker 0's, by phase
    limits: RequestLimits | None = None  # per-request bounds in force (bus.config.request_limits)
    tensor_parallel_size: int = 1  # the layout of the worker processes, for /metrics
    pipeline_parallel_size: int = 1


class Engine(Protocol):
    info: EngineInfo

    def add(self, req: GenerateRequest) -> None:
        """Queue a request; it joins the running batch at the next step. A request the engine
        refuses still gets its (finished, `error`) delta from `step()`."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """End these requests; each gets a last delta with finish_reason "abort"."""
        ...

    def step(self) -> list[RequestDelta]:
        """The deltas of requests that made progress; [] at once when nothing is unfinished."""
        ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> SchedulerStats: ...

    def shutdown(self) -> None:
        """Stop the engine; idempotent."""
        ...


class AsyncEngine(Protocol):
    info: EngineInfo
    latest_stats: SchedulerStats | None
    is_ready: bool
    is_dead: bool

    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestDelta]:
        """Deltas of one request until it finishes; closing the iterator early aborts it."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResult: ...

    async def detokenize(self, token_ids: list[int]) -> str: ...

    async def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None: ...
