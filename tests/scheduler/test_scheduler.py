"""Scheduler batches: chunked prefill, prefix caching, preemption and queue order, with
exact block ids on small hand-made cases."""

from __future__ import annotations

import pytest
from pagebus.bus.messages import FinishReason
from pagebus.scheduler import hashing
from pagebus.scheduler.hashing import BlockHash
from pagebus.scheduler.scheduler import Scheduler

from tests.scheduler.harness import (
    Outputs,
    assert_pool_whole,
    cached_seq,
    expected_output,
    make_req,
    make_sched,
    new_seq,
    plan,
    run_to_end,
    start,
    step,
)


# ---------------------------------------------------------------- chunked prefill
def test_chunked_prefill_splits_a_long_prompt_and_mixes_it_with_decodes() -> None:
    sched = make_sched(max_num_batched_tokens=8)
    worker, out = start(sched)
    sched.add_request(make_req("a", [1, 2, 3], max_tokens=10))
    b1 = step(sched, worker, out)
    assert b1 is not None and plan(b1) == {"a#0": (0, 3)}
    assert new_seq(b1, "a#0").block_ids == [1]
    sched.add_request(make_req("b", list(range(10, 30)), max_tokens=2))  # 20 tokens

    b2 = step(sched, worker, out)
    assert b2 is not None and plan(b2) == {"a#0": (3, 1), "b#0": (0, 7)}
    assert cached_seq(b2, "a#0").new_block_ids == []
    assert new_seq(b2, "b#0").block_ids == [2, 3]
    b3 = step(sched, worker, out)
    assert b3 is not None and plan(b3) == {"a#0": (4, 1), "b#0": (7, 7)}
    assert cached_seq(b3, "a#0").new_block_ids == [4]
    assert cached_seq(b3, "b#0").new_block_ids == [5, 6]
    assert out.tokens[("b", 0)] == []  # a chunk short of the end samples nothing
    b4 = step(sched, worker, out)
    assert b4 is not None and plan(b4) == {"a#0": (5, 1), "b#0": (14, 6)}
    assert cached_seq(b4, "b#0").new_block_ids == [7]
    assert len(out.tokens[("b", 0)]) == 1
    run_to_end(sched, worker, out)
    assert len(out.tokens[("a", 0)]) == 10 and len(out.tokens[("b", 0)]) == 2
    assert_pool_whole(sched)


# ---------------------------------------------------------------- prefix caching
PREFIX = list(range(100, 112))  # three blocks of 4


def test_prefix_hit_on_a_second_request_computes_only_the_suffix() -> None:
    sched = make_sched()
    worker, out = start(sched)
    sched.add_request(make_req("a", [*PREFIX, 50, 51], max_tokens=1))
    b1 = step(sched, worker, out)
    assert b1 is not None
    a_blocks = new_seq(b1, "a#0").block_ids
    assert a_blocks == [1, 2, 3, 4]
    assert not sched.has_unfinished() and sched.num_free_blocks == 63

    sched.add_request(make_req("b", [*PREFIX, 60, 61, 62], max_tokens=1))
    b2 = step(sched, worker, out)
    assert b2 is not None
    nb = new_seq(b2, "b#0")
    assert (nb.num_computed_tokens, nb.num_scheduled_tokens) == (12, 3)
    assert nb.block_ids[:3] == a_blocks[:3]
    assert nb.block_ids[3] not in a_blocks  # the partial block is never shared
    (upd,) = [u for u in out.updates if u.request_id == "b"]
    assert (upd.num_prompt_tokens, upd.num_cached_tokens) == (15, 12)
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (14 + 15, 12)
    assert_pool_whole(sched)


def test_a_full_prompt_hit_still_computes_its_last_token() -> None:
    sched = make_sched()
    worker, out = start(sched)
    sched.add_request(make_req("a", PREFIX, max_tokens=1))
    run_to_end(sched, worker, out)
    sched.add_request(make_req("b", PREFIX, max_tokens=1))
    b = step(sched, worker, out)
    assert b is not None and plan(b) == {"b#0": (8, 4)}  # capped: 2 of 3 blocks hit


def test_different_cache_salt_never_shares() -> None:
    sched = make_sched()
    worker, out = start(sched)
    sched.add_request(make_req("a", [*PREFIX, 1], max_tokens=1, cache_salt="alice"))
    run_to_end(sched, worker, out)
    sched.add_request(make_req("b", [*PREFIX, 1], max_tokens=1, cache_salt="bob"))
    sched.add_request(make_req("c", [*PREFIX, 1], max_tokens=1))
    sched.add_request(make_req("d", [*PREFIX, 1], max_tokens=1, cache_salt="alice"))
    b = step(sched, worker, out)
    assert b is not None and plan(b) == {"b#0": (0, 13), "c#0": (0, 13), "d#0": (12, 1)}
    run_to_end(sched, worker, out)
    assert_pool_whole(sched)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_n_samples_share_the_prompt_blocks(enable_prefix_caching: bool) -> None:
    sched = make_sched(enable_prefix_caching=enable_prefix_caching)
    worker, out = start(sched)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    sched.add_request(make_req("r", prompt, n=3, max_tokens=6))
    b = step(sched, worker, out)
    assert b is not None
    assert plan(b) == {"r#0": (0, 10), "r#1": (8, 2), "r#2": (8, 2)}
    assert [new_seq(b, f"r#{i}").block_ids for i in range(3)] == [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    assert [new_seq(b, f"r#{i}").sample_index for i in range(3)] == [0, 1, 2]
    assert [sched.block_pool.blocks[i].ref_count for i in (1, 2, 3)] == [3, 3, 1]
    run_to_end(sched, worker, out)
    for i in range(3):
        assert (
            out.tokens[("r", i)]
            == expected_output(prompt, i, make_req("r", prompt, max_tokens=6).params, None, 256)[0]
        )
    assert out.tokens[("r", 0)] != out.tokens[("r", 1)]
    assert_pool_whole(sched)

    # A later request with the same prompt shares only when prefix caching is on, even
    # when it reuses the request id.
    sched.add_request(make_req("r", prompt, max_tokens=1))
    b = step(sched, worker, Outputs())
    assert b is not None and plan(b) == {"r#0": (8, 2) if enable_prefix_caching else (0, 10)}
    # The old r#0 is dropped and the new one sent in the same batch: workers drop first.
    assert sorted(b.finished_seq_ids) == ["r#0", "r#1", "r#2"] and b.new_seqs[0].seq_id == "r#0"


def test_a_hash_collision_never_returns_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "hash_block", lambda key: BlockHash(b"same"))
    sched = make_sched()
    worker, out = start(sched)
    sched.add_request(make_req("a", list(range(1, 10)), max_tokens=3))
    run_to_end(sched, worker, out)
    assert len(sched.block_pool.cached) == 1  # every block collided; only the first registered
    sched.add_request(make_req("b", list(range(11, 20)), max_tokens=3))
    b = step(sched, worker, out)
    assert b is not None and plan(b) == {"b#0": (0, 9)}
    run_to_end(sched, worker, out)  # the fake worker checks every position's KV
    assert (
        out.tokens[("b", 0)]
        == expected_output(list(range(11, 20)), 0, make_req("b", [1]).params, None, 256)[0][:3]
    )
    assert_pool_whole(sched)


def test_hashes_are_deterministic_per_seed_and_random_without_one() -> None:
    def first_hash(seed: bytes | None) -> BlockHash:
        sched = Scheduler(make_sched().cfg, 16, 64, None, hash_seed=seed)
        sched.add_request(make_req("a", list(range(9)), max_tokens=1))
        return sched.waiting[0].block_hash(1)

    assert first_hash(b"x") == first_hash(b"x")
    assert first_hash(b"x") != first_hash(b"y")
    assert first_hash(None) != first_hash(None)


# ---------------------------------------------------------------- preemption
def test_preempted_sequence_is_dropped_then_resent_in_full_and_hits_its_own_blocks() -> None:
    sched = make_sched(num_blocks=4)  # 3 usable blocks of 4 tokens
    worker, out = start(sched)
    sched.add_request(make_req("a", [1, 2, 3, 4], max_tokens=4))
    sched.add_request(make_req("b", [5, 6, 7, 8], max_tokens=4))
    b1 = step(sched, worker, out)
    assert b1 is not None and [s.block_ids for s in b1.new_seqs] == [[1], [2]]
    sched.add_request(make_req("c", [9], max_tokens=1))
    b2 = step(sched, worker, out)
    # a needs a second block and takes the last; b, the tail, must then preempt itself,
    # and rejoins waiting at the front, ahead of c. Nothing is admitted after a preemption.
    assert b2 is not None and plan(b2) == {"a#0": (4, 1)} and b2.finished_seq_ids == ["b#0"]
    assert sched.stats().num_preemptions == 1
    assert [s.seq_id for s in sched.waiting] == ["b#0", "c#0"]
    b3 = step(sched, worker, out)
    b4 = step(sched, worker, out)  # a finishes
    assert b3 is not None and b4 is not None and set(plan(b3)) == set(plan(b4)) == {"a#0"}
    b5 = step(sched, worker, out)
    assert b5 is not None and b5.finished_seq_ids == ["a#0"]
    nb = new_seq(b5, "b#0")
    b_first = out.tokens[("b", 0)][:1]
    assert nb.token_ids == [5, 6, 7, 8, *b_first] and nb.prompt_len == 4
    assert (nb.num_computed_tokens, nb.num_scheduled_tokens) == (4, 1)  # its own prompt block hit
    assert nb.block_ids == [2, 3]
    run_to_end(sched, worker, out)
    assert (
        out.tokens[("b", 0)]
        == expected_output([5, 6, 7, 8], 0, make_req("b", [1], max_tokens=4).params, None, 256)[0]
    )
    assert {u.num_cached_tokens for u in out.updates if u.request_id == "b"} == {0}  # first admission
    assert_pool_whole(sched)


def test_preemption_under_a_tiny_cache_gives_the_unconstrained_output() -> None:
    prompts = {f"r{i}": [(7 * i + j) % 50 + 3 for j in range(5 + 3 * i)] for i in range(6)}

    def run(num_blocks: int) -> tuple[Outputs, int]:
        sched = make_sched(num_blocks=num_blocks, max_num_batched_tokens=16)
        worker, out = start(sched)
        for rid, prompt in prompts.items():
            assert sched.add_request(make_req(rid, prompt, max_tokens=12, n=2)) == []
        run_to_end(sched, worker, out)
        assert_pool_whole(sched)
        return out, sched.stats().num_preemptions

    big, big_preemptions = run(256)
    tiny, tiny_preemptions = run(9)  # 8 blocks: the longest sample alone needs 8
    assert big_preemptions == 0 and tiny_preemptions > 0
    assert tiny.tokens == big.tokens
    assert all(len(t) == 12 for t in tiny.tokens.values()) and len(tiny.tokens) == 12
    assert set(tiny.finish.values()) == {FinishReason.LENGTH}


def test_priority_preempts_the_largest_priority_value_not_the_latest_arrival() -> None:
    sched = make_sched(num_blocks=4, scheduling_policy="priority")
    worker, out = start(sched)
    sched.add_request(make_req("low", [1, 2, 3, 4], max_tokens=4, priority=1))
    step(sched, worker, out)
    sched.add_request(make_req("high", [5, 6, 7, 8], max_tokens=4, priority=0))
    b2 = step(sched, worker, out)
    assert b2 is not None and plan(b2) == {"low#0": (4, 1), "high#0": (0, 4)}
    b3 = step(sched, worker, out)
    assert b3 is not None and plan(b3) == {"high#0": (4, 1)} and b3.finished_seq_ids == ["low#0"]
    run_to_end(sched, worker, out)
    assert_pool_whole(sched)


# ---------------------------------------------------------------- ordering
@pytest.mark.parametrize(
    ("policy", "order"),
    [("fcfs", ["p5", "p0", "p0-late", "m1"]), ("priority", ["m1", "p0", "p0-late", "p5"])],
)
def test_admission_order_follows_the_policy(policy: str, order: list[str]) -> None:
    sched = make_sched(max_num_seqs=1, scheduling_policy=policy)
    worker, out = start(sched)
    sched.add_request(make_req("p5", [1], max_tokens=1, priority=5, arrival_time=1.0))
    sched.add_request(make_req("p0", [1], max_tokens=1, priority=0, arrival_time=2.0))
    sched.add_request(make_req("p0-late", [1], max_tokens=1, priority=0, arrival_time=2.0))
    sched.add_request(make_req("m1", [1], max_tokens=1, priority=-1, arrival_time=3.0))
    run_to_end(sched, worker, out)
    assert [s.seq_id for b in out.batches for s in b.new_seqs] == [f"{r}#0" for r in order]


def test_small_requests_never_bypass_a_blocked_head() -> None:
    sched = make_sched(num_blocks=7)  # 6 usable blocks of 4 tokens
    worker, out = start(sched)
    sched.add_request(make_req("long", list(range(1, 13)), max_tokens=8))  # 3 blocks now, 5 at most
    step(sched, worker, out)
    sched.add_request(make_req("big", list(range(50, 66)), max_tokens=1))  # 4 blocks: does not fit yet
    sched.add_request(make_req("small", [1], max_tokens=1))  # would fit
    b = step(sched, worker, out)
    assert b is not None and plan(b) == {"long#0": (12, 1)}
    run_to_end(sched, worker, out)
    firsts = [s.seq_id for b in out.batches for s in b.new_seqs]
    assert firsts.index("big#0") < firsts.index("small#0")
