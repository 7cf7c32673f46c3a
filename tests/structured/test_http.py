"""Structured outputs and tools over HTTP with the official openai client, on one served engine
(the multi-process engine): every constrained output validates, streams equal non-streamed
outputs, forced tool choices always yield valid calls, and malformed constraints are 400s."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.frontends.http.server_proc import Server, run_server

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 10}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with run_server("--max-model-len", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _stream_chat(client: openai.OpenAI, **kw: Any) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """(content, tool calls by index, finish_reason) accumulated from a chat stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += tc.id or ""
                c["name"] += (tc.function.name if tc.function else None) or ""
                c["arguments"] += (tc.function.arguments if tc.function else None) or ""
            finish = ch.finish_reason or finish
    return content, calls, finish


def test_json_schema_chat_and_completions_stream_equals_non_stream(client: openai.OpenAI, model: str) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw: dict[str, Any] = {"max_tokens": 60, "temperature": 0, "response_format": rf}
    msgs = [{"role": "user", "content": "Describe a user of a website as JSON."}]
    full = client.chat.completions.create(model=model, messages=msgs, **kw)
    text = full.choices[0].message.content or ""
    assert full.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    streamed, calls, finish = _stream_chat(client, model=model, messages=msgs, **kw)
    assert (streamed, calls, finish) == (text, {}, "stop")
    # completions, with a seed: sampled, and the same seed gives the same output
    ckw: dict[str, Any] = {"prompt": "A person record:", "max_tokens": 60, "temperature": 0.9, "seed": 7}
    ckw["extra_body"] = {"response_format": rf}
    a = client.completions.create(model=model, **ckw)
    b = client.completions.create(model=model, stream=True, **ckw)
    assert a.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(a.choices[0].text), PERSON)
    assert "".join(c.choices[0].text for c in b if c.choices) == a.choices[0].text


def test_json_object_regex_choice_and_vllm_fields(client: openai.OpenAI, model: str) -> None:
    obj = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"},
        max_tokens=80,
        temperature=0,
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens: it says so, never "stop"
        assert obj.choices[0].finish_reason == "length"
    date = re.compile(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])")
    email = re.compile(r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)")
    for body, pattern in (
        ({"structured_outputs": {"regex": date.pattern}}, date),
        ({"guided_regex": email.pattern}, email),
    ):
        out = client.completions.create(
            model=model,
            prompt="Contact:",
            max_tokens=30,
            n=3,
            temperature=1.0,
            seed=3,
            extra_body=body,
        )
        for ch in out.choices:
            assert pattern.fullmatch(ch.text), ch.text
            assert ch.finish_reason == "stop"
    labels = ["positive", "negative", "neutral"]
    for body in ({"structured_outputs": {"choice": labels}}, {"guided_choice": labels}):
        out = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Sentiment of: I love this!"}],
            max_tokens=10,
            n=2,
            temperature=1.0,
            extra_body=body,
        )
        assert all(ch.message.content in labels for ch in out.choices)
    gram = 'root ::= "yes" | "no" | "maybe, " [a-z]+'
    out = client.completions.create(
        model=model,
        prompt="Answer:",
        max_tokens=12,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": gram}},
    )
    assert (
        re.fullmatch(r"yes|no|maybe, [a-z]+", out.choices[0].text) or out.choices[0].finish_reason == "length"
    )


def test_required_and_named_tool_choice_always_call(client: openai.OpenAI, model: str) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for seed in (1, 2):
            kw: dict[str, Any] = {
                "model": model,
                "messages": ASK,
                "tools": [WEATHER, TIME],
                "tool_choice": choice,
                "max_tokens": 80,
                "temperature": 0.8,
                "seed": seed,
            }
            out = client.chat.completions.create(**kw)
            msg = out.choices[0].message
            assert out.choices[0].finish_reason == "tool_calls", msg
            assert msg.tool_calls
            for tc in msg.tool_calls:
                assert tc.type == "function" and tc.id
                jsonschema.validate(json.loads(tc.function.arguments), schemas[tc.function.name])
            if isinstance(choice, dict):
                assert [tc.function.name for tc in msg.tool_calls] == ["get_weather"]
            content, calls, finish = _stream_chat(client, **kw)
            assert finish == "tool_calls" and not content
            assert [(c["name"], c["arguments"]) for c in calls.values()] == [
                (tc.function.name, tc.function.arguments) for tc in msg.tool_calls
            ]
            assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_result_round_trips(server: Server, client: openai.OpenAI, model: str) -> None:
    first = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    convo: list[Any] = [
        *ASK,
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    second = client.chat.completions.create(
        model=model,
        messages=convo,
        tools=[WEATHER],
        max_tokens=30,
        temperature=0,
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and its result reach the prompt (Hermes-style for SmolLM2's template)
    status, _, body = server.request("POST", "/tokenize", {"messages": convo})
    assert status == 200, body
    status, _, body = server.request("POST", "/detokenize", {"tokens": json.loads(body)["tokens"]})
    prompt = json.loads(body)["prompt"]
    assert (
        f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>'
        in prompt
    )
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in prompt


MALFORMED: list[tuple[str, dict[str, Any]]] = [
    ("json", {"structured_outputs": {"json": "{not json"}}),
    ("json", {"structured_outputs": {"json": '"a string"'}}),
    ("json", {"structured_outputs": {"json": {"type": "strange"}}}),
    ("json", {"structured_outputs": {"json": {"type": "object", "properties": 3}}}),
    ("json", {"structured_outputs": {"json": {"type": "object", "required": "name"}}}),
    ("json", {"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}}),
    ("json", {"structured_outputs": {"json": {"$ref": "#/$defs/missing"}}}),
    ("json", {"structured_outputs": {"json": {"type": "string", "pattern": "(["}}}),
    ("not", {"structured_outputs": {"json": {"not": {"type": "integer"}}}}),
    ("uniqueItems", {"guided_json": {"type": "array", "uniqueItems": True}}),
    (
        "allOf",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"allOf": [{}]}}}},
    ),
    ("schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
    ("response_format", {"response_format": {"type": "yaml"}}),
    ("regex", {"structured_outputs": {"regex": "[a-"}}),
    ("regex", {"guided_regex": "(ab"}),
    ("regex", {"structured_outputs": {"regex": "a{3,1}"}}),
    ("grammar", {"structured_outputs": {"grammar": 'root ::= "a" | b'}}),
    ("grammar", {"guided_grammar": 'root ::= "a'}),
    ("grammar", {"structured_outputs": {"grammar": 'start ::= "x"'}}),
    ("exactly one", {"structured_outputs": {"regex": "a", "choice": ["a"]}}),
    ("choice", {"structured_outputs": {"choice": []}}),
    ("one structured-output constraint", {"guided_regex": "a", "guided_choice": ["a"]}),
]


def test_malformed_constraints_are_400s_and_the_engine_stays_healthy(
    server: Server, client: openai.OpenAI, model: str
) -> None:
    assert len(MALFORMED) >= 20
    for word, extra in MALFORMED:
        for route, base in (
            ("/v1/completions", {"prompt": "x", "max_tokens": 4}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}),
        ):
            status, _, body = server.request("POST", route, {**base, **extra})
            err = json.loads(body)["error"]
            assert status == 400, (extra, body)
            assert word.lower() in err["message"].lower(), (word, err)
    bad_tools = [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tool_choice": "required"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "combined",
        ),
    ]
    for extra, word in bad_tools:
        status, _, body = server.request(
            "POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **extra}
        )
        assert status == 400 and word in json.loads(body)["error"]["message"], body
    assert server.request("GET", "/health", auth=False)[0] == 200
    ok = client.completions.create(
        model=model, prompt="Hi", max_tokens=3, extra_body={"guided_choice": ["a", "b"]}
    )
    assert ok.choices[0].text in ("a", "b")
