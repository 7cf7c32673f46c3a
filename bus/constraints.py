"""How a `StructuredOutputsParams` becomes grammar source text, shared by the frontend (which
checks it) and the worker (which compiles it), so both see the very same grammar."""

from __future__ import annotations

import json

import msgspec
from pagebus.bus.messages import StructuredOutputsParams

ANY_OBJECT_SCHEMA = '{"type": "object"}'


def constraint_key(c: StructuredOutputsParams) -> bytes:
    """Equal for equal constraints: keys the compile caches."""
    return msgspec.json.encode(c)


def json_schema_text(c: StructuredOutputsParams) -> str | None:
    """The JSON schema of a json / json_object constraint, as text (None for the other kinds)."""
    if c.json is not None:
        return c.json if isinstance(c.json, str) else json.dumps(c.json)
    if c.json_object:
        return ANY_OBJECT_SCHEMA
    return None


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar (root rule `root`) whose language is exactly `choices`."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
