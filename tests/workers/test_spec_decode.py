"""Speculative decoding on the default model: the same tokens as without it.

Greedy: n-gram speculation with k = 1..5 (spread over the tests) (mixed batches: the copying prompt drafts, the others
mostly do not; prefix caching on and off), one sequence alone, and through preemption all give the
non-speculative tokens. Seeded sampling: verification samples each position with that
position's own noise, so a seeded request draws the very tokens (and logprobs) it draws without
speculation; that is the exactness argument of workers/spec/verify.py checked end to end.
"""

from __future__ import annotations

import msgspec
import pytest
from pagebus.bus.config import EngineConfig, SpeculativeConfig
from pagebus.bus.messages import AddRequest, SamplingParams, TokenLogprobs
from pagebus.scheduler.scheduler import Scheduler

from tests.workers.oracle import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# prompt lookup's drafts are mostly right for these two (the greedy output copies from the prompt)
COPY = ["x = [1, 2, 3]\ny = [1, 2, 3]\nz = [", "Count: " + "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, " * 2 + "1, 2, 3,"]


def _spec(k: int) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, disable_by_batch_size=64)


def run(runner, prompts, cfg: EngineConfig, params=GREEDY, num_blocks: int | None = None):
    """Token ids (and logprobs) per prompt through a fresh scheduler over the shared runner."""
    sched = Scheduler(cfg, num_blocks or runner.num_blocks, runner.max_model_len, None, hash_seed=b"s")
    for i, ids in enumerate(prompts):
        p = params if isinstance(params, SamplingParams) else params[i]
        assert not sched.add_request(AddRequest(request_id=str(i), prompt_token_ids=ids, params=p))
    toks: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    lps: dict[str, list[TokenLogprobs]] = {str(i): [] for i in range(len(prompts))}
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch is not None
        for u in sched.update(batch, runner.execute(batch)):
            toks[u.request_id] += u.new_token_ids
            lps[u.request_id] += u.logprobs
    st = sched.stats()
    assert st.num_free_blocks == st.num_total_blocks
    return [toks[str(i)] for i in range(len(prompts))], [lps[str(i)] for i in range(len(prompts))], st


@pytest.fixture(scope="module")
def runner(llm_fp32):
    return llm_fp32.engine.runner


@pytest.fixture(scope="module")
def prompts(llm_fp32) -> list[list[int]]:
    return [llm_fp32.tokenizer.encode(p) for p in [PROMPTS[0], PROMPTS[5], *COPY]]


@pytest.fixture(scope="module")
def reference(runner, prompts) -> list[list[int]]:
    return run(runner, prompts, runner.cfg)[0]


@pytest.mark.parametrize("k", [1, 3, 5])  # 2 and 4 below
def test_greedy_ngram_equals_plain(runner, prompts, reference, k: int) -> None:
    cfg = msgspec.structs.replace(runner.cfg, speculative_config=_spec(k), enable_prefix_caching=k % 2 == 1)
    got, _, st = run(runner, prompts, cfg)
    assert got == reference
    assert st.spec_num_drafts > 0 and st.spec_num_accepted_tokens > 0
    assert len(st.spec_drafted_per_position) == k


def test_greedy_alone_and_through_preemption(runner, prompts, reference) -> None:
    last = len(prompts) - 1  # a COPY prompt
    cfg = msgspec.structs.replace(runner.cfg, speculative_config=_spec(2))
    assert run(runner, [prompts[last]], cfg)[0] == [reference[last]]
    # 8 blocks of 16 for sequences that need 10 together: they preempt each other
    cfg = msgspec.structs.replace(runner.cfg, speculative_config=_spec(4))
    got, _, st = run(runner, prompts, cfg, num_blocks=9)
    assert st.num_preemptions > 0 and st.spec_num_accepted_tokens > 0
    assert got == reference


def test_seeded_sampling_draws_the_same_tokens_and_logprobs(runner, prompts) -> None:
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=12, logprobs=2, ignore_eos=True)
        for i in range(len(prompts))
    ]
    plain, plain_lps, _ = run(runner, prompts, runner.cfg, params)
    cfg = msgspec.structs.replace(runner.cfg, speculative_config=_spec(3))
    got, got_lps, st = run(runner, prompts, cfg, params)
    assert st.spec_num_drafts > 0
    assert got == plain
    for a, b in zip(got_lps, plain_lps, strict=True):
        assert [x.top_token_ids for x in a] == [x.top_token_ids for x in b]
        assert [x.logprob for x in a] == pytest.approx([x.logprob for x in b], abs=1e-4)
