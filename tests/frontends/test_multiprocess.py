"""LLM(multiprocess=True): the same outputs as the in-process engine, through real processes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pagebus.bus.messages import GenerateRequest, SamplingParams, TokenizeRequest
from pagebus.frontends.engine.client import AsyncEngineClient

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at",
    "My favourite colour is",
    "Translate to French: cheese",
]


@pytest.fixture(scope="module")
def mp_llm(default_model: str) -> Iterator[Any]:
    from pagebus import LLM

    llm = LLM(default_model, dtype="float32", seed=0, multiprocess=True)
    yield llm
    llm.shutdown()


def _client(llm: Any) -> AsyncEngineClient:
    return llm.engine.client  # type: ignore[no-any-return]


def test_greedy_outputs_equal_the_in_process_engine(llm_fp32: Any, mp_llm: Any) -> None:
    params = [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=24, temperature=0.0, stop=["\n"]),
    ]
    for p in params:
        want = llm_fp32.generate(PROMPTS, p, use_tqdm=False)
        got = mp_llm.generate(PROMPTS, p, use_tqdm=False)
        for w, g in zip(want, got, strict=True):
            assert g.prompt_token_ids == w.prompt_token_ids
            assert g.finished and g.error is None
            for ws, gs in zip(w.outputs, g.outputs, strict=True):
                assert (gs.token_ids, gs.text, gs.finish_reason, gs.stop_reason) == (
                    ws.token_ids,
                    ws.text,
                    ws.finish_reason,
                    ws.stop_reason,
                )


def test_token_id_prompts_and_n_samples(llm_fp32: Any, mp_llm: Any) -> None:
    p = SamplingParams(max_tokens=8, temperature=0.0, n=2, logprobs=2)
    ids = llm_fp32.get_tokenizer().encode("Hello there")
    (want,) = llm_fp32.generate([ids], p, use_tqdm=False)
    (got,) = mp_llm.generate([ids], p, use_tqdm=False)
    for ws, gs in zip(want.outputs, got.outputs, strict=True):
        assert gs.token_ids == ws.token_ids and gs.text == ws.text
        assert gs.logprobs is not None and ws.logprobs is not None
        assert [sorted(e) for e in gs.logprobs] == [sorted(e) for e in ws.logprobs]
        assert gs.cumulative_logprob == pytest.approx(ws.cumulative_logprob, abs=1e-4)


def _collect(llm: Any, req: GenerateRequest) -> list[Any]:
    async def run() -> list[Any]:
        return [d async for d in _client(llm).generate(req)]

    return llm.engine.call(run())  # type: ignore[no-any-return]


def test_invalid_requests_are_rejected_as_invalid_request(mp_llm: Any) -> None:
    p = SamplingParams(max_tokens=4)
    both = GenerateRequest(request_id="bad-1", params=p, prompt="x", prompt_token_ids=[1])
    too_long = GenerateRequest(request_id="bad-2", params=SamplingParams(max_tokens=10**6), prompt="x")
    for req in (both, too_long):
        (d,) = _collect(mp_llm, req)
        assert d.finished and d.error and d.error_kind == "invalid_request", d


def test_first_delta_carries_the_prompt_and_echo(mp_llm: Any) -> None:
    p = SamplingParams(max_tokens=3, temperature=0.0)
    msgs = [{"role": "user", "content": "Hi"}]
    from pagebus.bus.messages import ChatMessage

    req = GenerateRequest(request_id="chat-1", params=p, messages=[ChatMessage(**m) for m in msgs], echo=True)
    deltas = _collect(mp_llm, req)
    first = deltas[0]
    template = mp_llm.get_tokenizer().apply_chat_template(msgs)
    assert first.prompt_text == template
    assert first.prompt_token_ids == mp_llm.get_tokenizer().encode(template, add_special_tokens=False)
    assert all(d.prompt_token_ids is None for d in deltas[1:])
    assert deltas[-1].finished and sum(len(s.new_token_ids) for d in deltas for s in d.samples) == 3


def test_closing_the_iterator_aborts_the_request(mp_llm: Any) -> None:
    client = _client(mp_llm)

    async def run() -> None:
        p = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        gen = client.generate(GenerateRequest(request_id="gone", params=p, prompt="Count: 1, 2,"))
        await gen.__anext__()
        await gen.aclose()  # what a client disconnect does
        assert client.num_unfinished == 0
        # The scheduler frees the request: a later request still runs, and the engine empties.
        p4 = SamplingParams(max_tokens=4, temperature=0.0)
        deltas = [
            d async for d in client.generate(GenerateRequest(request_id="after", params=p4, prompt="a"))
        ]
        assert deltas[-1].finished
        assert client.latest_stats is not None and client.latest_stats.num_running <= 1

    mp_llm.engine.call(run())


def test_tokenize_and_detokenize(mp_llm: Any) -> None:
    client, tok = _client(mp_llm), mp_llm.get_tokenizer()
    res = mp_llm.engine.call(client.tokenize(TokenizeRequest(request_id="t1", prompt="hello world")))
    assert res.token_ids == tok.encode("hello world") and res.error is None
    assert mp_llm.engine.call(client.detokenize(res.token_ids)) == "hello world"
    bad = mp_llm.engine.call(client.tokenize(TokenizeRequest(request_id="t2")))
    assert bad.error


def test_step_level_api_works_across_processes(llm_fp32: Any, mp_llm: Any) -> None:
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = {o.prompt: o.outputs[0].token_ids for o in llm_fp32.generate(PROMPTS[:3], p, use_tqdm=False)}
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    ids = {mp_llm.add_request(prompt, p): prompt for prompt in PROMPTS[:3]}
    gone = mp_llm.add_request("Count: 1, 2,", long)
    mp_llm.abort_request([gone])
    done: dict[str, Any] = {}
    while mp_llm.has_unfinished_requests():
        for out in mp_llm.step():
            if out.finished:
                done[out.request_id] = out
    assert done[gone].outputs[0].finish_reason == "abort"
    assert {ids[r]: done[r].outputs[0].token_ids for r in ids} == want
    assert mp_llm.step() == [] and not mp_llm.has_unfinished_requests()
