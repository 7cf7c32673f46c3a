"""Scheduler request lifecycle: admission errors, stops, aborts, updates and the call contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pagebus.bus.messages import BatchResult, FinishReason, SampleKey, TokenLogprobs

from tests.scheduler.harness import (
    assert_pool_whole,
    expected_output,
    fake_token,
    make_req,
    make_sched,
    run_to_end,
    start,
    step,
)


# ---------------------------------------------------------------- admission
@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "message"),
    [
        (0, 16, "prompt is empty; send at least one token"),
        (9000, 16, "prompt has 9000 tokens and max_tokens is 16, but max_model_len is 8192; "),
        (8192, None, "prompt has 8192 tokens, but max_model_len is 8192; shorten the prompt"),
        (8000, 193, "prompt has 8000 tokens and max_tokens is 193, but max_model_len is 8192"),
        (4000, 81, "prompt has 4000 tokens and max_tokens is 81, which needs 256 KV blocks of 16 tokens, "
         "but the KV cache has only 255"),
    ],
)  # fmt: skip
def test_admission_rejects_what_can_never_run(prompt_len: int, max_tokens: int | None, message: str) -> None:
    sched = make_sched(num_blocks=256, max_model_len=8192, block_size=16)
    req = make_req("r", [5] * prompt_len, max_tokens=max_tokens, n=2)
    updates = sched.add_request(req)
    assert [(u.request_id, u.sample_index, u.finish_reason) for u in updates] == [
        ("r", 0, FinishReason.ERROR),
        ("r", 1, FinishReason.ERROR),
    ]
    assert updates[0].error is not None and updates[0].error.startswith(message)
    assert updates[0].num_prompt_tokens == prompt_len
    assert not sched.has_unfinished() and sched.schedule() is None


def test_admission_accepts_the_largest_request_that_fits() -> None:
    sched = make_sched(num_blocks=256, max_model_len=8192, block_size=16)
    assert sched.add_request(make_req("a", [5] * 4000, max_tokens=80)) == []  # exactly 255 blocks
    assert sched.add_request(make_req("a", [5], max_tokens=1))[0].error == (
        "request_id 'a' is already in use by an unfinished request"
    )


def test_max_tokens_none_runs_to_max_model_len() -> None:
    sched = make_sched(max_model_len=12)
    worker, out = start(sched)
    sched.add_request(make_req("r", [1, 2, 3, 4, 5], max_tokens=None))
    run_to_end(sched, worker, out)
    assert len(out.tokens[("r", 0)]) == 7 and out.finish[("r", 0)] is FinishReason.LENGTH


# ---------------------------------------------------------------- stops
PROMPT = [10, 20, 30]
FIRST = fake_token(sum(PROMPT), 0)


def run_one(eos: int | None, **params: object) -> tuple[list[int], FinishReason, int | None]:
    sched = make_sched(eos=eos)
    worker, out = start(sched)
    sched.add_request(make_req("r", PROMPT, **params))
    run_to_end(sched, worker, out)
    assert_pool_whole(sched)
    last = out.updates[-1]
    assert (
        out.tokens[("r", 0)] == expected_output(PROMPT, 0, make_req("r", [1], **params).params, eos, 256)[0]
    )
    return out.tokens[("r", 0)], out.finish[("r", 0)], last.stop_token_id


def test_eos_stops_and_min_tokens_suppresses_an_early_eos() -> None:
    tokens, reason, stop_id = run_one(eos=FIRST, max_tokens=8)
    assert tokens == [FIRST] and reason is FinishReason.STOP and stop_id is None
    tokens, reason, _ = run_one(eos=FIRST, max_tokens=8, min_tokens=3)
    assert tokens[0] == FIRST and len(tokens) >= 3


def test_ignore_eos_runs_to_max_tokens() -> None:
    tokens, reason, _ = run_one(eos=FIRST, max_tokens=8, ignore_eos=True)
    assert tokens[0] == FIRST and len(tokens) == 8 and reason is FinishReason.LENGTH


def test_stop_token_ids_stop_and_are_reported() -> None:
    tokens, reason, stop_id = run_one(eos=None, max_tokens=8, stop_token_ids=[FIRST])
    assert tokens == [FIRST] and reason is FinishReason.STOP and stop_id == FIRST
    tokens, _, _ = run_one(eos=None, max_tokens=8, stop_token_ids=[FIRST], min_tokens=2)
    assert len(tokens) >= 2


def test_finished_sequences_are_dropped_in_the_next_batch() -> None:
    sched = make_sched()
    worker, out = start(sched)
    sched.add_request(make_req("a", [1, 2], max_tokens=1))
    b1 = step(sched, worker, out)
    assert b1 is not None and b1.finished_seq_ids == [] and out.finish[("a", 0)] is FinishReason.LENGTH
    assert sched.schedule() is None  # nothing to run
    sched.add_request(make_req("b", [1, 2], max_tokens=1))
    b2 = step(sched, worker, out)
    assert b2 is not None and b2.finished_seq_ids == ["a#0"] and b2.step_id == b1.step_id + 1


def test_logprobs_pass_through_to_updates() -> None:
    sched = make_sched()
    sched.add_request(make_req("r", [1, 2], max_tokens=2, logprobs=1))
    batch = sched.schedule()
    assert batch is not None
    lp = TokenLogprobs(token_id=7, logprob=-0.5, rank=1, top_token_ids=[7], top_logprobs=[-0.5])
    (u,) = sched.update(
        batch, BatchResult(step_id=batch.step_id, seq_ids=["r#0"], token_ids=[7], logprobs=[lp])
    )
    assert u.new_token_ids == [7] and u.logprobs == [lp] and u.finish_reason is None
    batch = sched.schedule()
    assert batch is not None
    (u,) = sched.update(batch, BatchResult(step_id=batch.step_id, seq_ids=["r#0"], token_ids=[8]))
    assert u.new_token_ids == [8] and u.logprobs == [] and u.finish_reason is FinishReason.LENGTH


# ---------------------------------------------------------------- abort
def test_abort_frees_blocks_at_once_and_drops_the_sequences() -> None:
    sched = make_sched(num_blocks=16)
    worker, out = start(sched)
    sched.add_request(make_req("a", list(range(1, 10)), n=2, max_tokens=5))
    step(sched, worker, out)
    assert sched.num_free_blocks < 15
    updates = sched.abort(["a", "nope", "a"])
    assert [(u.request_id, u.sample_index, u.finish_reason) for u in updates] == [
        ("a", 0, FinishReason.ABORT),
        ("a", 1, FinishReason.ABORT),
    ]
    assert sched.num_free_blocks == 15 and not sched.has_unfinished()
    sched.add_request(make_req("w", [1], max_tokens=1))
    assert [u.finish_reason for u in sched.abort(["w"])] == [FinishReason.ABORT]  # never scheduled
    sched.add_request(make_req("b", [1], max_tokens=1))
    b = step(sched, worker, out)
    assert b is not None and sorted(b.finished_seq_ids) == ["a#0", "a#1"]  # "w" never reached the worker
    assert_pool_whole(sched)


def test_abort_of_one_sample_leaves_its_siblings_running() -> None:
    sched = make_sched(num_blocks=16)
    worker, out = start(sched)
    sched.add_request(make_req("a", list(range(1, 10)), n=2, max_tokens=5))
    step(sched, worker, out)
    updates = sched.abort([], [SampleKey("a", 1)])
    assert [(u.request_id, u.sample_index, u.finish_reason) for u in updates] == [
        ("a", 1, FinishReason.ABORT)
    ]
    assert sched.has_unfinished() and sched.stats().num_running == 1
    while sched.has_unfinished():
        step(sched, worker, out)
    assert sched.abort(["a"], [SampleKey("a", 0)]) == []
    assert_pool_whole(sched)


def test_a_request_id_with_a_hash_is_just_an_id() -> None:
    sched = make_sched(num_blocks=16)
    worker, out = start(sched)
    sched.add_request(make_req("a", [1, 2, 3], n=2, max_tokens=5))
    sched.add_request(make_req("a#1", [4, 5, 6], max_tokens=5))
    step(sched, worker, out)
    updates = sched.abort([], [SampleKey("a", 1)])
    assert [(u.request_id, u.sample_index) for u in updates] == [("a", 1)]
    assert sorted(sched.requests) == ["a", "a#1"]
    updates = sched.abort(["a#1"])
    assert [(u.request_id, u.sample_index) for u in updates] == [("a#1", 0)]
    assert [s.sample_index for s in sched.requests["a"]] == [0]
    run_to_end(sched, worker, out)
    assert_pool_whole(sched)


def test_results_for_a_sequence_aborted_during_the_step_are_ignored() -> None:
    sched = make_sched()
    worker, out = start(sched)
    sched.add_request(make_req("a", [1, 2, 3], max_tokens=3))
    sched.add_request(make_req("b", [4, 5, 6], max_tokens=3))
    batch = sched.schedule()
    assert batch is not None
    result = worker.step(batch)
    sched.abort(["a"])
    updates = sched.update(batch, result)
    assert [u.request_id for u in updates] == ["b"]
    run_to_end(sched, worker, out)
    assert_pool_whole(sched)


# ---------------------------------------------------------------- contract
def test_calls_out_of_order_are_errors() -> None:
    sched = make_sched()
    sched.add_request(make_req("a", [1, 2], max_tokens=2))
    batch = sched.schedule()
    assert batch is not None
    with pytest.raises(RuntimeError, match="before update"):
        sched.schedule()
    with pytest.raises(RuntimeError, match="result of step 9"):
        sched.update(batch, BatchResult(step_id=9, seq_ids=[], token_ids=[]))
    with pytest.raises(RuntimeError, match="sampled no token for a#0"):
        sched.update(batch, BatchResult(step_id=batch.step_id, seq_ids=[], token_ids=[]))


def test_stats_count_sequences_blocks_and_steps() -> None:
    sched = make_sched(num_blocks=11, max_num_seqs=1)
    worker, out = start(sched)
    sched.add_request(make_req("a", list(range(1, 9)), max_tokens=4))
    sched.add_request(make_req("b", [1], max_tokens=4))
    step(sched, worker, out)
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.num_steps) == (1, 1, 1)
    assert (s.num_free_blocks, s.num_total_blocks, s.kv_usage) == (8, 10, pytest.approx(0.2))
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions) == (8, 0, 0)


def test_scheduler_does_not_import_torch() -> None:
    code = "import sys, pagebus.scheduler.scheduler; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
