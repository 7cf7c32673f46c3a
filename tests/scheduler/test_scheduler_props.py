"""Hypothesis over random arrivals, prompts, budgets, aborts and tiny caches.

Every step checks the budget, seats, block tables and pool invariants (see harness);
at the end every request must have finished exactly as an unconstrained run would
(or been aborted with a prefix of that output), and the pool must be whole.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pagebus.bus.messages import ExecuteBatch, FinishReason, SeqUpdate
from pagebus.scheduler.scheduler import Scheduler

from tests.scheduler.harness import (
    FakeWorker,
    Outputs,
    assert_pool_whole,
    check_batch,
    check_invariants,
    expected_output,
    make_req,
    make_sched,
)

# Prompts draw from a few shared stems so prefix hits and collisions of interest happen.
STEMS = [[3, 4, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 11, 12, 13, 14], [20] * 8]


@dataclass
class Spec:
    prompt: list[int]
    max_tokens: int | None
    n: int
    min_tokens: int
    priority: int
    cache_salt: str | None
    arrival_step: int
    abort_step: int | None  # abort before this step's schedule()
    abort_in_flight: bool  # abort between the worker's run and update() instead

    def params(self) -> dict[str, object]:
        min_tokens = min(self.min_tokens, self.max_tokens or self.min_tokens)
        return {"max_tokens": self.max_tokens, "n": self.n, "min_tokens": min_tokens}


specs = st.builds(
    Spec,
    prompt=st.builds(
        lambda stem, cut, tail: stem[:cut] + tail,
        st.sampled_from(STEMS),
        st.integers(0, 8),
        st.lists(st.integers(3, 30), max_size=14),
    ),
    max_tokens=st.one_of(st.integers(1, 12), st.none()),
    n=st.integers(1, 3),
    min_tokens=st.integers(0, 2),
    priority=st.integers(-1, 1),
    cache_salt=st.sampled_from([None, None, "s"]),
    arrival_step=st.integers(0, 12),
    abort_step=st.one_of(st.none(), st.none(), st.integers(0, 30)),
    abort_in_flight=st.booleans(),
)

configs = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "max_num_batched_tokens": st.integers(1, 40),
        "max_num_seqs": st.integers(1, 6),
        "enable_prefix_caching": st.booleans(),
        "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    }
)


def would_reject(spec: Spec, num_blocks: int, block_size: int, max_model_len: int) -> bool:
    p = len(spec.prompt)
    mt = spec.max_tokens if spec.max_tokens is not None else max_model_len - p
    return p == 0 or mt < 1 or p + mt > max_model_len or -(-(p + mt) // block_size) > num_blocks - 1


def add(sched: Scheduler, rid: str, spec: Spec, now: int) -> list[SeqUpdate]:
    extra = {"priority": spec.priority, "cache_salt": spec.cache_salt, "arrival_time": float(now)}
    return sched.add_request(make_req(rid, spec.prompt, **spec.params(), **extra))


@pytest.mark.parametrize("lookahead", [False, True], ids=["sync", "async"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=configs,
    spare_blocks=st.integers(-2, 12),
    max_model_len=st.integers(4, 48),
    eos=st.one_of(st.none(), st.integers(3, 99)),
    reqs=st.lists(specs, min_size=1, max_size=10),
)
def test_random_workloads_finish_correctly_and_leak_nothing(
    lookahead: bool, cfg: dict, spare_blocks: int, max_model_len: int, eos: int | None, reqs: list[Spec]
) -> None:
    """`lookahead` (async scheduling): the next step is planned before each result, as the
    scheduler process does, and the outputs must be the same."""
    # Around the size one max_model_len sequence needs: tight enough to preempt often.
    num_blocks = max(2, -(-max_model_len // cfg["block_size"]) + 1 + spare_blocks)
    sched = make_sched(
        num_blocks=num_blocks, max_model_len=max_model_len, eos=eos, lookahead=lookahead, **cfg
    )
    worker, out = FakeWorker(sched.block_size), Outputs()
    named = {f"r{i}": spec for i, spec in enumerate(reqs)}
    rejected: set[str] = set()
    aborted: set[str] = set()
    in_flight: deque[ExecuteBatch] = deque()
    planned_ahead = 0
    now = 0
    while now <= 12 or sched.has_unfinished() or in_flight:
        assert now < 5_000, "no progress"
        for rid, spec in named.items():
            if spec.arrival_step == now:
                errors = add(sched, rid, spec, now)
                assert bool(errors) == would_reject(spec, num_blocks, cfg["block_size"], max_model_len)
                assert all(u.finish_reason is FinishReason.ERROR and u.error for u in errors)
                rejected |= {rid} if errors else set()
            if spec.abort_step == now and not spec.abort_in_flight:
                out.record(sched.abort([rid]))
                aborted.add(rid)
        while len(in_flight) < sched.max_in_flight:
            planned = sched.schedule()
            if planned is None:
                break
            check_batch(sched, planned, worker, ahead=bool(in_flight))
            planned_ahead += bool(in_flight)
            in_flight.append(planned)
        if in_flight:
            batch = in_flight.popleft()
            result = worker.step(batch)
            for rid, spec in named.items():
                if spec.abort_step == now and spec.abort_in_flight:
                    out.record(sched.abort([rid]))
                    aborted.add(rid)
            out.record(sched.update(batch, result))
            check_invariants(sched)
        else:
            assert not sched.has_unfinished(), "unfinished work but nothing scheduled: deadlock"
        now += 1

    assert_pool_whole(sched)
    stats = sched.stats()
    event(f"planned ahead: {planned_ahead > 0}")
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    event(f"aborted: {bool(aborted)}, rejected: {bool(rejected)}")
    event(f"stopped: {FinishReason.STOP in out.finish.values()}")
    for rid, spec in named.items():
        if rid in rejected:
            continue
        params = make_req(rid, [1], **spec.params()).params
        for i in range(spec.n):
            got, reason = out.tokens[(rid, i)], out.finish.get((rid, i))
            want, want_reason = expected_output(spec.prompt, i, params, eos, max_model_len)
            if reason is FinishReason.ABORT:
                assert rid in aborted and got == want[: len(got)]
            else:
                assert (got, reason) == (want, want_reason), (rid, i)
