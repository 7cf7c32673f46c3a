"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import enum
import re

import msgspec
from pagebus.bus.messages import ErrorKind
from pagebus.bus.validation import ParamError
from pagebus.frontends.engine.interface import EngineDeadError

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


class ErrorCode(str, enum.Enum):
    """`error.code` of HTTP error bodies and of batch error lines (clients and --resume read it)."""

    NOT_FOUND = "not_found"
    MODEL_NOT_FOUND = "model_not_found"
    INVALID_API_KEY = "invalid_api_key"
    REQUEST_TOO_LARGE = "request_too_large"
    TOO_MANY_WAITING = "too_many_waiting"
    ENGINE_UNAVAILABLE = "engine_unavailable"  # shutting down or not running: refused up front
    ENGINE_DEAD = "engine_dead"  # the engine stopped under the request
    INTERNAL_ERROR = "internal_error"
    # Batch lines that are not requests at all, and lines an interrupt cut short.
    INVALID_LINE = "invalid_line"
    INVALID_JSON = "invalid_json"
    MISSING_CUSTOM_ID = "missing_custom_id"
    INVALID_METHOD = "invalid_method"
    INVALID_URL = "invalid_url"
    INVALID_ID = "invalid_id"
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"  # a later line reusing a custom_id; the first wins
    CANCELLED = "cancelled"


# Failures that say nothing about the request itself: worth sending again (batch --resume does).
RETRYABLE_CODES = frozenset(
    {ErrorCode.ENGINE_DEAD, ErrorCode.CANCELLED, ErrorCode.ENGINE_UNAVAILABLE, ErrorCode.INTERNAL_ERROR}
)


class ErrorInfo(msgspec.Struct, omit_defaults=False):
    message: str
    type: str
    param: str | None = None
    code: ErrorCode | None = None


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
        code: ErrorCode | None = None,
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


# msgspec says "Expected `int`, got `str` - at `$.max_tokens`" or "Object missing required field
# `role` - at `$.messages[2]`"; `param` is the field's path as OpenAI writes it (`messages[2].role`).
_AT = re.compile(r"at `\$\.([^`]+)`")
_MISSING = re.compile(r"required field `([^`]+)`")


def from_validation_error(e: msgspec.ValidationError) -> APIError:
    """A 400 whose `param` is the path of the offending field when msgspec says which."""
    msg = str(e)
    at, missing = _AT.search(msg), _MISSING.search(msg)
    parts = [m.group(1) for m in (at, missing) if m]
    return bad_request(msg, ".".join(parts) if parts else None)


def from_param_error(e: ParamError) -> APIError:
    """A 400 naming the parameter that the shared checks (bus.validation) refused."""
    return bad_request(str(e), e.param)


def delta_error(kind: ErrorKind | None, message: str) -> APIError:
    """An engine-reported request error (RequestDelta.error/error_kind; the message is client-safe)."""
    if kind == ErrorKind.INVALID_REQUEST:
        return bad_request(message)
    if kind == ErrorKind.ENGINE_DEAD:
        return engine_dead(message)
    return APIError(500, message, code=ErrorCode.INTERNAL_ERROR)


def engine_dead(message: str) -> APIError:
    return APIError(503, message, code=ErrorCode.ENGINE_DEAD, headers=[(b"retry-after", b"5")])


def is_engine_dead(e: BaseException) -> bool:
    return isinstance(e, EngineDeadError)
