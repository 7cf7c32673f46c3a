"""`pagebus serve`: start the engine, then uvicorn (uvloop + httptools) with the ASGI app.

SIGTERM/SIGINT drain: uvicorn stops accepting, /health turns 503, in-flight responses finish for up
to --drain-timeout (then uvicorn cancels them, which aborts their requests), and the engine client
shuts down. A second SIGINT forces the exit. If the engine dies, the server stops and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import logging
import signal
import socket
import sys
from collections.abc import Generator
from types import FrameType

import uvicorn
from pagebus.frontends.args import engine_config_from_args
from pagebus.frontends.http.app import App, Settings
from pagebus.frontends.http.options import api_key_from
from pagebus.frontends.tokenizer import token_text_fn

logger = logging.getLogger("pagebus.http")


class _Server(uvicorn.Server):
    """uvicorn's Server, telling the app it drains and not re-raising the signal at exit (exit 0)."""

    def __init__(self, config: uvicorn.Config, app: App, ready_line: str) -> None:
        super().__init__(config)
        self.app, self.ready_line = app, ready_line

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.ready_line, file=sys.stderr, flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.warning("signal %d: draining (up to %.0fs)", sig, self.config.timeout_graceful_shutdown)
        self.app.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def _ready_line(host: str, port: int, model: str, api_key: str | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    auth = ' -H "Authorization: Bearer $PAGEBUS_API_KEY"' if api_key else ""
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 16})
    return (
        f"pagebus: serving {model} on http://{shown}:{port}\n"
        f"  curl http://{shown}:{port}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
    )


def _version() -> str:
    try:
        return importlib.metadata.version("pagebus")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+unknown"


async def _watch_engine(client: object, server: _Server) -> None:
    # The client interface has no death callback; a 1 s poll bounds how long a dead engine is served.
    while not server.should_exit:
        if getattr(client, "is_dead", False):
            logger.error("engine died: %s; stopping the server", getattr(client, "dead_reason", None))
            server.should_exit = True
            return
        await asyncio.sleep(1.0)


async def serve(args: argparse.Namespace) -> int:
    from pagebus.frontends.engine.client import AsyncEngineClient

    cfg = engine_config_from_args(args)
    api_key = api_key_from(args)
    origins = tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip())
    client = await AsyncEngineClient.start(
        cfg, tokenizer_workers=args.tokenizer_workers, startup_timeout=args.startup_timeout
    )
    try:
        served = args.served_model_name or client.info.model_name
        settings = Settings(
            served_model_name=served,
            api_key=api_key,
            max_request_bytes=args.max_request_bytes,
            max_waiting=args.max_waiting,
            metrics_public=args.metrics_public,
            allowed_origins=origins,
            version=_version(),
        )
        app = App(client, settings, token_text_fn(client.info.model_path, cfg.tokenizer))
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            loop="none",  # we already run inside uvloop (see main)
            http="httptools",
            ws="none",
            lifespan="off",
            access_log=False,
            log_level=logging.getLogger().level,
            timeout_graceful_shutdown=int(args.drain_timeout),
            server_header=False,
        )
        server = _Server(config, app, _ready_line(args.host, args.port, served, api_key))
        watcher = asyncio.create_task(_watch_engine(client, server))
        await server.serve()
        watcher.cancel()
        if not server.started:
            return 1  # e.g. the port is taken; uvicorn logged why
        return 1 if client.is_dead else 0
    finally:
        await client.shutdown(drain=True, timeout=args.drain_timeout)


def main(args: argparse.Namespace) -> int:
    import uvloop

    return uvloop.run(serve(args))
