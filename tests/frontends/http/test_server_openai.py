"""End to end: a real `pagebus serve` (default model, fp32 on CPU) driven by the official openai client."""

from __future__ import annotations

import http.client
from collections.abc import Iterator

import openai
import pytest

from tests.frontends.http.server_proc import Server, run_server, wait_until

pytestmark = pytest.mark.slow
KEY = "sk-e2e"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with run_server("--max-model-len", "512", api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def test_completion_stream_equals_non_stream_greedy_and_seeded(client: openai.OpenAI, model: str) -> None:
    for extra in ({"temperature": 0.0, "n": 1}, {"temperature": 0.9, "seed": 1234, "n": 2}):
        kw = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, **extra}
        full = client.completions.create(**kw)
        assert len(full.choices) == kw["n"]
        assert full.usage is not None and full.usage.completion_tokens > 0
        assert full.usage.prompt_tokens_details is not None
        texts = [""] * kw["n"]
        usage = None
        for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            for c in chunk.choices:
                texts[c.index] += c.text
            usage = chunk.usage or usage
        assert texts == [c.text for c in sorted(full.choices, key=lambda c: c.index)]
        assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_chat_stream_equals_non_stream_and_stop_strings(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    kw = {"model": model, "messages": messages, "max_tokens": 10, "temperature": 0.0}
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and text
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices
    )
    assert streamed == text
    # Stop on the second word of the greedy output: the text ends right before it.
    words = text.split(" ")
    assert len(words) > 2, text
    stop = " " + words[2]
    stopped = client.chat.completions.create(**kw, stop=[stop, "never-seen-xyz"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]


def test_logprobs(client: openai.OpenAI, model: str) -> None:
    comp = client.completions.create(model=model, prompt="One, two,", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == comp.usage.completion_tokens
    assert "".join(lp.tokens) == comp.choices[0].text
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    # Greedy: the chosen token is the most likely one.
    assert all(t.logprob >= t.top_logprobs[0].logprob - 1e-5 for t in content)


def test_auth_and_unknown_model_via_client(server: Server, model: str) -> None:
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_metrics_counters_move(server: Server, client: openai.OpenAI, model: str) -> None:
    before = server.metrics()
    client.completions.create(
        model=model, prompt="Hello", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    after = server.metrics()
    key = "pagebus:request_success_total{finished_reason=length}"
    assert after[key] == before.get(key, 0) + 1
    assert after["pagebus:generation_tokens_total{}"] == before["pagebus:generation_tokens_total{}"] + 3
    assert after["pagebus:prompt_tokens_total{}"] > before["pagebus:prompt_tokens_total{}"]
    assert (
        after["pagebus:e2e_request_latency_seconds_count{}"]
        == before["pagebus:e2e_request_latency_seconds_count{}"] + 1
    )
    for name in (
        "kv_cache_usage_perc",
        "num_requests_running",
        "num_requests_waiting",
        "prefix_cache_queries_total",
    ):
        assert f"pagebus:{name}{{}}" in after


def test_disconnect_mid_stream_aborts_and_frees_kv(server: Server, model: str) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = (
        b'{"model": "%s", "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": true, "stream": true}'
        % model.encode()
    )
    conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read1(65536).startswith(b"data: ")  # the first token is flushed on its own
    wait_until(lambda: server.metrics()["pagebus:num_requests_running{}"] >= 1, 30, "the request to run")
    tokens_at_close = server.metrics()["pagebus:generation_tokens_total{}"]
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()

    def idle() -> bool:
        m = server.metrics()
        return m["pagebus:num_requests_running{}"] == 0 and m["pagebus:kv_cache_usage_perc{}"] == 0

    wait_until(idle, 30, "running requests and KV usage to drop to 0 after the disconnect")
    # Aborted well before its 400 tokens (a few steps may land between the close and the abort).
    assert server.metrics()["pagebus:generation_tokens_total{}"] < tokens_at_close + 100
