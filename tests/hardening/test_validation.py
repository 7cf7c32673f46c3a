"""Hostile bodies on the HTTP app (fake engine): strict OpenAI message validation and the
per-request bounds, each a 400 in the OpenAI error shape naming the offending field's path."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from pagebus.bus.config import EngineConfig, request_limits
from pagebus.frontends.http.app import App, Settings

from tests.frontends.http.fake_client import FakeEngineClient, call, fake_info

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
# A 64-token context, 16 blocks of 16 (15 usable: 240 tokens per request), at most 4 sequences.
LIMITS = request_limits(EngineConfig(max_num_seqs=4, max_prompts_per_request=3), 16)


def make_app(limits: bool = True) -> tuple[App, FakeEngineClient]:
    info = dataclasses.replace(fake_info(), limits=LIMITS if limits else None)
    client = FakeEngineClient(info=info)
    return App(client, Settings(served_model_name="fake")), client


def post(path: str, body: Any, limits: bool = True) -> tuple[int, dict[str, Any], FakeEngineClient]:
    app, client = make_app(limits)
    r = asyncio.run(call(app, "POST", path, body))
    return r.status, r.json(), client


def error_of(status: int, body: dict[str, Any]) -> dict[str, Any]:
    assert status == 400, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


def user(text: str = "hi") -> dict[str, Any]:
    return {"role": "user", "content": text}


@pytest.mark.parametrize(
    ("messages", "param", "words"),
    [
        ([], "messages", "empty"),
        ([user(), user(), {"role": "wizard", "content": "x"}], "messages[2].role", "wizard"),
        ([{"role": "user"}], "messages[0].content", "required"),
        ([user(), {"role": "user", "content": None}], "messages[1].content", "required"),
        ([{"role": "system", "content": 5}], "messages[0].content", "got `int`"),
        ([{"content": "x"}], "messages[0].role", "role"),
        ([{"role": 7, "content": "x"}], "messages[0].role", "got `int`"),
        (
            [{"role": "user", "content": [{"type": "video", "text": "x"}]}],
            "messages[0].content[0].type",
            "video",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url"}]}],
            "messages[0].content[0].type",
            "not supported",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "required"),
        ([{"role": "user", "content": [{"text": "x"}]}], "messages[0].content[0].type", "type"),
        ([{"role": "user", "content": ["x"]}], "messages[0].content[0]", "got `str`"),
        ([user(), {"role": "tool", "content": "42"}], "messages[1].tool_call_id", "tool_call_id"),
        ([{"role": "assistant"}], "messages[0].content", "required"),
        ("hello", "messages", "got `str`"),
    ],
)
def test_bad_messages_are_400_with_the_field_path(messages: Any, param: str, words: str) -> None:
    status, body, client = post(CHAT, {"messages": messages, "max_tokens": 2})
    err = error_of(status, body)
    assert err["param"] == param and words in err["message"], err
    assert client.requests == []  # refused before reaching the engine


def test_valid_messages_and_unknown_top_level_fields_are_accepted() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": [{"type": "text", "text": "be kind"}]},
        user(),
        {"role": "assistant", "content": "hello", "refusal": None},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    body = {
        "messages": messages,
        "max_tokens": 2,
        "metadata": {"x": 1},
        "store": False,
        "service_tier": "auto",
    }
    status, out, client = post(CHAT, body)
    assert status == 200, out
    (req,) = client.requests
    assert [m.role for m in req.messages or []] == [m["role"] for m in messages]
    assert (req.messages or [])[-1].content == "ab" and (req.messages or [])[5].tool_call_id == "call_1"


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (CMPL, {"prompt": "x", "n": 100000}, "n", "100000"),
        (CMPL, {"prompt": "x", "n": 5, "max_tokens": 1}, "n", "--max-num-seqs"),
        (CHAT, {"messages": [user()], "n": 129}, "n", "129"),
        (CMPL, {"prompt": ["a", "b", "c", "d"], "max_tokens": 1}, "prompt", "--max-prompts-per-request (3)"),
        (CMPL, {"prompt": "x", "n": 4, "max_tokens": 60}, "max_tokens", "--max-request-tokens (240)"),
        (CMPL, {"prompt": [[1] * 40, [2] * 40], "n": 2, "max_tokens": 21}, "max_tokens", "244"),
        (CMPL, {"prompt": ["a", "b"], "n": 2}, "max_tokens", "256"),  # no max_tokens: 64 per prompt
        (CHAT, {"messages": [user()], "n": 4}, "max_tokens", "256"),
    ],
)
def test_requests_over_a_bound_are_400_naming_it(path: str, body: Any, param: str, words: str) -> None:
    status, out, client = post(path, body)
    err = error_of(status, out)
    assert err["param"] == param and words in err["message"], err
    assert client.requests == []


def test_requests_at_the_bounds_are_accepted() -> None:
    for path, body in [
        (CMPL, {"prompt": ["a", "b", "c"], "n": 1, "max_tokens": 2}),
        (CMPL, {"prompt": [[1] * 40, [2] * 40], "n": 2, "max_tokens": 20}),  # 2 x (40 + 20) x 2 = 240
        (CHAT, {"messages": [user()], "n": 3}),  # 3 x 64 = 192
    ]:
        status, out, _ = post(path, body)
        assert status == 200, out


def test_without_engine_limits_n_is_still_capped_at_128() -> None:
    status, out, _ = post(CMPL, {"prompt": "x", "n": 129, "max_tokens": 1}, limits=False)
    assert error_of(status, out)["param"] == "n"
    assert post(CMPL, {"prompt": "x", "n": 128, "max_tokens": 1}, limits=False)[0] == 200


def test_tokenize_validates_messages_too() -> None:
    app, _ = make_app()
    r = asyncio.run(call(app, "POST", "/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}))
    assert error_of(r.status, r.json())["param"] == "messages[0].role"
