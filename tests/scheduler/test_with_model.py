"""The scheduler driving the real default model: prefix caching, chunked prefill and
preemption never change greedy output, and they do save the work they claim to."""

from __future__ import annotations

import msgspec
import pytest
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import AddRequest, SamplingParams
from pagebus.scheduler.scheduler import Scheduler

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _drive(sched: Scheduler, runner, prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], int]:
    """Add the prompts and step until all finish; returns tokens by request id and the number of
    tokens the model computed."""
    for rid, ids in prompts.items():
        sched.add_request(AddRequest(request_id=rid, prompt_token_ids=ids, params=PARAMS))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    computed = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch is not None
        computed += sum(s.num_scheduled_tokens for s in (*batch.new_seqs, *batch.cached_seqs))
        for u in sched.update(batch, runner.execute(batch)):
            out[u.request_id].extend(u.new_token_ids)
    return out, computed


def _run(runner, cfg: EngineConfig, prompts: list[list[int]], num_blocks: int | None = None):
    """Run prompts to completion through a fresh scheduler over the shared runner."""
    sched = Scheduler(cfg, num_blocks or runner.num_blocks, runner.max_model_len, None, hash_seed=b"e2e")
    out, computed = _drive(sched, runner, {str(i): ids for i, ids in enumerate(prompts)})
    st = sched.stats()
    assert st.num_free_blocks == st.num_total_blocks  # nothing leaked
    return [out[str(i)] for i in range(len(prompts))], computed, st


@pytest.fixture(scope="module")
def runner(llm_fp32):
    return llm_fp32.engine.runner


@pytest.fixture(scope="module")
def system_prompt(llm_fp32) -> list[int]:
    text = " ".join(f"Rule {i}: answer politely and cite sources." for i in range(120))
    ids = llm_fp32.tokenizer.encode(text)[:1000]
    assert len(ids) == 1000
    return ids


def test_shared_prefix_computes_only_the_suffix(runner, llm_fp32, system_prompt) -> None:
    cfg = msgspec.structs.replace(llm_fp32.config, enable_prefix_caching=True)
    q1 = system_prompt + llm_fp32.tokenizer.encode(" Question: what is 2+2?")
    q2 = system_prompt + llm_fp32.tokenizer.encode(" Question: name a colour.")
    sched = Scheduler(cfg, runner.num_blocks, runner.max_model_len, None, hash_seed=b"p")
    first = _drive(sched, runner, {"q1": q1})[0]["q1"]
    out, computed_second = _drive(sched, runner, {"q2": q2})
    second = out["q2"]
    reused = (1000 // 16) * 16
    assert computed_second == len(q2) - reused + PARAMS.max_tokens - 1  # suffix + decodes only
    assert sched.stats().prefix_cache_hits == reused
    off = msgspec.structs.replace(cfg, enable_prefix_caching=False)
    (ref1, ref2), _, _ = _run(runner, off, [q1, q2])
    assert (first, second) == (ref1, ref2)


def test_chunked_prefill_gives_the_same_tokens(runner, llm_fp32, system_prompt) -> None:
    prompts = [system_prompt[:700], system_prompt[100:180], system_prompt[5:30]]
    whole, _, _ = _run(runner, msgspec.structs.replace(llm_fp32.config, max_num_batched_tokens=2048), prompts)
    chunked, _, st = _run(
        runner, msgspec.structs.replace(llm_fp32.config, max_num_batched_tokens=64), prompts
    )
    assert st.num_steps > 700 // 64  # the long prompt really was split
    assert chunked == whole


def test_preemption_under_a_tiny_cache_gives_the_same_tokens(runner, llm_fp32, system_prompt) -> None:
    prompts = [system_prompt[i * 40 : i * 40 + 30 + i] for i in range(8)]
    free, _, _ = _run(runner, llm_fp32.config, prompts)
    tight, _, st = _run(runner, llm_fp32.config, prompts, num_blocks=12)
    assert st.num_preemptions > 0
    assert tight == free
