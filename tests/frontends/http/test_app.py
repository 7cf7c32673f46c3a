"""Unit tests of the HTTP layers over FakeEngineClient: parsing, validation, SSE, errors, auth, metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pagebus.bus.messages import SchedulerStats
from pagebus.frontends.http.app import App, Settings
from pagebus.frontends.http.auth import bearer_ok
from pagebus.frontends.openai.errors import APIError
from pagebus.frontends.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
    prompts,
    sampling_params,
)
from prometheus_client.parser import text_string_to_metric_families

from tests.frontends.http.fake_client import FakeEngineClient, call, sse_events

KEY = {"Authorization": "Bearer sk-test"}


def make_app(**settings: Any) -> tuple[App, FakeEngineClient]:
    client = FakeEngineClient()
    app = App(client, Settings(served_model_name="fake", **settings), token_text=lambda t: f"<{t}>")
    return app, client


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def post(app: App, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
    return run(call(app, "POST", path, body, headers))


# ------------------------------------------------------------------------ protocol
def test_parse_ignores_unknown_fields_and_maps_openai_names() -> None:
    req = decode_body(
        b'{"prompt": "hi", "max_completion_tokens": 5, "max_tokens": 9, "stop": "x", "foo": 1, "top_k": 3}',
        CompletionRequest,
    )
    p = sampling_params(req, vocab_size=100)
    assert (p.max_tokens, p.stop, p.top_k, p.temperature) == (5, ["x"], 3, 1.0)
    # Absent max_tokens means "up to the context limit" (vLLM), not SamplingParams' default of 16.
    assert sampling_params(decode_body(b'{"prompt": "hi"}', CompletionRequest), 100).max_tokens is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "hi", "max_tokens": "5"}', "max_tokens"),
        (b'{"prompt": "hi", "temperature": "hot"}', "temperature"),
        (b'{"max_tokens": 5}', "prompt"),
        (b'{"prompt": "hi", "top_p": 2.0}', "top_p"),
        (b'{"prompt": "hi", "n": 0}', "n"),
        (b'{"prompt": "hi", "stop_token_ids": [1000]}', "stop_token_ids"),
        (b'{"prompt": [1, "a"]}', "prompt"),
        (b'{"prompt": [[1, 2], [500]]}', "prompt"),
        (b'{"prompt": []}', "prompt"),
        (b'{"prompt": "hi", "stream_options": {"include_usage": true}}', "stream_options"),
        # integers outside int64, which the bus cannot carry: refused at decode, not a 500 later
        (b'{"prompt": "hi", "priority": -9223372036854775809}', "priority"),
        (b'{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
        (b'{"prompt": "hi", "top_k": 9223372036854775808}', "top_k"),
        (b'{"prompt": "hi", "min_tokens": 9223372036854775808}', "min_tokens"),
        (b'{"prompt": "hi", "stop_token_ids": [9223372036854775808]}', "stop_token_ids[0]"),
        (b'{"prompt": [[1, 9223372036854775808]]}', "prompt"),
    ],
)
def test_bad_completion_params_are_400_naming_the_field(body: bytes, param: str) -> None:
    with pytest.raises(APIError) as e:
        req = decode_body(body, CompletionRequest)
        sampling_params(req, 100)
        prompts(req, 100)
    assert (e.value.status, e.value.param) == (400, param)


def test_prompt_forms() -> None:
    def forms(raw: bytes) -> list[Any]:
        return prompts(decode_body(raw, CompletionRequest), 100)

    assert forms(b'{"prompt": "a"}') == ["a"]
    assert forms(b'{"prompt": ["a", "b"]}') == ["a", "b"]
    assert forms(b'{"prompt": [1, 2]}') == [[1, 2]]
    assert forms(b'{"prompt": [[1], [2, 3]]}') == [[1], [2, 3]]


def test_chat_logprobs_rules() -> None:
    req = decode_body(b'{"messages": [], "logprobs": true, "top_logprobs": 3}', ChatCompletionRequest)
    assert sampling_params(req, 100).logprobs == 3
    for raw in (
        b'{"messages": [], "top_logprobs": 3}',
        b'{"messages": [], "logprobs": true, "top_logprobs": 99}',
    ):
        with pytest.raises(APIError) as e:
            sampling_params(decode_body(raw, ChatCompletionRequest), 100)
        assert e.value.param == "top_logprobs"


def test_bearer_check() -> None:
    assert bearer_ok(b"Bearer sk-1", "sk-1") and bearer_ok(b"bearer sk-1", "sk-1")
    assert not bearer_ok(b"Bearer sk-2", "sk-1") and not bearer_ok(None, "sk-1")
    assert not bearer_ok(b"Basic sk-1", "sk-1")


# ------------------------------------------------------------------------ responses
def test_completion_non_streaming_with_n_echo_and_logprobs() -> None:
    app, client = make_app()
    r = post(app, "/v1/completions", {"prompt": "hi", "n": 2, "echo": True, "logprobs": 1})
    assert r.status == 200, r.body
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake"
    assert [c["text"] for c in body["choices"]] == ["PROMPT Hello world"] * 2
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["<10>", "<11>"] and lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["top_logprobs"][0] == {"<10>": -0.5}
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    assert client.requests[0].params.max_tokens is None


def test_completion_multiple_prompts_fan_out_choices() -> None:
    app, client = make_app()
    body = post(app, "/v1/completions", {"prompt": [[1, 2], [3, 4, 5]], "n": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 5
    assert [r.prompt_token_ids for r in client.requests] == [[1, 2], [3, 4, 5]]


def test_completion_stream_matches_non_stream_and_ends_with_usage_and_done() -> None:
    app, _ = make_app()
    body = {"prompt": "hi", "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    r = post(app, "/v1/completions", body)
    assert r.status == 200 and r.headers[b"content-type"].startswith(b"text/event-stream")
    events = sse_events(r.body)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    texts = ["", ""]
    for ev in events[:-2]:
        for c in ev["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == ["Hello world"] * 2
    assert events[-3]["choices"][-1]["finish_reason"] == "length"


def test_chat_stream_starts_with_role_and_has_logprobs() -> None:
    app, client = make_app()
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "stream": True,
        "logprobs": True,
        "top_logprobs": 1,
    }
    events = sse_events(post(app, "/v1/chat/completions", body).body)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["delta"]["content"] for e in events[1:-1] for c in e["choices"]) == "Hello world"
    assert events[1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]["token"] == "<10>"
    assert events[-1] == "[DONE]" and client.requests[0].messages[0].content == "hi"


def test_chat_non_streaming() -> None:
    app, _ = make_app()
    body = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}


# ------------------------------------------------------------------------ errors
def test_error_statuses() -> None:
    app, _ = make_app(api_key="sk-test", max_request_bytes=100)
    assert run(call(app, "GET", "/v1/models")).status == 401
    r = run(call(app, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"}))
    assert r.status == 401 and r.json()["error"]["type"] == "authentication_error"
    assert run(call(app, "GET", "/health")).status == 200  # /health stays open
    assert run(call(app, "GET", "/metrics")).status == 401
    assert run(call(app, "GET", "/v1/models", headers=KEY)).json()["data"][0]["id"] == "fake"
    assert run(call(app, "GET", "/nope", headers=KEY)).status == 404
    r = run(call(app, "GET", "/v1/completions", headers=KEY))
    assert r.status == 405 and r.headers[b"allow"] == b"POST"
    r = post(app, "/v1/completions", {"prompt": "hi", "model": "other"}, KEY)
    assert r.status == 404 and r.json()["error"]["param"] == "model"
    r = post(app, "/v1/completions", b'{"prompt": ', KEY)
    assert r.status == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = post(app, "/v1/completions", {"prompt": "too long"}, KEY)
    assert r.status == 400 and "max_model_len 64" in r.json()["error"]["message"]
    assert post(app, "/v1/completions", {"prompt": "x" * 200}, KEY).status == 413
    # No Content-Length: the streamed size is checked too.
    r = run(call(app, "POST", "/v1/completions", headers=KEY, chunks=[b'{"prompt": "', b"x" * 95, b'x"}']))
    assert r.status == 413 and r.json()["error"]["code"] == "request_too_large"


def test_engine_dead_is_503_and_health_follows() -> None:
    app, client = make_app()
    r = post(app, "/v1/completions", {"prompt": "dead"})
    assert r.status == 503 and b"Traceback" not in r.body and r.headers[b"retry-after"]
    client.is_dead = True
    assert run(call(app, "GET", "/health")).status == 503
    assert post(app, "/v1/completions", {"prompt": "hi"}).status == 503


def test_unexpected_exception_is_generic_500() -> None:
    app, client = make_app()

    def boom(req: Any) -> Any:
        raise KeyError("secret internals")

    client.generate = boom  # type: ignore[method-assign]
    r = post(app, "/v1/completions", {"prompt": "hi"})
    assert r.status == 500 and b"secret" not in r.body
    assert r.json()["error"]["message"] == "internal server error"


def test_max_waiting_refuses_with_retry_after() -> None:
    app, client = make_app(max_waiting=0)

    async def scenario() -> tuple[int, Any]:
        gone = asyncio.Event()
        # The first request waits forever for its first delta; the next one finds a full queue.
        client.generate = lambda req: _never(req)  # type: ignore[method-assign]
        first = asyncio.create_task(call(app, "POST", "/v1/completions", {"prompt": "a"}, disconnect=gone))
        while app.num_waiting == 0:
            await asyncio.sleep(0)
        second = await call(app, "POST", "/v1/completions", {"prompt": "b"})
        gone.set()
        await asyncio.wait_for(first, 5)
        return second.status, second.headers.get(b"retry-after")

    assert run(scenario()) == (429, b"1")
    assert app.num_waiting == 0


async def _never(req: Any) -> Any:
    await asyncio.Event().wait()
    yield None


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_closes_the_engine_iterator(stream: bool) -> None:
    app, client = make_app()

    async def scenario() -> None:
        client.streaming = asyncio.Event()
        gone = asyncio.Event()
        task = asyncio.create_task(
            call(app, "POST", "/v1/completions", {"prompt": "hang", "stream": stream}, disconnect=gone)
        )
        await asyncio.wait_for(client.streaming.wait(), 5)
        gone.set()
        await asyncio.wait_for(task, 5)

    run(scenario())
    assert client.closed == [client.requests[0].request_id]


def test_cors_only_when_configured() -> None:
    app, _ = make_app()
    assert (
        b"access-control-allow-origin"
        not in run(call(app, "GET", "/health", headers={"Origin": "http://a"})).headers
    )
    app, _ = make_app(allowed_origins=("http://a",), api_key="k")
    pre = run(call(app, "OPTIONS", "/v1/completions", headers={"Origin": "http://a"}))
    assert pre.status == 204 and pre.headers[b"access-control-allow-origin"] == b"http://a"
    other = run(call(app, "GET", "/health", headers={"Origin": "http://b"}))
    assert b"access-control-allow-origin" not in other.headers


# ------------------------------------------------------------------------ misc routes
def test_metrics_tokenize_and_openapi() -> None:
    app, client = make_app()
    client.latest_stats = SchedulerStats(num_running=2, kv_usage=0.25, prefix_cache_hits=7)
    post(app, "/v1/completions", {"prompt": "hi"})
    text = run(call(app, "GET", "/metrics")).body.decode()
    samples = {
        s.name + str(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples["pagebus:num_requests_running[]"] == 2
    assert samples["pagebus:kv_cache_usage_perc[]"] == 0.25
    assert samples["pagebus:prefix_cache_hits_total[]"] == 7
    assert samples["pagebus:generation_tokens_total[]"] == 2
    assert samples["pagebus:prompt_tokens_total[]"] == 3
    assert samples["pagebus:request_success_total[('finished_reason', 'length')]"] == 1
    assert samples["pagebus:time_to_first_token_seconds_count[]"] == 1
    assert samples["pagebus:inter_token_latency_seconds_count[]"] == 1
    tok = post(app, "/tokenize", {"prompt": "ab"}).json()
    assert tok == {"count": 2, "max_model_len": 64, "tokens": [97, 98]}
    assert post(app, "/detokenize", {"tokens": [0, 1]}).json() == {"prompt": "AB"}
    assert post(app, "/detokenize", {"tokens": [100]}).status == 400
    assert post(app, "/tokenize", {}).status == 400
    spec = run(call(app, "GET", "/openapi.json")).json()
    assert {"/v1/completions", "/v1/chat/completions", "/metrics", "/tokenize"} <= set(spec["paths"])
    assert "CompletionRequest" in spec["components"]["schemas"]
    assert run(call(app, "GET", "/version")).json()["version"]
