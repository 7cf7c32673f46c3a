"""OpenAI tool calling: tools into the prompt, the model's tool calls out of its text, and the
constraint that makes `tool_choice: "required"` or a named function always produce a call.

Prompt: a chat template that reads `tools` gets them (HF `apply_chat_template(tools=...)`). One
that does not (SmolLM2's) gets them in a Hermes-style system message, and the conversation's
earlier calls and results are written in the same format: an assistant's calls as
`<tool_call>{"name", "arguments"}</tool_call>`, a `tool` message as a user turn holding
`<tool_response>...</tool_response>`.

Output formats parsed under `auto`: Hermes / Qwen `<tool_call>{json}</tool_call>` (one or more),
Mistral `[TOOL_CALLS] [{"name", "arguments"}, ...]`, and Llama 3 JSON (the whole output one
`{"name", "parameters" | "arguments"}` object, optionally after `<|python_tag|>`). A call is only
taken for a tool the request defined.

Enforced forms: a named function constrains the output to that function's parameters schema (the
output is the arguments); `required` constrains it to a JSON array of `{"name", "parameters"}`
objects, one branch per tool (vLLM's form).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagebus.frontends.tokenizer import Tokenizer

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------------- prompt
def template_reads_tools(tok: Tokenizer) -> bool:
    t = tok.chat_template
    if isinstance(t, dict):
        return "tool_use" in t or "tools" in t.get("default", "")
    return t is not None and "tools" in t


def chat_prompt(
    tok: Tokenizer,
    convo: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
) -> str:
    """The prompt of a conversation that may define tools and hold earlier calls and results."""
    has_tool_turns = any(m.get("tool_calls") or m.get("role") == "tool" for m in convo)
    if template_reads_tools(tok):
        if tools or has_tool_turns:
            convo = [_arguments_as_objects(m) for m in convo]
        return tok.apply_chat_template(convo, add_generation_prompt, tools=tools or None)
    if has_tool_turns:
        convo = [_as_hermes_text(m) for m in convo]
    if tools:
        text = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if convo and convo[0].get("role") == "system":
            convo = [
                {**convo[0], "content": f"{convo[0].get('content') or ''}\n\n{text}".lstrip()},
                *convo[1:],
            ]
        else:
            convo = [{"role": "system", "content": text}, *convo]
    return tok.apply_chat_template(convo, add_generation_prompt)


def _arguments_as_objects(m: dict[str, Any]) -> dict[str, Any]:
    """HF templates print `arguments | tojson`: they want an object, OpenAI sends JSON text."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        with contextlib.suppress(json.JSONDecodeError):  # else the template prints the text
            fn["arguments"] = json.loads(fn.get("arguments") or "{}")
        out.append({**c, "function": fn})
    return {**m, "tool_calls": out}


def _as_hermes_text(m: dict[str, Any]) -> dict[str, Any]:
    if m.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
    calls = m.get("tool_calls")
    if not calls:
        return m
    parts = [m["content"]] if m.get("content") else []
    for c in calls:
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            args = fn.get("arguments")
        call = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
        parts.append(f"<tool_call>\n{call}\n</tool_call>")
    return {"role": m.get("role", "assistant"), "content": "\n".join(parts)}


# --------------------------------------------------------------------------- constraints
def parameters_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    return dict(tool.get("function", {}).get("parameters") or EMPTY_PARAMETERS)


def required_schema(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A JSON array of one or more calls, each to one of `tools` with its parameters."""
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": parameters_schema(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    items = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return {"type": "array", "minItems": 1, "items": items}


# ------------------------------------------------------------------------------- parsing
@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class ToolMode:
    """How one chat request's output becomes tool calls: `auto` (parse any known format),
    `required` (the constrained array), or `named` (the output is that function's arguments)."""

    kind: str  # "auto" | "required" | "named"
    names: frozenset[str]
    function: str | None = None  # for "named"


def parse_tool_calls(text: str, mode: ToolMode) -> tuple[str | None, list[ParsedCall]]:
    """(content before the calls or None, calls). No call found: (text, [])."""
    if mode.kind == "named":
        assert mode.function is not None
        return (None, [ParsedCall(mode.function, text.strip())]) if _is_json(text) else (text, [])
    if mode.kind == "required":
        calls = _call_list(_loads(text), mode.names, "parameters")
        return (None, calls) if calls else (text, [])
    if "<tool_call>" in text:
        head = text[: text.index("<tool_call>")]
        calls = []
        for body in _HERMES.findall(text):
            calls += _call_list([_loads(body)], mode.names, "arguments")
        if calls:
            return (head if head.strip() else None), calls
    stripped = text.strip()
    if stripped.startswith("[TOOL_CALLS]"):
        calls = _call_list(_loads(stripped[len("[TOOL_CALLS]") :]), mode.names, "arguments")
        if calls:
            return None, calls
    if stripped.startswith("<|python_tag|>"):
        stripped = stripped[len("<|python_tag|>") :].strip()
    if stripped[:1] in "{[":
        obj = _loads(stripped)
        calls = _call_list(obj if isinstance(obj, list) else [obj], mode.names, "parameters")
        if calls:
            return None, calls
    return text, []


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None


def _is_json(text: str) -> bool:
    return _loads(text) is not None or text.strip() == "null"


def _call_list(obj: Any, names: frozenset[str], args_key: str) -> list[ParsedCall]:
    """Calls from a list of {"name", args_key | "arguments" | "parameters"} objects; [] if any
    entry is not a call to a known tool."""
    if not isinstance(obj, list) or not obj:
        return []
    out = []
    for c in obj:
        if not isinstance(c, dict) or c.get("name") not in names:
            return []
        args: Any = next((c[k] for k in (args_key, "arguments", "parameters") if k in c), {})
        if isinstance(args, str) and _is_json(args):
            out.append(ParsedCall(c["name"], args))
        else:
            out.append(ParsedCall(c["name"], json.dumps(args, ensure_ascii=False)))
    return out


class ToolStream:
    """One streamed choice under a tool mode: text in; content to send now, and the calls once
    the output is complete. Content that may open a call is held back until it is decided."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.sent = 0  # characters of text already sent as content
        self.named_id = new_call_id() if mode.kind == "named" else None
        self.content: str | None = None  # after finish(): the content beside the calls

    def feed(self, delta: str) -> str:
        """Content to send for this delta (auto mode only; the other modes hold everything)."""
        self.text += delta
        if self.mode.kind != "auto":
            return ""
        hold = _held_from(self.text)
        out = self.text[self.sent : max(self.sent, hold)]
        self.sent = max(self.sent, hold)
        return out

    def finish(self, completed: bool) -> tuple[str, list[ParsedCall]]:
        """At the end: (content not yet sent, calls). A cut-off output (`completed` false) has
        no calls: its text goes out as content."""
        content, calls = parse_tool_calls(self.text, self.mode) if completed else (self.text, [])
        if calls:
            if self.named_id is not None:
                calls[0].id = self.named_id
            self.content = content
            head = content or ""
            rest = head[self.sent :] if len(head) > self.sent else ""
            self.sent = len(self.text)
            return rest, calls
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        return rest, []


def _held_from(text: str) -> int:
    """Where content must stop while the output may still turn into a call: at a call marker, at
    a trailing partial marker, or at 0 when the output so far could be a bare JSON call."""
    body = text.lstrip()
    if not body or body[0] in "{[" or any(m.startswith(body) or body.startswith(m) for m in _MARKERS):
        return 0
    at = text.find("<tool_call>")
    if at >= 0:
        return at
    for k in range(min(len(text), len("<tool_call>") - 1), 0, -1):
        if "<tool_call>".startswith(text[-k:]):
            return len(text) - k
    return len(text)
