"""The client of a multi-process engine, from an asyncio loop: `AsyncEngine` (interface.py).

One reader task receives DeltaBatch frames (one per engine step) and hands each RequestDelta to
its request's consumer (an asyncio queue for `generate`, SGLang's ReqState; any callback for
`submit`). Requests are pinned to one tokenizer process by a hash of their id, so an abort
reaches the process that owns the request. Imports no torch.

    client = await AsyncEngineClient.start(EngineConfig())
    async for delta in client.generate(GenerateRequest(request_id="1", prompt="Hi", params=p)):
        ...
    await client.shutdown()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from pagebus.bus.codec import Codec
from pagebus.bus.config import EngineConfig, request_limits
from pagebus.bus.messages import (
    AbortRequest,
    DeltaBatch,
    DetokenizeRequest,
    EngineDead,
    ErrorKind,
    FromTokenizer,
    GenerateRequest,
    RequestDelta,
    SchedulerStats,
    TokenizeRequest,
    TokenizeResult,
)
from pagebus.bus.proc import StartupError
from pagebus.bus.sockets import DEFAULT_HWM
from pagebus.frontends.engine.interface import EngineDeadError, EngineInfo
from pagebus.frontends.engine.launcher import Launcher
from pagebus.frontends.model_files import model_name, resolve_model

log = logging.getLogger(__name__)

Deliver = Callable[[RequestDelta | BaseException], object]


@dataclass
class _ReqState:
    deliver: Deliver  # called on the loop thread with each delta, or the error that ends it


class AsyncEngineClient:
    def __init__(self, launcher: Launcher, info: EngineInfo, pull: zmq.asyncio.Socket) -> None:
        self.info = info
        self.latest_stats: SchedulerStats | None = None
        self.is_ready = True
        self.is_dead = False
        self.dead_reason: str | None = None
        self._launcher = launcher
        self._pull = pull
        self._codec = Codec()
        self._reqs: dict[str, _ReqState] = {}
        self._futs: dict[str, asyncio.Future[TokenizeResult]] = {}
        self._ids = itertools.count()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._teardown: asyncio.Future[Any] | None = None
        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read(), name="engine-client-reader")

    @classmethod
    async def start(
        cls, cfg: EngineConfig, *, tokenizer_workers: int = 1, startup_timeout: float = 600.0
    ) -> AsyncEngineClient:
        """Resolve the model, launch every process and wait until all are Ready."""
        t0 = time.monotonic()
        path = resolve_model(cfg.model)
        cfg = msgspec.structs.replace(cfg, model=path)
        launcher = Launcher(cfg, path, tokenizer_workers)
        actx = zmq.asyncio.Context.instance()
        pull = actx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVHWM, DEFAULT_HWM)
        pull.bind(launcher.addrs["frontend_in"])
        loop = asyncio.get_running_loop()
        try:
            launcher.start()  # on the loop's thread, which outlives the children (PDEATHSIG)
            ready = await loop.run_in_executor(None, launcher.wait_ready, startup_timeout)
            if ready.model is None:
                raise StartupError("the scheduler sent Ready without the model's facts (protocol error)")
        except BaseException:
            pull.close()
            launcher.close(timeout=2.0)
            raise
        info = EngineInfo(
            model_name=model_name(path),
            model_path=path,
            max_model_len=ready.model.max_model_len,
            vocab_size=ready.model.vocab_size,
            num_kv_blocks=ready.model.num_kv_blocks,
            startup_seconds=time.monotonic() - t0,
            startup_phases=dict(ready.model.startup_phases),
            limits=request_limits(cfg, ready.model.num_kv_blocks),
            tensor_parallel_size=cfg.tensor_parallel_size,
            pipeline_parallel_size=cfg.pipeline_parallel_size,
        )
        log.info("engine ready in %.1fs: %s", info.startup_seconds, info)
        self = cls(launcher, info, pull)
        launcher.monitor(lambda reason: loop.call_soon_threadsafe(self._mark_dead, reason))
        return self

    # ------------------------------------------------------------------ requests
    @property
    def num_unfinished(self) -> int:
        return len(self._reqs)

    def _pool(self, request_id: str) -> int:
        return zlib.crc32(request_id.encode()) % self._launcher.n_pools

    def _check_open(self) -> None:
        if self.is_dead:
            raise EngineDeadError(f"the engine stopped: {self.dead_reason}")
        if self._closing:
            raise EngineDeadError("the engine is shutting down and accepts no new requests")

    def submit(self, req: GenerateRequest, deliver: Deliver) -> None:
        """Send a request; `deliver` gets each of its deltas, or the error that ends it, on the
        loop thread. Call from the loop thread."""
        self._check_open()
        rid = req.request_id
        if rid in self._reqs:
            raise ValueError(f"request_id {rid!r} is already in flight")
        st = self._reqs[rid] = _ReqState(deliver)
        self._idle.clear()
        try:
            self._launcher.send_pool(self._pool(rid), req)
        except OverflowError as e:
            # an integer msgpack cannot carry (outside int64 / uint64), where no field's bound
            # caught it first (a JSON schema's or a tool's parameters): this request is refused,
            # as the engine refuses one that can never run, and nothing was sent
            self._forget(rid)
            msg = f"a number in the request is out of range ({e}); integers must fit in 64 bits"
            deliver(RequestDelta(rid, [], finished=True, error=msg, error_kind=ErrorKind.INVALID_REQUEST))
        except BaseException:
            if self._reqs.get(rid) is st:
                self._forget(rid)
            raise

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestDelta]:
        """Deltas of one request until it finishes. Closing the iterator early (client
        disconnect, cancellation) aborts the request in the engine."""
        rid = req.request_id
        queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self.submit(req, queue.put_nowait)
        st = self._reqs.get(rid)  # None: refused in submit, its finished delta already queued
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if self._reqs.get(rid) is st:
                self._forget(rid)
            if not finished and not self.is_dead and not self._launcher.closed:
                try:
                    self._launcher.send_pool(self._pool(rid), AbortRequest(request_ids=[rid]))
                except RuntimeError:
                    log.warning("could not abort %s", rid)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its iterator ends with a finish_reason "abort" delta."""
        if not self.is_dead and not self._launcher.closed:
            self._launcher.send_pool(self._pool(request_id), AbortRequest(request_ids=[request_id]))

    async def _ask(self, rid: str, msg: TokenizeRequest | DetokenizeRequest) -> TokenizeResult:
        self._check_open()
        fut: asyncio.Future[TokenizeResult] = self._loop.create_future()
        self._futs[rid] = fut
        try:
            self._launcher.send_pool(self._pool(rid), msg)
            return await fut
        finally:
            self._futs.pop(rid, None)

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResult:
        return await self._ask(req.request_id, req)

    async def detokenize(self, token_ids: list[int]) -> str:
        rid = f"detok-{next(self._ids)}"
        res = await self._ask(rid, DetokenizeRequest(request_id=rid, token_ids=list(token_ids)))
        if res.error is not None:
            raise ValueError(res.error)
        return res.text or ""

    # ------------------------------------------------------------------ the reader
    async def _read(self) -> None:
        dec = self._codec
        try:
            while True:
                frames = await self._pull.recv_multipart(copy=False)
                msg = dec.decode([f.buffer for f in frames], FromTokenizer)
                match msg:
                    case DeltaBatch():
                        self._dispatch(msg)
                    case TokenizeResult():
                        fut = self._futs.get(msg.request_id)
                        if fut is not None and not fut.done():
                            fut.set_result(msg)
                    case EngineDead(reason=reason):
                        self._mark_dead(reason)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a reader that cannot read is an engine we cannot use
            log.exception("engine client reader failed")
            self._mark_dead(f"the frontend lost the engine ({type(e).__name__})")

    def _dispatch(self, batch: DeltaBatch) -> None:
        if batch.stats is not None:
            self.latest_stats = batch.stats
        for d in batch.deltas:
            st = self._reqs.get(d.request_id)
            if st is None:
                continue  # aborted or abandoned here already
            st.deliver(d)
            if d.finished:
                self._forget(d.request_id)

    def _forget(self, rid: str) -> None:
        self._reqs.pop(rid, None)
        if not self._reqs:
            self._idle.set()

    def _fail_all(self, err: BaseException) -> None:
        for st in self._reqs.values():
            st.deliver(err)
        self._reqs.clear()
        self._idle.set()
        for fut in self._futs.values():
            if not fut.done():
                fut.set_exception(err)

    def _mark_dead(self, reason: str) -> None:
        """Fail every in-flight request and tear the rest of the engine down (loop thread only)."""
        if self.is_dead or self._launcher.closed:
            return
        log.error("engine dead: %s", reason)
        self.is_dead, self.is_ready, self.dead_reason = True, False, reason
        self._fail_all(EngineDeadError(f"the engine stopped: {reason}"))
        self._teardown = self._loop.run_in_executor(None, self._launcher.close, 2.0)

    # ------------------------------------------------------------------ shutdown
    async def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop intake, let in-flight requests finish (up to `timeout`), then stop every process."""
        if self._closing:
            if self._teardown is not None:
                await self._teardown
            return
        self._closing = True
        self.is_ready = False
        if drain and not self.is_dead and self._reqs:
            # Intake closes here (generate() refuses new requests), not in the scheduler: a
            # request already sent may still be in a tokenizer process, and a scheduler that
            # stopped intake (or exited when idle) would lose it. The engine keeps serving
            # until every request this client sent has finished.
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("drain timed out with %d requests in flight; aborting them", len(self._reqs))
        if self._teardown is None:
            self._teardown = self._loop.run_in_executor(None, self._launcher.close, 10.0)
        await self._teardown
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self._pull.close()

    @property
    def exit_codes(self) -> dict[str, int | None]:
        """Exit codes of the engine's processes by name, once stopped."""
        return self._launcher.exit_codes

    @property
    def pids(self) -> list[int]:
        """Every engine process id, workers included (for monitoring and tests)."""
        pids = [p.pid for p in self._launcher.procs if p.pid is not None]
        sched = self._launcher.ready.get(("scheduler", 0))
        return pids + (sched.worker_pids if sched is not None else [])
