"""`pagebus serve`: start the engine, then uvicorn (uvloop + httptools) with the ASGI app.

SIGTERM/SIGINT drain: uvicorn stops accepting, /health turns 503, in-flight responses finish for up
to --drain-timeout (then uvicorn cancels them, which aborts their requests), and the engine client
shuts down. A second SIGINT forces the exit. If the engine dies, the server stops and exits 1.

Under systemd (Type=notify): STATUS= through start-up, READY=1 once every engine process is Ready
and the port is bound, WATCHDOG=1 while the engine makes progress (frontends/service/supervisor),
STOPPING=1 when draining starts. SIGHUP reloads the API key file, the log level and the stats
interval (RELOADING=1, then READY=1) without touching the engine or in-flight requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import signal
import socket
import time
from collections.abc import Callable, Generator
from types import FrameType

import psutil
import uvicorn
from pagebus.bus.config import EngineConfig
from pagebus.bus.logs import set_secrets
from pagebus.frontends.args import engine_config_from_args
from pagebus.frontends.engine.interface import EngineInfo
from pagebus.frontends.http.app import App, Settings
from pagebus.frontends.http.options import api_key_from
from pagebus.frontends.service.notify import Notifier
from pagebus.frontends.service.supervisor import Supervisor
from pagebus.frontends.tokenizer import token_text_fn

logger = logging.getLogger("pagebus.http")


class _Server(uvicorn.Server):
    """uvicorn's Server, telling the app (and systemd) it drains and not re-raising the signal at
    exit (exit 0); SIGHUP calls `on_reload` on the loop."""

    def __init__(
        self,
        config: uvicorn.Config,
        app: App,
        ready_line: str,
        notifier: Notifier,
        supervisor: Supervisor,
        on_reload: Callable[[], None],
    ) -> None:
        super().__init__(config)
        self.app, self.ready_line, self.notifier = app, ready_line, notifier
        self.supervisor, self.on_reload = supervisor, on_reload

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # the port is bound and listening: now, and only now, READY=1
            logger.info("%s", self.ready_line)
            self.notifier.ready(f"serving {self.app.settings.served_model_name}: idle")
            self.supervisor.pinging = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.warning("signal %d: draining (up to %.0fs)", sig, self.config.timeout_graceful_shutdown)
            self.notifier.stopping("draining in-flight requests")
        self.app.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        loop = asyncio.get_running_loop()

        def hangup(sig: int, frame: FrameType | None) -> None:
            # A signal handler runs between any two bytecodes of the loop: only hand over here.
            loop.call_soon_threadsafe(self.on_reload)

        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        old[signal.SIGHUP] = signal.signal(signal.SIGHUP, hangup)
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
            reason = getattr(client, "dead_reason", None)
            logger.error("engine died: %s; stopping the server", reason)
            server.notifier.status(f"engine died: {reason}; exiting non-zero")
            server.should_exit = True
            return
        await asyncio.sleep(1.0)


def startup_report(info: EngineInfo, cfg: EngineConfig, frontend_s: float) -> list[str]:
    """The start-up lines: time to Ready by phase, and the KV cache's size in tokens with the
    maximum concurrency at max_model_len (as vLLM reports it)."""
    ph = info.startup_phases
    worker = sum(ph.values())
    parts = [f"frontend imports {frontend_s:.1f}s"]
    parts += [
        f"{k.replace('_', ' ')} {ph[k]:.1f}s" for k in ("imports", "weights", "kv_cache", "warmup") if k in ph
    ]
    parts.append(f"processes and handshakes {max(0.0, info.startup_seconds - worker):.1f}s")
    tokens = (info.num_kv_blocks - 1) * cfg.block_size  # block 0 is never handed out
    return [
        f"start-up: engine Ready {frontend_s + info.startup_seconds:.1f}s after launch: " + ", ".join(parts),
        f"KV cache: {info.num_kv_blocks} blocks of {cfg.block_size} tokens, {tokens:,} tokens; "
        f"Maximum concurrency for {info.max_model_len:,} tokens per request: "
        f"{tokens / info.max_model_len:.2f}x",
    ]


def _since_launch() -> float:
    """Seconds since this process started (interpreter start-up and imports included)."""
    return max(0.0, time.time() - psutil.Process().create_time())


class _Reloader:
    """SIGHUP: re-read the API key file, the log level and the stats interval (from --config and
    the flags again, same precedence), then READY=1. Anything that fails keeps the old values."""

    def __init__(
        self,
        app: App,
        supervisor: Supervisor,
        notifier: Notifier,
        reparse: Callable[[], argparse.Namespace] | None,
    ) -> None:
        self.app, self.supervisor, self.notifier, self.reparse = app, supervisor, notifier, reparse

    def __call__(self) -> None:
        self.notifier.reloading()
        status = "reloaded"
        try:
            if self.reparse is None:
                raise RuntimeError("this server was not started from the command line")
            new = self.reparse()
            key = api_key_from(new)
            level = new.log_level.upper()
            logging.getLogger().setLevel(level)
            self.supervisor.reset_stats_interval(new.stats_interval)
            set_secrets([key] if key else [])
            self.app.settings = dataclasses.replace(self.app.settings, api_key=key)
            logger.info(
                "reloaded: API key %s, log level %s, stats interval %gs",
                "set" if key else "off", level, new.stats_interval,
            )  # fmt: skip
        except (Exception, SystemExit) as e:  # argparse exits on a bad value; keep serving
            status = f"reload failed, kept the old configuration: {e}"
            logger.error("%s", status)
        self.notifier.ready(f"serving {self.app.settings.served_model_name}: {status}")


async def serve(args: argparse.Namespace, reparse: Callable[[], argparse.Namespace] | None = None) -> int:
    from pagebus.frontends.engine.client import AsyncEngineClient

    launched = _since_launch()
    notifier = Notifier()
    cfg = engine_config_from_args(args)
    api_key = api_key_from(args)
    set_secrets([api_key] if api_key else [])
    origins = tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip())
    notifier.status("starting the engine: loading weights, sizing the KV cache")
    client = await AsyncEngineClient.start(
        cfg, tokenizer_workers=args.tokenizer_workers, startup_timeout=args.startup_timeout
    )
    try:
        report = startup_report(client.info, cfg, launched)
        for line in report:
            logger.info("%s", line)
        notifier.status(f"{report[1]}; binding {args.host}:{args.port}")
        served = args.served_model_name or client.info.model_name
        settings = Settings(
            served_model_name=served,
            api_key=api_key,
            max_request_bytes=args.max_request_bytes,
            max_waiting=args.max_waiting,
            metrics_public=args.metrics_public,
            allowed_origins=origins,
            version=_version(),
            log_requests=args.log_requests,
            health_probe_timeout=args.health_probe_timeout,
        )
        app = App(client, settings, token_text_fn(client.info.model_path, cfg.tokenizer))
        supervisor = Supervisor(
            lambda: client.latest_stats,
            lambda: client.num_unfinished > 0,
            notifier,
            app.metrics.registry,
            stall_timeout=args.stall_timeout,
            stats_interval=args.stats_interval,
        )
        app.stall_reason = supervisor.stall_reason
        app.is_busy = lambda: client.num_unfinished > 0
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            loop="none",  # we already run inside uvloop (see main)
            http="httptools",
            ws="none",
            lifespan="off",
            access_log=False,
            log_config=None,  # uvicorn's lines go through our handlers (text or JSON)
            log_level=None,
            timeout_graceful_shutdown=int(args.drain_timeout),
            server_header=False,
        )
        ready_line = _ready_line(args.host, args.port, served, api_key)
        reload = _Reloader(app, supervisor, notifier, reparse)
        server = _Server(config, app, ready_line, notifier, supervisor, reload)
        watcher = asyncio.create_task(_watch_engine(client, server))
        ticker = asyncio.create_task(supervisor.run(lambda: server.should_exit))
        await server.serve()
        watcher.cancel()
        ticker.cancel()
        if not server.started:
            return 1  # e.g. the port is taken; uvicorn logged why
        return 1 if client.is_dead else 0
    finally:
        notifier.stopping("stopping the engine")
        await client.shutdown(drain=True, timeout=args.drain_timeout)
        notifier.close()


def main(args: argparse.Namespace, reparse: Callable[[], argparse.Namespace] | None = None) -> int:
    import uvloop

    return uvloop.run(serve(args, reparse))
