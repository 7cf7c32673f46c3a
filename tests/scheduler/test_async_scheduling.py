"""Async scheduling: step N+1 planned before step N's result (Scheduler(lookahead=True)).

The random workloads in test_scheduler_props.py run both ways; these pin down the cases a
step planned ahead must get right one by one.
"""

from __future__ import annotations

import pytest
from pagebus.bus.messages import ExecuteBatch, FinishReason, StructuredOutputsParams
from pagebus.scheduler.scheduler import Scheduler

from tests.scheduler.harness import (
    FakeWorker,
    Outputs,
    assert_pool_whole,
    check_invariants,
    expected_output,
    fake_token,
    make_req,
    make_sched,
    plan,
)


def test_a_decode_is_planned_again_before_its_token_is_known() -> None:
    sched = make_sched(lookahead=True)
    worker, out = FakeWorker(sched.block_size), Outputs()
    sched.add_request(make_req("a", [5, 6, 7], max_tokens=4))
    first = sched.schedule()
    assert first is not None and plan(first) == {"a#0": (0, 3)}
    second = sched.schedule()  # the prompt's step is still in flight
    assert second is not None and plan(second) == {"a#0": (3, 1)}  # its sampled token, unseen
    with pytest.raises(RuntimeError, match="before update"):
        sched.schedule()
    out.record(sched.update(first, worker.step(first)))
    assert out.tokens[("a", 0)] == [fake_token(18, 0)]
    out.record(sched.update(second, worker.step(second)))
    assert len(out.tokens[("a", 0)]) == 2


def _run_ahead(sched: Scheduler, worker: FakeWorker, out: Outputs) -> None:
    """The scheduler process's loop: two steps in flight, results in plan order."""
    in_flight: list[ExecuteBatch] = []
    while sched.has_unfinished() or in_flight:
        while len(in_flight) < 2 and (b := sched.schedule()) is not None:
            in_flight.append(b)
        b = in_flight.pop(0)
        out.record(sched.update(b, worker.step(b)))
        check_invariants(sched)


def test_a_length_finish_is_not_planned_past_its_last_token() -> None:
    sched = make_sched(lookahead=True)
    worker, out = FakeWorker(sched.block_size), Outputs()
    sched.add_request(make_req("a", [5, 6, 7], max_tokens=3))
    _run_ahead(sched, worker, out)
    params = make_req("a", [1], max_tokens=3).params
    assert (out.tokens[("a", 0)], out.finish[("a", 0)]) == expected_output([5, 6, 7], 0, params, None, 256)
    # Three steps (the prompt, then two decodes), none wasted on a fourth token.
    assert sched.stats().num_steps == 3
    assert_pool_whole(sched)


def test_a_stop_token_finish_drops_the_step_already_planned() -> None:
    stop = fake_token(18, 0)  # the first token "a" samples
    sched = make_sched(lookahead=True)
    worker, out = FakeWorker(sched.block_size), Outputs()
    sched.add_request(make_req("a", [5, 6, 7], max_tokens=10, stop_token_ids=[stop]))
    first, second = sched.schedule(), sched.schedule()
    assert first is not None and second is not None and "a#0" in plan(second)
    out.record(sched.update(first, worker.step(first)))
    assert out.finish[("a", 0)] is FinishReason.STOP and out.tokens[("a", 0)] == [stop]
    assert sched.update(second, worker.step(second)) == []  # its token belongs to nobody
    third = sched.schedule()
    assert third is None  # nothing to run; the drop rides the next plan
    sched.add_request(make_req("b", [9, 9], max_tokens=1))
    third = sched.schedule()
    assert third is not None and third.finished_seq_ids == ["a#0"]
    out.record(sched.update(third, worker.step(third)))
    assert "a#0" not in worker.seqs
    assert_pool_whole(sched)


def test_a_reused_request_id_is_not_confused_with_its_old_step_in_flight() -> None:
    stop = fake_token(18, 0)
    sched = make_sched(lookahead=True)
    worker, out = FakeWorker(sched.block_size), Outputs()
    sched.add_request(make_req("a", [5, 6, 7], max_tokens=10, stop_token_ids=[stop]))
    first, second = sched.schedule(), sched.schedule()
    assert first is not None and second is not None
    out.record(sched.update(first, worker.step(first)))  # "a" stops; `second` still holds it
    assert out.finish[("a", 0)] is FinishReason.STOP
    assert not sched.add_request(make_req("a", [8, 8, 8, 8], max_tokens=2))
    out.finish.clear()
    out.tokens.clear()
    third = sched.schedule()  # the new "a" is admitted while the old one's step runs
    assert third is not None and third.finished_seq_ids == ["a#0"] and third.new_seqs[0].seq_id == "a#0"
    assert sched.update(second, worker.step(second)) == []  # the old sequence's: ignored
    out.record(sched.update(third, worker.step(third)))
    _run_ahead(sched, worker, out)
    want = expected_output([8, 8, 8, 8], 0, make_req("a", [1], max_tokens=2).params, None, 256)
    assert (out.tokens[("a", 0)], out.finish[("a", 0)]) == want
    assert_pool_whole(sched)


def test_a_constrained_sequence_waits_for_its_token() -> None:
    sched = make_sched(lookahead=True)
    so = StructuredOutputsParams(choice=["yes", "no"])
    sched.add_request(make_req("a", [5, 6, 7], max_tokens=4, structured_outputs=so))
    sched.add_request(make_req("b", [5, 6, 8], max_tokens=4))
    first, second = sched.schedule(), sched.schedule()
    assert first is not None and second is not None
    assert set(plan(first)) == {"a#0", "b#0"} and set(plan(second)) == {"b#0"}


def test_preemption_while_a_step_is_in_flight_gives_the_unconstrained_output() -> None:
    # Six blocks of 2 tokens for three requests that need 4 blocks each: preempts often.
    sched = make_sched(num_blocks=7, max_model_len=16, lookahead=True, block_size=2)
    worker, out = FakeWorker(sched.block_size), Outputs()
    prompts = {"a": [3, 4, 5], "b": [6, 7, 8], "c": [9, 10, 11]}
    for rid, p in prompts.items():
        sched.add_request(make_req(rid, p, max_tokens=5))
    _run_ahead(sched, worker, out)
    assert sched.stats().num_preemptions > 0
    for rid, p in prompts.items():
        want = expected_output(p, 0, make_req(rid, [1], max_tokens=5).params, None, 16)
        assert (out.tokens[(rid, 0)], out.finish[(rid, 0)]) == want
    assert_pool_whole(sched)


def test_a_tail_preempted_and_readmitted_in_one_plan_ignores_its_old_step() -> None:
    """Priority: a waiting head that does not fit preempts the running tail, which fits again in
    the same plan (its prompt is a prefix hit). The tail's decode still in flight belongs to the
    sequence it was before: that token must not be appended to the recomputing one."""
    # Twenty usable blocks of one token, 16 tokens a step, two seats.
    sched = make_sched(
        num_blocks=21,
        max_model_len=32,
        lookahead=True,
        block_size=1,
        enable_prefix_caching=True,
        scheduling_policy="priority",
        max_num_batched_tokens=16,
        max_num_seqs=2,
    )
    worker, out = FakeWorker(sched.block_size), Outputs()
    low, high = [3, 4, 5, 6, 7, 8, 9], [10 + i for i in range(12)]
    sched.add_request(make_req("low", low, max_tokens=5, priority=1))
    first, second = sched.schedule(), sched.schedule()  # the prompt, then a decode planned ahead
    assert first is not None and second is not None
    out.record(sched.update(first, worker.step(first)))
    sched.add_request(make_req("high", high, max_tokens=2, priority=0))
    third = sched.schedule()  # "low" (8 blocks + 1 to grow) is preempted for "high", then hits 7
    assert third is not None and sched.stats().num_preemptions == 1
    assert "low#0" in third.finished_seq_ids and {s.seq_id for s in third.new_seqs} == {"high#0", "low#0"}
    out.record(sched.update(second, worker.step(second)))  # the old sequence's decode: ignored
    out.record(sched.update(third, worker.step(third)))
    _run_ahead(sched, worker, out)
    for rid, prompt, mt in (("low", low, 5), ("high", high, 2)):
        want = expected_output(prompt, 0, make_req(rid, [1], max_tokens=mt).params, None, 32)
        assert (out.tokens[(rid, 0)], out.finish[(rid, 0)]) == want
    assert_pool_whole(sched)
