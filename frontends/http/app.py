"""The ASGI app: a route table over raw ASGI (uvicorn parses HTTP), msgspec for JSON in and out.

Every handler either sends a response or raises `APIError`; `App.__call__` turns errors into
OpenAI error bodies, and anything unexpected into a generic 500 (the traceback stays in the log).
Generation runs beside a watcher on `receive()`: when the client disconnects, the generation task is
cancelled, which closes the engine client's delta iterator and so aborts the request in the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec
from pagebus.bus.logs import request_id_var
from pagebus.bus.messages import (
    GenerateRequest,
    SamplingParams,
    TokenizeRequest,
)
from pagebus.frontends.engine.interface import AsyncEngine
from pagebus.frontends.http.asgi import (
    JSON_HEADERS,
    ClientGone,
    Receive,
    Request,
    Scope,
    Send,
    until_disconnect,
)
from pagebus.frontends.http.auth import bearer_ok
from pagebus.frontends.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pagebus.frontends.http.metrics import Metrics, RequestTimer
from pagebus.frontends.http.openapi import openapi_spec
from pagebus.frontends.openai import handler as H
from pagebus.frontends.openai import protocol as P
from pagebus.frontends.openai.errors import APIError, ErrorCode, bad_request, engine_dead, is_engine_dead
from pagebus.frontends.openai.streaming import DONE, SSE_HEADERS, ResponseBuilder, sse

logger = logging.getLogger("pagebus.http")
_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class Settings:
    served_model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_waiting: int | None = None  # refuse when more than this many admitted requests await a first token
    metrics_public: bool = False
    allowed_origins: tuple[str, ...] = ()
    version: str = "0.1.0"
    log_requests: bool = False  # prompts and outputs appear in the log only when set
    health_probe_timeout: float = 30.0  # seconds for /health?probe=generate's one token


class _Admission:
    """Counts a request as waiting from admission until its first delta (or its end)."""

    def __init__(self, app: App) -> None:
        self.app, self.waiting = app, True
        app.num_waiting += 1

    def release(self) -> None:
        if self.waiting:
            self.waiting = False
            self.app.num_waiting -= 1


class App:
    def __init__(
        self, client: AsyncEngine, settings: Settings, token_text: Callable[[int], str] = str
    ) -> None:
        self.client, self.settings, self.token_text = client, settings, token_text
        info = client.info
        self.metrics = Metrics(
            lambda: client.latest_stats, info.tensor_parallel_size, info.pipeline_parallel_size
        )
        self.num_waiting = 0
        self.draining = False  # set by the server on SIGTERM: /health turns 503, new work is refused
        # Set by the server: why the engine counts as stalled (None: it is not), and whether
        # requests are in flight (a busy, progressing engine needs no health probe).
        self.stall_reason: Callable[[], str | None] = lambda: None
        self.is_busy: Callable[[], bool] = lambda: False
        Route = Callable[[Request], Coroutine[Any, Any, None]]
        self.routes: dict[str, dict[str, Route]] = {
            "/v1/completions": {"POST": self.completions},
            "/v1/chat/completions": {"POST": self.chat_completions},
            "/v1/models": {"GET": self.models},
            "/health": {"GET": self.health},
            "/version": {"GET": self.version},
            "/metrics": {"GET": self.metrics_route},
            "/tokenize": {"POST": self.tokenize},
            "/detokenize": {"POST": self.detokenize},
            "/openapi.json": {"GET": self.openapi},
        }
        self.public = {"/health"} | ({"/metrics"} if settings.metrics_public else set())

    # ------------------------------------------------------------------ dispatch
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # uvicorn runs with lifespan off; websockets are not served
        req = Request(scope, receive, self._cors(scope, send), self.settings.max_request_bytes)
        try:
            await self._dispatch(req)
        except ClientGone:
            pass
        except APIError as e:
            await self._error(req, e)
        except Exception as e:
            if is_engine_dead(e):
                return await self._error(req, engine_dead(str(e)))
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            await self._error(req, APIError(500, "internal server error", code=ErrorCode.INTERNAL_ERROR))

    async def _dispatch(self, req: Request) -> None:
        path, method = req.scope["path"], req.scope["method"]
        if method == "OPTIONS" and self.settings.allowed_origins and b"origin" in req.headers:
            return await self._preflight(req)
        methods = self.routes.get(path)
        if methods is None:
            raise APIError(404, f"route {path} not found", code=ErrorCode.NOT_FOUND)
        if method not in methods:
            allow = ", ".join(methods).encode()
            raise APIError(405, f"method {method} not allowed on {path}", headers=[(b"allow", allow)])
        key = self.settings.api_key
        if (
            key is not None
            and path not in self.public
            and not bearer_ok(req.headers.get(b"authorization"), key)
        ):
            raise APIError(401, "invalid or missing API key", code=ErrorCode.INVALID_API_KEY)
        await methods[method](req)

    async def _error(self, req: Request, e: APIError) -> None:
        if req.started:  # too late for a status; the stream already carries an error event
            return
        with contextlib.suppress(Exception):
            await req.respond(e.status, _json.encode(e.body()), JSON_HEADERS + e.headers)

    def _cors(self, scope: Scope, send: Send) -> Send:
        origins = self.settings.allowed_origins
        origin = dict(scope.get("headers", [])).get(b"origin")
        if not origins or origin is None or ("*" not in origins and origin.decode("latin-1") not in origins):
            return send

        async def cors_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                allow = b"*" if "*" in origins else origin
                message["headers"] = [*message.get("headers", []), (b"access-control-allow-origin", allow)]
                message["headers"].append((b"vary", b"Origin"))
            await send(message)

        return cors_send

    async def _preflight(self, req: Request) -> None:
        asked = req.headers.get(b"access-control-request-headers", b"authorization, content-type")
        headers = [
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", asked),
            (b"access-control-max-age", b"600"),
        ]
        await req.respond(204, b"", headers)

    # ------------------------------------------------------------------ simple routes
    async def health(self, req: Request) -> None:
        """200 while the engine serves; 503 with {"status", "reason"} when it does not. With
        `?probe=generate`, an idle engine also runs one token through the whole path (SGLang's
        /health_generate); a busy one that makes progress has just proved it."""
        reason = self._unhealthy()
        probe = b"probe=generate" in req.scope.get("query_string", b"").split(b"&")
        if reason is None and probe and not self.is_busy():
            reason = await self._probe()
        if reason is not None:
            return await req.respond(
                503, _json.encode({"status": "unhealthy", "reason": reason}), JSON_HEADERS
            )
        await req.respond(200, b"")

    def _unhealthy(self) -> str | None:
        if self.draining:
            return "the server is draining (shutting down)"
        if self.client.is_dead:
            return f"the engine stopped: {getattr(self.client, 'dead_reason', None)}"
        if not self.client.is_ready:
            return "the engine is not ready"
        return self.stall_reason()

    async def _probe(self) -> str | None:
        gen = GenerateRequest(
            request_id=f"health-{uuid.uuid4().hex}",
            prompt="Hi",
            params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        )
        timeout = self.settings.health_probe_timeout

        async def one_token() -> str | None:
            async for delta in self.client.generate(gen):
                if delta.error:
                    return f"health probe failed: {delta.error}"
                if delta.finished:
                    return None
            return "health probe ended without a token"

        try:
            return await asyncio.wait_for(one_token(), timeout)
        except asyncio.TimeoutError:
            return f"health probe: no token within {timeout:g}s"
        except Exception as e:
            return f"health probe failed: {type(e).__name__}: {e}"

    async def version(self, req: Request) -> None:
        await req.json({"version": self.settings.version})

    async def models(self, req: Request) -> None:
        info = self.client.info
        card = {
            "id": self.settings.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pagebus",
            "root": info.model_path,
            "max_model_len": info.max_model_len,
        }
        await req.json({"object": "list", "data": [card]})

    async def metrics_route(self, req: Request) -> None:
        await req.respond(200, self.metrics.render(), [(b"content-type", METRICS_CONTENT_TYPE)])

    async def openapi(self, req: Request) -> None:
        await req.json(openapi_spec(self.settings.version))

    async def tokenize(self, req: Request) -> None:
        body: P.TokenizeBody = P.decode_body(await req.body(), P.TokenizeBody)
        P.check_model(body.model, self.settings.served_model_name)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        self._check_alive()
        res = await self.client.tokenize(
            TokenizeRequest(
                request_id=f"tok-{uuid.uuid4().hex}",
                prompt=body.prompt,
                messages=P.chat_messages(body.messages) if body.messages is not None else None,
                add_special_tokens=body.add_special_tokens,
                add_generation_prompt=body.add_generation_prompt,
            )
        )
        if res.error:
            raise bad_request(res.error)
        info = self.client.info
        await req.json(
            {"count": len(res.token_ids), "max_model_len": info.max_model_len, "tokens": res.token_ids}
        )

    async def detokenize(self, req: Request) -> None:
        body: P.DetokenizeBody = P.decode_body(await req.body(), P.DetokenizeBody)
        P.check_model(body.model, self.settings.served_model_name)
        vocab = self.client.info.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids {bad[:8]} are outside the vocabulary (size {vocab})", "tokens")
        self._check_alive()
        try:
            text = await self.client.detokenize(body.tokens)
        except ValueError as e:
            raise bad_request(str(e), "tokens") from None
        await req.json({"prompt": text})

    # ------------------------------------------------------------------ generation
    async def completions(self, req: Request) -> None:
        await self._generate(req, H.prepare("completion", await req.body(), self._context()))

    async def chat_completions(self, req: Request) -> None:
        await self._generate(req, H.prepare("chat", await req.body(), self._context()))

    def _context(self) -> H.Context:
        info = self.client.info
        return H.Context(
            self.settings.served_model_name, info.vocab_size, self.token_text, info.limits, info.max_model_len
        )

    def _check_alive(self) -> None:
        if self.client.is_dead or self.draining:
            reason = "the engine is shutting down" if self.draining else "the engine is not running"
            raise APIError(503, reason, code=ErrorCode.ENGINE_UNAVAILABLE, headers=[(b"retry-after", b"5")])

    def _admit(self) -> _Admission:
        self._check_alive()
        limit = self.settings.max_waiting
        if limit is not None and self.num_waiting > limit:
            raise APIError(
                429,
                f"too many requests waiting ({self.num_waiting} > {limit}); retry later",
                code=ErrorCode.TOO_MANY_WAITING,
                headers=[(b"retry-after", b"1")],
            )
        return _Admission(self)

    async def _generate(self, req: Request, prep: H.Prepared) -> None:
        admission = self._admit()
        token = request_id_var.set(prep.builder.id)  # every log line of this request carries its id
        started = time.monotonic()
        self._log_start(prep)
        try:
            await until_disconnect(self._produce(req, prep, admission), req.receive)
        finally:
            admission.release()
            self._log_end(prep, time.monotonic() - started)
            request_id_var.reset(token)

    def _log_start(self, prep: H.Prepared) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        b = prep.body
        extra: dict[str, Any] = {"kind": prep.kind, "stream": b.stream, "max_tokens": b.max_tokens}
        if self.settings.log_requests:  # request contents only on request
            extra["prompts"] = [
                g.prompt if g.prompt is not None else msgspec.to_builtins(g.messages or g.prompt_token_ids)
                for g in prep.gens
            ]
        shown = f", prompts {extra['prompts']!r}" if "prompts" in extra else ""
        logger.info(
            "request received: %s, %d prompt(s), stream %s%s", prep.kind, len(prep.gens), b.stream, shown,
            extra=extra,
        )  # fmt: skip

    def _log_end(self, prep: H.Prepared, seconds: float) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        bld = prep.builder
        reasons = [c.finish_reason for c in bld.choices]
        extra: dict[str, Any] = {
            "finish_reasons": reasons,
            "prompt_tokens": sum(p.num_tokens for p in bld.prompts),
            "completion_tokens": sum(c.num_tokens for c in bld.choices),
            "seconds": round(seconds, 4),
        }
        if self.settings.log_requests:
            extra["outputs"] = ["".join(c.text) for c in bld.choices]
        shown = f", outputs {extra['outputs']!r}" if "outputs" in extra else ""
        logger.info(
            "request finished: %s, %d prompt + %d completion tokens, %.3fs%s",
            reasons, extra["prompt_tokens"], extra["completion_tokens"], seconds, shown, extra=extra,
        )  # fmt: skip

    async def _produce(self, req: Request, prep: H.Prepared, admission: _Admission) -> None:
        builder, body = prep.builder, prep.body
        arrival = time.monotonic()
        timers = [RequestTimer(self.metrics, arrival) for _ in prep.gens]
        try:
            async for i, delta, choices in H.run(self.client, prep):
                admission.release()
                now = time.monotonic()
                timers[i].on_delta(now, sum(len(s.new_token_ids) for s in delta.samples))
                if delta.finished:
                    reasons = [builder.choices[i * builder.n + k].finish_reason for k in range(builder.n)]
                    timers[i].on_finish(now, builder.prompts[i].num_tokens, reasons)
                if body.stream:
                    await self._stream_chunk(req, builder, choices)
        except Exception as e:
            if not (body.stream and req.started):
                raise
            err = e
            if not isinstance(err, APIError):
                logger.exception("stream %s failed", builder.id)
                err = APIError(500, "internal server error", code=ErrorCode.INTERNAL_ERROR)
            # Headers are gone: report in-band as OpenAI-compatible servers do, then end the stream.
            await req.send({"type": "http.response.body", "body": sse(err.body()), "more_body": True})
            await req.send({"type": "http.response.body", "body": DONE})
            return
        if not body.stream:
            return await req.json(builder.final())
        await self._stream_chunk(req, builder, [])  # opens the stream if no delta carried text
        tail = (
            sse(builder.usage_chunk()) if body.stream_options and body.stream_options.include_usage else b""
        )
        await req.send({"type": "http.response.body", "body": tail + DONE})

    async def _stream_chunk(self, req: Request, builder: ResponseBuilder, choices: list[Any]) -> None:
        """Send headers on the first delta (so early errors keep their status), then the chunk."""
        out = b""
        if not req.started:
            await req.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            if builder.kind == "chat":
                out += sse(builder.role_chunk())
        if choices:
            out += sse(builder.chunk(choices))
        if out:
            await req.send({"type": "http.response.body", "body": out, "more_body": True})


# ---------------------------------------------------------------------- async helpers
