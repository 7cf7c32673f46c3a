"""Batch input lines and output lines: the OpenAI Batch format and a short form.

OpenAI Batch:  {"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body"}
            -> {"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}
Short form:    {"prompt": ...} or {"messages": [...]}, sampling fields as in the HTTP bodies, optional "id"
            -> {"id", "text" | "message", "finish_reason", "usage"} or {"id", "error"}

A failure with an HTTP meaning (what the server would answer with a 4xx/5xx) is a response with that
status and the OpenAI error body; only lines that are not requests at all (not JSON, no custom_id,
unknown url or method) get the top-level `error`. Every error message starts with "line N: ".
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from pagebus.frontends.openai.errors import (
    RETRYABLE_CODES,
    APIError,
    ErrorCode,
    ErrorInfo,
    ErrorResponse,
    bad_request,
)
from pagebus.frontends.openai.handler import Kind
from pagebus.frontends.openai.protocol import Response

Form = Literal["batch", "short"]
URLS: dict[str, Kind] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
_encoder = msgspec.json.Encoder()
_LINE = re.compile(r"^line (\d+): ")


class _Envelope(msgspec.Struct):
    """Both forms' top-level keys; UNSET / an empty Raw tell an absent key from a null one."""

    custom_id: Any = msgspec.UNSET
    method: Any = msgspec.UNSET
    url: Any = msgspec.UNSET
    body: msgspec.Raw = msgspec.Raw()
    id: Any = msgspec.UNSET
    prompt: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()


@dataclass
class Line:
    """One input line, recognised but not yet validated as a request body."""

    lineno: int
    form: Form
    key: str | int | None  # custom_id (batch), id or line number (short); None if unknown
    kind: Kind | None = None
    body: bytes = b""
    error: tuple[ErrorCode, str] | None = None  # (code, message): no HTTP meaning, top-level error
    api_error: APIError | None = None  # refused before validation, with an HTTP meaning

    @property
    def resume_key(self) -> tuple[str, Any]:
        if self.key is None:
            return ("line", self.lineno)
        return ("custom_id" if self.form == "batch" else "id", self.key)


def parse_line(raw: bytes, lineno: int, default_form: Form = "batch") -> Line:
    """Recognise a line's form and key; never raises (a bad line becomes a Line with an error)."""
    try:
        env = msgspec.json.decode(raw, type=_Envelope)
    except msgspec.ValidationError as e:
        return Line(lineno, default_form, None, error=(ErrorCode.INVALID_LINE, f"not a JSON object: {e}"))
    except msgspec.DecodeError as e:
        return Line(lineno, default_form, None, error=(ErrorCode.INVALID_JSON, f"not valid JSON: {e}"))
    batch = any(v is not msgspec.UNSET for v in (env.custom_id, env.method, env.url)) or len(env.body) > 0
    if batch:
        if env.custom_id is msgspec.UNSET or not isinstance(env.custom_id, str):
            return Line(
                lineno, "batch", None, error=(ErrorCode.MISSING_CUSTOM_ID, "custom_id must be a string")
            )
        line = Line(lineno, "batch", env.custom_id)
        if env.method != "POST":
            line.error = (ErrorCode.INVALID_METHOD, f"method must be POST, not {env.method!r}")
        elif env.url not in URLS:
            line.error = (ErrorCode.INVALID_URL, f"url must be one of {sorted(URLS)}, not {env.url!r}")
        else:
            line.kind, line.body = URLS[env.url], bytes(env.body)
        return line
    has_prompt, has_messages = len(env.prompt) > 0, len(env.messages) > 0
    if not (has_prompt or has_messages):
        msg = "neither a batch request (custom_id, method, url, body) nor a short one (prompt or messages)"
        return Line(lineno, default_form, None, error=(ErrorCode.INVALID_LINE, msg))
    key = env.id
    if key is msgspec.UNSET or key is None:
        key = lineno
    elif not isinstance(key, str | int) or isinstance(key, bool):
        return Line(lineno, "short", None, error=(ErrorCode.INVALID_ID, "id must be a string or an integer"))
    line = Line(lineno, "short", key, kind="chat" if has_messages else "completion", body=raw)
    if has_prompt and has_messages:
        line.api_error = bad_request("give exactly one of prompt and messages", "prompt")
    return line


# ------------------------------------------------------------------------------------ output
@dataclass
class Outcome:
    data: bytes  # one JSON line, without the newline
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0


def _batch_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def success(line: Line, resp: Response) -> Outcome:
    usage = resp.usage
    p, c = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
    if line.form == "batch":
        out: dict[str, Any] = {
            "id": _batch_id(),
            "custom_id": line.key,
            "response": {"status_code": 200, "request_id": resp.id, "body": resp},
            "error": None,
        }
    else:
        out = {"id": line.key}
        field = "message" if line.kind == "chat" else "text"
        if len(resp.choices) == 1:
            ch = resp.choices[0]
            out[field] = ch.message if line.kind == "chat" else ch.text
            out["finish_reason"] = ch.finish_reason
        else:
            out["choices"] = [
                {field: ch.message if line.kind == "chat" else ch.text, "finish_reason": ch.finish_reason}
                for ch in resp.choices
            ]
        out["usage"] = usage
    return Outcome(_encoder.encode(out), True, p, c)


def api_failure(line: Line, e: APIError, request_id: str | None = None) -> Outcome:
    """What the HTTP server would have answered (status + OpenAI error body), with the line number."""
    info = e.body().error
    info = ErrorInfo(f"line {line.lineno}: {info.message}", info.type, info.param, info.code)
    if line.form == "batch":
        response = {
            "status_code": e.status,
            "request_id": request_id or f"req_{uuid.uuid4().hex}",
            "body": ErrorResponse(info),
        }
        out: dict[str, Any] = {"id": _batch_id(), "custom_id": line.key, "response": response, "error": None}
    else:
        err = msgspec.structs.asdict(info) | {"status_code": e.status}
        out = {"id": line.key, "error": err}
    return Outcome(_encoder.encode(out), False)


def line_failure(line: Line, code: ErrorCode, message: str) -> Outcome:
    """A line that is not a request: the top-level error, no response."""
    err = {"code": code, "message": f"line {line.lineno}: {message}"}
    if line.form == "batch":
        out: dict[str, Any] = {"id": _batch_id(), "custom_id": line.key, "response": None, "error": err}
    else:
        out = {"id": line.key if line.key is not None else line.lineno, "error": err}
    return Outcome(_encoder.encode(out), False)


def answered_keys(out_line: bytes) -> list[tuple[str, Any]]:
    """The resume keys an output line answers; none if unreadable or worth retrying (5xx, cancelled)."""
    try:
        obj = msgspec.json.decode(out_line)
    except msgspec.DecodeError:
        return []
    if not isinstance(obj, dict):
        return []
    resp, err = obj.get("response"), obj.get("error")
    status = resp.get("status_code", 0) if isinstance(resp, dict) else 0
    if isinstance(err, dict):
        status = err.get("status_code", status)
        if err.get("code") in RETRYABLE_CODES:
            return []
    if isinstance(status, int) and status >= 500:
        return []
    keys: list[tuple[str, Any]] = []
    if isinstance(err, dict) and err.get("code") == ErrorCode.DUPLICATE_CUSTOM_ID:
        pass  # answers its own line only: the custom_id belongs to the first line that used it
    elif "custom_id" in obj:
        if obj["custom_id"] is not None:
            keys.append(("custom_id", obj["custom_id"]))
    elif obj.get("id") is not None:
        keys.append(("id", obj["id"]))
    message = ""
    if isinstance(err, dict):
        message = str(err.get("message", ""))
    elif isinstance(resp, dict) and isinstance(resp.get("body"), dict):
        message = str((resp["body"].get("error") or {}).get("message", ""))
    m = _LINE.match(message)
    if m:
        keys.append(("line", int(m.group(1))))
    return keys
