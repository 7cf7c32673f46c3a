"""The batch loop: read lines, keep at most `max_inflight` of them open, write one answer per line.

Each line goes through the same `frontends.openai.handler` path as an HTTP request. A window slot is
taken before a line is read and given back when its answer is written, so in input order the
reorder buffer never holds more than `max_inflight` lines: when the oldest unfinished line blocks
the window, reading stops. The first interrupt stops intake and lets in-flight lines finish; a
second one cancels them (each still gets an error line). Engine death stops intake too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol, TypeVar

from pagebus.frontends.batch.formats import Line, Outcome, api_failure, line_failure, parse_line, success
from pagebus.frontends.engine.interface import AsyncEngine
from pagebus.frontends.openai import handler as H
from pagebus.frontends.openai.errors import APIError, ErrorCode, bad_request

logger = logging.getLogger("pagebus.batch")
T = TypeVar("T")
_READ_CHUNK = 1 << 16


class Progress(Protocol):  # what we use of tqdm
    def update(self, n: int = 1) -> Any: ...
    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...


@dataclass
class Summary:
    ok: int = 0
    failed: int = 0
    skipped: int = 0  # already answered (--resume)
    duplicates: int = 0  # lines whose custom_id an earlier line took (also counted as failed)
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    interrupted: bool = False
    engine_dead: bool = False

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def line(self) -> str:
        extra = f", {self.duplicates} with a duplicate custom_id" if self.duplicates else ""
        extra += f", {self.skipped} already answered" if self.skipped else ""
        state = " (interrupted)" if self.interrupted else " (the engine died)" if self.engine_dead else ""
        return (
            f"pagebus run-batch: {self.ok} ok, {self.failed} failed{extra}; "
            f"{self.prompt_tokens} prompt + {self.output_tokens} output tokens in {self.wall_s:.2f}s "
            f"({self.output_tok_s:.1f} output tok/s){state}"
        )


class LineReader:
    """Non-blank lines of a file descriptor, read by a daemon thread into a small bounded queue.

    A thread, because stdin may be a pipe, a tty or a regular file (which asyncio cannot watch);
    raw `os.read`, because a thread blocked in a buffered file's read would hold its lock at exit.
    """

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop, maxsize: int = 64) -> None:
        self.fd, self.loop = fd, loop
        self.queue: asyncio.Queue[tuple[int, bytes] | BaseException | None] = asyncio.Queue(maxsize)
        self.thread = threading.Thread(target=self._run, name="batch-reader", daemon=True)

    def start(self) -> None:
        self.thread.start()

    async def next(self) -> tuple[int, bytes] | None:
        """(line number, line) or None at the end of the input."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _run(self) -> None:
        try:
            for lineno, raw in enumerate(iter_lines(self.fd), 1):
                if raw.strip() and not self._put((lineno, raw)):
                    return
            self._put(None)
        except OSError as e:
            self._put(e)

    def _put(self, item: tuple[int, bytes] | BaseException | None) -> bool:
        try:  # blocks this thread while the queue is full: backpressure on reading
            asyncio.run_coroutine_threadsafe(self.queue.put(item), self.loop).result()
            return True
        except RuntimeError:  # the loop is gone
            return False


def iter_lines(fd: int) -> Any:
    """Lines of a file descriptor, each with its newline (the last one may lack it)."""
    buf = b""
    while chunk := os.read(fd, _READ_CHUNK):
        buf += chunk
        start = 0
        while (nl := buf.find(b"\n", start)) >= 0:
            yield buf[start : nl + 1]
            start = nl + 1
        buf = buf[start:]
    if buf:
        yield buf


class Runner:
    def __init__(
        self,
        client: AsyncEngine,
        ctx: H.Context,
        out: BinaryIO,
        *,
        max_inflight: int = 256,
        ordered: bool = True,
        answered: set[tuple[str, Any]] | None = None,
        progress: Progress | None = None,
    ) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        self.client, self.ctx, self.out = client, ctx, out
        self.ordered, self.answered, self.progress = ordered, answered or set(), progress
        self.window = asyncio.Semaphore(max_inflight)
        self.pending: dict[int, Outcome] = {}  # the reorder buffer: seq -> answer not yet written
        self.next_write = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.stop = asyncio.Event()
        self.summary = Summary()
        self.first_line: dict[str, int] = {}  # custom_id -> the line that took it
        self._t0 = time.monotonic()
        self._last_postfix = 0.0

    def interrupt(self) -> None:
        """First call: stop intake, let in-flight lines finish. Second: cancel them too."""
        if not self.stop.is_set():
            self.summary.interrupted = True
            self.stop.set()
            logger.warning("interrupted: no new lines; finishing %d in flight", len(self.tasks))
            return
        logger.warning("interrupted again: cancelling %d lines in flight", len(self.tasks))
        for t in self.tasks:
            t.cancel()

    async def run(self, reader: LineReader) -> Summary:
        self._t0 = time.monotonic()
        seq, form = 0, "batch"
        while not self.stop.is_set():
            if not await self._until_stop(self.window.acquire()):
                break
            item = await self._until_stop(reader.next())
            if item is None:
                self.window.release()
                break
            line = parse_line(item[1], item[0], form)  # type: ignore[arg-type]
            if line.key is not None:
                form = line.form  # unrecognisable lines are answered in the form of their neighbours
            self._check_duplicate(line)
            # A line an earlier run answered, by its key or (errors) by its line number.
            if line.resume_key in self.answered or ("line", line.lineno) in self.answered:
                self.summary.skipped += 1
                self.window.release()
                if self.progress is not None:
                    self.progress.update(1)
                continue
            self._start(seq, line)
            seq += 1
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        self.summary.wall_s = time.monotonic() - self._t0
        return self.summary

    def _check_duplicate(self, line: Line) -> None:
        """A batch line reusing an earlier line's custom_id gets an error line; the first wins."""
        if line.form != "batch" or not isinstance(line.key, str):
            return
        first = self.first_line.setdefault(line.key, line.lineno)
        if first != line.lineno and line.error is None:
            line.error = (
                ErrorCode.DUPLICATE_CUSTOM_ID,
                f"custom_id {line.key!r} was already used by line {first}; the first one wins",
            )

    def _start(self, seq: int, line: Line) -> None:
        if line.error is not None:
            duplicate = line.error[0] is ErrorCode.DUPLICATE_CUSTOM_ID
            return self._done(seq, line_failure(line, *line.error), duplicate)
        if line.api_error is not None:
            return self._done(seq, api_failure(line, line.api_error))
        task = asyncio.create_task(self._process(seq, line))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _process(self, seq: int, line: Line) -> None:
        prep: H.Prepared | None = None
        try:
            assert line.kind is not None
            prep = H.prepare(line.kind, line.body, self.ctx)
            if prep.body.stream:
                raise bad_request("stream is not supported in a batch; set stream to false", "stream")
            outcome = success(line, await H.complete(self.client, prep))
        except APIError as e:
            if e.code is ErrorCode.ENGINE_DEAD:
                self.summary.engine_dead = True
                self.stop.set()
            outcome = api_failure(line, e, prep.builder.id if prep else None)
        except asyncio.CancelledError:
            outcome = line_failure(line, ErrorCode.CANCELLED, "cancelled by an interrupt before it finished")
        except Exception:
            logger.exception("line %d failed", line.lineno)
            outcome = api_failure(line, APIError(500, "internal server error", code=ErrorCode.INTERNAL_ERROR))
        self._done(seq, outcome)

    def _done(self, seq: int, outcome: Outcome, duplicate: bool = False) -> None:
        s = self.summary
        s.duplicates += duplicate
        if outcome.ok:
            s.ok += 1
        else:
            s.failed += 1
        s.prompt_tokens += outcome.prompt_tokens
        s.output_tokens += outcome.output_tokens
        if not self.ordered:
            self._write(outcome)
        else:
            self.pending[seq] = outcome
            while self.next_write in self.pending:
                self._write(self.pending.pop(self.next_write))
                self.next_write += 1
        if self.progress is not None:
            self.progress.update(1)
            now = time.monotonic()
            if now - self._last_postfix > 0.5:
                self._last_postfix = now
                rate = s.output_tokens / max(now - self._t0, 1e-9)
                self.progress.set_postfix_str(f"{rate:.0f} out tok/s, {s.failed} failed", refresh=False)

    def _write(self, outcome: Outcome) -> None:
        self.out.write(outcome.data + b"\n")
        self.out.flush()  # a crash loses at most the line being written (--resume drops it)
        self.window.release()

    async def _until_stop(self, aw: Awaitable[T]) -> T | None:
        """`aw`'s result, or None if `stop` is set first (then `aw` is cancelled, nothing consumed)."""
        task = asyncio.ensure_future(aw)
        if not task.done():
            stopper = asyncio.ensure_future(self.stop.wait())
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        task.cancel()
        return None
