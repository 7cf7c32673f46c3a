"""Scheduling under hostile load, on the scheduler with the fake worker (no model): the
per-request token bound, the starvation bound it gives, and priority preemption."""

from __future__ import annotations

import pytest
from pagebus.scheduler.scheduler import Scheduler

from tests.scheduler.harness import (
    Outputs,
    assert_pool_whole,
    expected_output,
    make_req,
    make_sched,
    run_to_end,
    start,
    step,
)


def _check_outputs(sched: Scheduler, out: Outputs, reqs: dict[str, tuple[list[int], int]]) -> None:
    """Every request's tokens equal what it would produce alone (recompute changes nothing)."""
    for rid, (prompt, max_tokens) in reqs.items():
        params = make_req(rid, prompt, max_tokens=max_tokens).params
        assert out.tokens[(rid, 0)] == expected_output(prompt, 0, params, None, sched.max_model_len)[0], rid


def test_request_token_bound_counts_whole_blocks_and_names_itself() -> None:
    sched = make_sched(num_blocks=33, max_request_tokens=64)  # block_size 4
    assert sched.add_request(make_req("fits", [1] * 6, max_tokens=10, n=4)) == []  # 4 x 16 = 64
    (u, *_) = sched.add_request(make_req("over", [1] * 6, max_tokens=11, n=4))  # 4 x 20 in blocks
    assert u.error is not None and "max_request_tokens (64)" in u.error and "4 x (6 + 11)" in u.error
    # The default is the cache's capacity: 32 usable blocks of 4 tokens.
    default = make_sched(num_blocks=33, max_request_tokens=None)
    assert default.max_request_tokens == 128
    assert default.add_request(make_req("cache", [1] * 8, max_tokens=24, n=4)) == []
    assert default.add_request(make_req("more", [1] * 8, max_tokens=28, n=4))[0].error


@pytest.mark.parametrize("n", [1, 4])
def test_a_small_request_behind_a_maximal_one_gets_its_first_token_within_the_bound(n: int) -> None:
    # A maximal request fits the cache whole (the bound counts whole blocks), so nothing preempts
    # it: it ends within ceil(n x prompt / budget) + max_tokens steps, and the small one's first
    # token follows within ceil(its prompt / budget) more.
    budget, usable, bs = 8, 32, 4
    sched = make_sched(num_blocks=usable + 1, max_request_tokens=None, max_num_batched_tokens=budget)
    worker, out = start(sched)
    prompt = [(7 * j) % 50 + 3 for j in range(12)]
    max_tokens = usable * bs // n - len(prompt)
    assert sched.add_request(make_req("big", prompt, max_tokens=max_tokens, n=n, ignore_eos=True)) == []
    step(sched, worker, out)
    small = [5, 6, 7, 8, 9]
    assert sched.add_request(make_req("small", small, max_tokens=2)) == []
    bound = -(-n * len(prompt) // budget) + max_tokens + -(-len(small) // budget)
    steps = 0
    while not out.tokens[("small", 0)]:
        assert step(sched, worker, out) is not None
        steps += 1
    assert steps <= bound, (steps, bound)
    run_to_end(sched, worker, out)
    assert all(len(out.tokens[("big", i)]) == max_tokens for i in range(n))
    assert_pool_whole(sched)


def test_priority_head_takes_a_seat_from_a_running_lower_priority_request() -> None:
    sched = make_sched(max_num_seqs=2, scheduling_policy="priority")
    worker, out = start(sched)
    reqs = {"low-a": ([1, 2, 3], 12), "low-b": ([4, 5, 6], 12), "high": ([7, 8, 9], 4)}
    for rid in ("low-a", "low-b"):
        sched.add_request(make_req(rid, reqs[rid][0], max_tokens=reqs[rid][1], priority=5))
    step(sched, worker, out)
    step(sched, worker, out)
    sched.add_request(make_req("high", reqs["high"][0], max_tokens=4, priority=0))
    b = step(sched, worker, out)
    # The seats are full: high runs at once; the running tail (the later low) is recomputed later.
    assert b is not None and b.finished_seq_ids == ["low-b#0"]
    assert {s.seq_id for s in b.new_seqs} == {"high#0"}
    assert sched.stats().num_preemptions == 1
    run_to_end(sched, worker, out)
    _check_outputs(sched, out, reqs)
    assert_pool_whole(sched)


def test_priority_head_takes_blocks_from_running_lower_priority_requests() -> None:
    sched = make_sched(num_blocks=9, scheduling_policy="priority")  # 8 usable blocks of 4
    worker, out = start(sched)
    reqs = {"low": ([1] * 12, 8), "low2": ([2] * 8, 8), "high": ([3] * 16, 4)}
    sched.add_request(make_req("low", reqs["low"][0], max_tokens=8, priority=1))
    sched.add_request(make_req("low2", reqs["low2"][0], max_tokens=8, priority=2))
    step(sched, worker, out)
    step(sched, worker, out)
    sched.add_request(make_req("high", reqs["high"][0], max_tokens=4, priority=0))
    b = step(sched, worker, out)
    assert b is not None and "high#0" in {s.seq_id for s in b.new_seqs}
    assert "low2#0" in b.finished_seq_ids  # the lowest priority gave its blocks first
    run_to_end(sched, worker, out)
    _check_outputs(sched, out, reqs)
    assert_pool_whole(sched)


def test_fcfs_never_preempts_for_a_waiting_request() -> None:
    sched = make_sched(max_num_seqs=1)
    worker, out = start(sched)
    sched.add_request(make_req("first", [1, 2], max_tokens=6, priority=9))
    step(sched, worker, out)
    sched.add_request(make_req("urgent", [3, 4], max_tokens=2, priority=-9))
    run_to_end(sched, worker, out)
    assert sched.stats().num_preemptions == 0
    firsts = [s.seq_id for b in out.batches for s in b.new_seqs]
    assert firsts == ["first#0", "urgent#0"]


def test_equal_priority_waits_instead_of_preempting() -> None:
    sched = make_sched(max_num_seqs=1, scheduling_policy="priority")
    worker, out = start(sched)
    sched.add_request(make_req("a", [1, 2], max_tokens=6, priority=3, arrival_time=1.0))
    step(sched, worker, out)
    sched.add_request(make_req("b", [3, 4], max_tokens=2, priority=3, arrival_time=2.0))
    run_to_end(sched, worker, out)
    assert sched.stats().num_preemptions == 0


def test_tenants_with_different_cache_salts_never_share_a_block_id() -> None:
    # Three tenants send the same prompt, concurrently and one after another; a block id is only
    # ever shared between requests of the same salt.
    sched = make_sched(num_blocks=64)
    worker, out = start(sched)
    prompt = [(5 * j) % 40 + 3 for j in range(17)]  # 4 full blocks of 4, and one token
    salts = {"a1": "alice", "b1": "bob", "n1": None, "a2": "alice", "b2": "bob", "n2": None}
    owners: dict[int, set[str | None]] = {}
    for wave in (("a1", "b1", "n1"), ("a2", "b2", "n2")):
        for rid in wave:
            sched.add_request(make_req(rid, prompt, max_tokens=3, cache_salt=salts[rid]))
        while sched.has_unfinished():
            batch = step(sched, worker, out)
            assert batch is not None
            for s in batch.new_seqs:
                for block in s.block_ids:
                    owners.setdefault(block, set()).add(salts[s.seq_id.split("#")[0]])
    assert all(len(tenants) == 1 for tenants in owners.values()), owners
    hits = {u.request_id: u.num_cached_tokens for u in out.updates}
    assert hits == {
        "a1": 0,
        "b1": 0,
        "n1": 0,
        "a2": 16,
        "b2": 16,
        "n2": 16,
    }  # unsalted share among themselves
    assert_pool_whole(sched)
