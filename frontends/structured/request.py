"""OpenAI and vLLM request fields -> one `StructuredOutputsParams` (and the tool mode of a chat).

Accepted, OpenAI's names first: `response_format` `{"type": "json_object"}` /
`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` / `{"type": "text"}`;
vLLM's `structured_outputs` {json, regex, choice, grammar}; vLLM's older top-level
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`; and on chat, `tools` with
`tool_choice` "required" or a named function, which set the constraint themselves. A request
gives at most one constraint.
"""

from __future__ import annotations

from typing import Any

import msgspec
from pagebus.bus.messages import StructuredOutputsParams
from pagebus.bus.validation import ParamError
from pagebus.frontends.structured.tools import ToolMode, parameters_schema, required_schema


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class ToolFunction(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: ToolFunction


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: NamedFunction


def constraint(body: Any) -> StructuredOutputsParams | None:
    """The one constraint of a request body (its `response_format`, `structured_outputs` and
    `guided_*` fields), or None; ParamError names the conflicting or bad field."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = body.response_format
    if rf is not None:
        if rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema is None:
                raise ParamError("response_format json_schema needs json_schema.schema", "response_format")
            found.append(
                ("response_format", StructuredOutputsParams(json=_schema_object(rf.json_schema.schema)))
            )
        elif rf.type != "text":
            raise ParamError(
                f"response_format type {rf.type!r} is not supported; use text, json_object or json_schema",
                "response_format",
            )
    if body.structured_outputs is not None:
        found.append(("structured_outputs", body.structured_outputs))
    for name, c in (
        (
            "guided_json",
            StructuredOutputsParams(json=body.guided_json) if body.guided_json is not None else None,
        ),
        (
            "guided_regex",
            StructuredOutputsParams(regex=body.guided_regex) if body.guided_regex is not None else None,
        ),
        (
            "guided_choice",
            StructuredOutputsParams(choice=body.guided_choice) if body.guided_choice is not None else None,
        ),
        (
            "guided_grammar",
            StructuredOutputsParams(grammar=body.guided_grammar) if body.guided_grammar is not None else None,
        ),
    ):
        if c is not None:
            found.append((name, c))
    if len(found) > 1:
        raise ParamError(
            f"give one structured-output constraint, got {', '.join(n for n, _ in found)}", found[1][0]
        )
    return found[0][1] if found else None


def _schema_object(schema: dict[str, Any] | bool) -> dict[str, Any]:
    if isinstance(schema, bool):  # true: anything; false: nothing can match
        if not schema:
            raise ParamError("response_format json_schema.schema false admits no output", "response_format")
        return {}
    return schema


def tool_mode(
    tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None
) -> tuple[ToolMode | None, StructuredOutputsParams | None, list[dict[str, Any]] | None]:
    """(how to read the output, the constraint a forced call needs, the tools for the prompt)."""
    if tool_choice is not None and not tools:
        if tool_choice == "none":
            return None, None, None
        raise ParamError("tool_choice needs tools", "tool_choice")
    if not tools:
        return None, None, None
    for t in tools:
        if t.type != "function":
            raise ParamError(f"tool type {t.type!r} is not supported; only function", "tools")
    defs = [msgspec.to_builtins(t) for t in tools]
    names = frozenset(t.function.name for t in tools)
    if len(names) != len(tools):
        raise ParamError("tool function names must be unique", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None, None, None
    if choice == "auto":
        return ToolMode("auto", names), None, defs
    if choice == "required":
        return ToolMode("required", names), StructuredOutputsParams(json=required_schema(defs)), defs
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise ParamError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        tool = next(d for d in defs if d["function"]["name"] == name)
        return ToolMode("named", names, name), StructuredOutputsParams(json=parameters_schema(tool)), defs
    raise ParamError(
        f"tool_choice must be none, auto, required or {{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}",
        "tool_choice",
    )
