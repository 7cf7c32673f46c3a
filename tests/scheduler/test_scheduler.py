"""Scheduler unit tests: exact batches, block ids, stops and errors on small hand-made cases."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bus.messages import BatchResult, CachedSeq, ExecuteBatch, FinishReason, NewSeq, TokenLogprobs
from scheduler import hashing
from scheduler.hashing import BlockHash
from scheduler.scheduler import Scheduler
from tests.scheduler.harness import (
    FakeWorker,
    Outputs,
    assert_pool_whole,
    expected_output,
    fake_token,
    make_req,
    make_sched,
    run_to_end,
    step,
)


def start(sched: Scheduler) -> tuple[FakeWorker, Outputs]:
    return FakeWorker(sched.block_size), Outputs()


def plan(batch: ExecuteBatch) -> dict[str, tuple[int, int]]:
    """seq id -> (num_computed_tokens, num_scheduled_tokens)."""
    seqs = [*batch.new_seqs, *batch.cached_seqs]
    return {s.seq_id: (s.num_computed_tokens, s.num_scheduled_tokens) for s in seqs}


def new_seq(batch: ExecuteBatch, seq_id: str) -> NewSeq:
    (ns,) = [s for s in batch.new_seqs if s.seq_id == seq_id]
    return ns


def cached_seq(batch: ExecuteBatch, seq_id: str) -> CachedSeq:
    (cs,) = [s for s in batch.cached_seqs if s.seq_id == seq_id]
    return cs


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

    # Another request with the same prompt shares only when prefix caching is on.
    sched.add_request(make_req("s", prompt, max_tokens=1))
    b = step(sched, worker, out)
    assert b is not None and plan(b) == {"s#0": (8, 2) if enable_prefix_caching else (0, 10)}


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
    b2 = step(sched, worker, out)
    # a needs a second block and takes the last; b, the tail, must then preempt itself.
    assert b2 is not None and plan(b2) == {"a#0": (4, 1)} and b2.finished_seq_ids == ["b#0"]
    assert sched.stats().num_preemptions == 1 and sched.waiting[0].seq_id == "b#0"
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
    code = "import sys, scheduler.scheduler; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
