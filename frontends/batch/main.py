"""`pagebus run-batch`: JSONL requests in (a file or stdin), one JSONL answer per request out.

    pagebus run-batch -i requests.jsonl -o results.jsonl [--max-inflight 256] [--unordered] [--resume]
    cat requests.jsonl | pagebus run-batch --quiet > results.jsonl

Exit codes: 0 every line succeeded, 1 some line failed (or the engine died), 2 usage error,
130 interrupted (SIGINT/SIGTERM; in-flight lines are finished first, rerun with --resume).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from typing import Any, BinaryIO

from pagebus.frontends.batch.resume import count_lines, load_answered

logger = logging.getLogger("pagebus.batch")
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_batch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch")
    g.add_argument("-i", "--input", default="-", help="JSONL requests; - for stdin (default)")
    g.add_argument("-o", "--output", default="-", help="JSONL results; - for stdout (default)")
    g.add_argument("--max-inflight", type=int, default=256, help="most lines open at once (default: 256)")
    g.add_argument("--unordered", action="store_true", help="write each answer as it completes")
    g.add_argument("--resume", action="store_true", help="skip lines the output file already answers")
    g.add_argument("--quiet", action="store_true", help="no progress bar and no summary on stderr")
    g.add_argument("--served-model-name", default=None, help="the model id bodies may name")
    g.add_argument("--tokenizer-workers", type=int, default=1)
    g.add_argument("--startup-timeout", type=float, default=600.0)


def _open_input(path: str) -> int:
    if path == "-":
        return sys.stdin.fileno()
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ValueError(f"cannot read input {path!r}: {e.strerror}") from None


def _open_output(args: argparse.Namespace) -> BinaryIO:
    if args.output == "-":
        if args.resume:
            raise ValueError("--resume needs an output file (-o FILE), not stdout")
        return sys.stdout.buffer
    try:
        return open(args.output, "ab" if args.resume else "wb")
    except OSError as e:
        raise ValueError(f"cannot write output {args.output!r}: {e.strerror}") from None


def _progress(args: argparse.Namespace) -> Any:
    if args.quiet or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    total = count_lines(args.input) if args.input != "-" and os.path.isfile(args.input) else None
    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)


async def _run(args: argparse.Namespace, fd: int, out: BinaryIO, answered: set[Any]) -> int:
    from pagebus.frontends.args import engine_config_from_args
    from pagebus.frontends.batch.runner import LineReader, Runner
    from pagebus.frontends.engine.client import AsyncEngineClient
    from pagebus.frontends.openai.handler import Context
    from pagebus.frontends.tokenizer import token_text_fn

    cfg = engine_config_from_args(args)
    client = await AsyncEngineClient.start(
        cfg, tokenizer_workers=args.tokenizer_workers, startup_timeout=args.startup_timeout
    )
    progress = _progress(args)
    try:
        info = client.info
        ctx = Context(
            args.served_model_name or info.model_name,
            info.vocab_size,
            token_text_fn(info.model_path, cfg.tokenizer),
            info.limits,
            info.max_model_len,
        )
        loop = asyncio.get_running_loop()
        runner = Runner(
            client,
            ctx,
            out,
            max_inflight=args.max_inflight,
            ordered=not args.unordered,
            answered=answered,
            progress=progress,
        )
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, runner.interrupt)
        reader = LineReader(fd, loop)
        reader.start()
        summary = await runner.run(reader)
    finally:
        if progress is not None:
            progress.close()
        await client.shutdown(drain=False, timeout=5.0)  # every line is answered by now
    if not args.quiet:
        print(summary.line(), file=sys.stderr, flush=True)
    if summary.interrupted:
        return EXIT_INTERRUPTED
    if summary.engine_dead:
        print("pagebus run-batch: the engine died; rerun with --resume for the rest", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_FAILED if summary.failed else EXIT_OK


def main(args: argparse.Namespace) -> int:
    """Usage errors raise ValueError (the CLI prints it and exits 2) before the engine starts."""
    if args.max_inflight < 1:
        raise ValueError("--max-inflight must be at least 1")
    fd = _open_input(args.input)
    answered = load_answered(args.output) if args.resume and args.output != "-" else set()
    out = _open_output(args)
    import uvloop

    try:
        code = uvloop.run(_run(args, fd, out, answered))
    finally:
        out.flush()
        if out is not sys.stdout.buffer:
            out.close()
    if any(t.name == "batch-reader" and t.is_alive() for t in threading.enumerate()):
        # Interrupted while the reader blocks in read() on an open stdin: do not wait for it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
