"""The OpenAPI 3.1 document for /openapi.json, with request schemas generated from our Structs."""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec
from pagebus.frontends.openai import protocol as P
from pagebus.frontends.openai.errors import ErrorResponse

_REF = "#/components/schemas/{name}"


def _op(summary: str, body: str | None = None, response: str | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {"default": _ref_content("ErrorResponse")}}
    if body is not None:
        op["requestBody"] = {"required": True, **_ref_content(body)}
    if response is not None:
        op["responses"]["200"] = {"description": "OK", **_ref_content(response)}
    else:
        op["responses"]["200"] = {"description": "OK"}
    return op


def _ref_content(name: str) -> dict[str, Any]:
    return {
        "description": name,
        "content": {"application/json": {"schema": {"$ref": _REF.format(name=name)}}},
    }


@cache
def openapi_spec(version: str) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        [
            P.CompletionRequest,
            P.ChatCompletionRequest,
            P.TokenizeBody,
            P.DetokenizeBody,
            P.Response,
            ErrorResponse,
        ],
        ref_template=_REF,
    )
    gen = "; `stream: true` answers with server-sent events ending in `data: [DONE]`"
    paths = {
        "/v1/completions": {"post": _op("Complete prompts" + gen, "CompletionRequest", "Response")},
        "/v1/chat/completions": {"post": _op("Chat completion" + gen, "ChatCompletionRequest", "Response")},
        "/v1/models": {"get": _op("The served model")},
        "/health": {"get": _op("200 when the engine is alive and ready, else 503")},
        "/version": {"get": _op("Server version")},
        "/metrics": {"get": _op("Prometheus metrics (text format)")},
        "/tokenize": {"post": _op("Tokenize a prompt or chat messages", "TokenizeBody")},
        "/detokenize": {"post": _op("Token ids to text", "DetokenizeBody")},
        "/openapi.json": {"get": _op("This document")},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "pagebus OpenAI-compatible API", "version": version},
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }
