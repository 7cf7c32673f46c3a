"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import re

import msgspec

# OpenAI's `type` names per status; clients (the openai package) pick their exception by status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ErrorInfo(msgspec.Struct, omit_defaults=False):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """Raised anywhere in a handler; the app turns it into the JSON body and status below."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or []

    def body(self) -> ErrorResponse:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return ErrorResponse(ErrorInfo(self.message, kind, self.param, self.code))


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# msgspec says "Expected `int`, got `str` - at `$.max_tokens`" or "Object missing required field `messages`".
_AT = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_MISSING = re.compile(r"required field `([A-Za-z_][A-Za-z0-9_]*)`")


def from_validation_error(e: msgspec.ValidationError) -> APIError:
    """A 400 whose `param` names the offending top-level field when msgspec says which."""
    msg = str(e)
    m = _AT.search(msg) or _MISSING.search(msg)
    return bad_request(msg, m.group(1) if m else None)


def from_value_error(e: ValueError) -> APIError:
    """check_sampling_params messages start with the parameter's name ("top_p must be ...")."""
    msg = str(e)
    first = msg.split(" ", 1)[0]
    return bad_request(msg, first if first.isidentifier() else None)


def delta_error(kind: str | None, message: str) -> APIError:
    """An engine-reported request error (RequestDelta.error/error_kind; the message is client-safe)."""
    if kind == "invalid_request":
        return bad_request(message)
    if kind == "engine_dead":
        return engine_dead(message)
    return APIError(500, message, code="internal_error")


def engine_dead(message: str) -> APIError:
    return APIError(503, message, code="engine_dead", headers=[(b"retry-after", b"5")])


def is_engine_dead(e: BaseException) -> bool:
    from pagebus.frontends.engine_client import EngineDeadError  # imported on error paths only (pulls zmq)

    return isinstance(e, EngineDeadError)
