"""Virtual engines (scheduler/virtual.py): with -pp 2 and two steps in flight the loop keeps two
steps in the pipeline, each over one engine's sequences, with one shared KV block pool; and how the
depth is chosen (bus/config.py steps_in_flight).

The fake worker of harness.py stands in for the last stage: it runs each step when it is
planned (every stage runs the steps in plan order), and the loop hands results back one step
later, as scheduler/main.py does. Its KV fingerprints catch a block that one engine reuses while
another's step still needs it; a mirror of an earlier stage checks that the plans carry every
sampled token (CachedSeq.new_token_ids) before a sequence's next step."""

from __future__ import annotations

import random
from collections import deque

import pytest
from pagebus.bus.config import EngineConfig, make_engine_config, steps_in_flight
from pagebus.bus.messages import BatchResult, CachedSeq, ExecuteBatch
from pagebus.scheduler.scheduler import Scheduler
from pagebus.scheduler.virtual import VirtualEngines

from tests.scheduler.harness import FakeWorker, Outputs, expected_output, make_req


def _engines(num_blocks: int, **cfg: object) -> VirtualEngines:
    config = EngineConfig(block_size=4, max_request_tokens=1 << 30, pipeline_parallel_size=2, **cfg)  # type: ignore[arg-type]
    return VirtualEngines(config, num_blocks, 256, None, 2, hash_seed=b"test")


def _run(ve: VirtualEngines, arrivals: dict[int, list], max_steps: int = 5000) -> tuple[Outputs, int]:
    """The loop of scheduler/main.py at depth 2; requests join at the given loop turns. Returns the
    outputs and the most steps that were in flight at once."""
    worker, out = FakeWorker(4), Outputs()
    stage0: dict[str, list[int]] = {}  # what an earlier stage knows of each sequence's tokens
    in_flight: deque[tuple[ExecuteBatch, BatchResult]] = deque()
    deepest = 0
    for turn in range(max_steps):
        for req in arrivals.get(turn, []):
            assert ve.add_request(req) == []
        if not ve.has_unfinished() and not in_flight and turn > max(arrivals):
            return out, deepest
        while len(in_flight) < 2:
            batch = ve.schedule()
            if batch is None:
                break
            busy = {s.seq_id for b, _ in in_flight for s in [*b.new_seqs, *b.cached_seqs]}
            mine = {s.seq_id for s in [*batch.new_seqs, *batch.cached_seqs]}
            assert not busy & mine, f"a sequence in two steps at once: {busy & mine}"
            for seq_id in batch.finished_seq_ids:
                stage0.pop(seq_id, None)
            for ns in batch.new_seqs:
                stage0[ns.seq_id] = list(ns.token_ids)
            for cs in batch.cached_seqs:
                stage0[cs.seq_id] += cs.new_token_ids
            in_flight.append((batch, worker.step(batch)))  # every stage runs it in plan order
            out.batches.append(batch)
            for s in [*batch.new_seqs, *batch.cached_seqs]:
                assert stage0[s.seq_id] == worker.seqs[s.seq_id].tokens[: len(stage0[s.seq_id])]
            deepest = max(deepest, len(in_flight))
        if in_flight:
            batch, result = in_flight.popleft()
            out.record(ve.update(batch, result))
    raise AssertionError(f"not done after {max_steps} loop turns")


def test_two_engines_keep_two_steps_in_flight_and_give_the_unconstrained_outputs() -> None:
    rng = random.Random(0)
    arrivals: dict[int, list] = {}
    prompts = {}
    for i in range(12):
        prompt = [rng.randrange(3, 90) for _ in range(rng.randrange(1, 30))]
        prompts[f"r{i}"] = prompt
        arrivals.setdefault(rng.randrange(0, 6), []).append(
            make_req(f"r{i}", prompt, max_tokens=rng.randrange(1, 12))
        )
    # 16 blocks of 4 tokens for up to 12 x 41 tokens: the engines preempt, sharing one pool.
    ve = _engines(16, max_num_batched_tokens=32)
    out, deepest = _run(ve, arrivals)
    assert deepest == 2
    for reqs in arrivals.values():
        for req in reqs:
            want, reason = expected_output(req.prompt_token_ids, 0, req.params, None, 256)
            assert out.tokens[(req.request_id, 0)] == want, req.request_id
            assert out.finish[(req.request_id, 0)] == reason
    assert sum(e.stats().num_preemptions for e in ve.engines) > 0  # the shared pool ran short
    assert ve.stats().num_free_blocks == 15  # every block back (block 0 is reserved)
    steps = [b.step_id for b in out.batches]
    assert len(set(steps)) == len(steps) > 0


def test_requests_spread_over_the_engines_and_step_ids_interleave() -> None:
    ve = _engines(64)
    for i in range(4):
        ve.add_request(make_req(f"r{i}", [5, 6, 7], max_tokens=3))
    assert [len(e.live) for e in ve.engines] == [2, 2]
    a, b = ve.schedule(), ve.schedule()
    assert a is not None and b is not None and ve.schedule() is None  # each engine has one in flight
    assert {s.seq_id for s in a.new_seqs}.isdisjoint(s.seq_id for s in b.new_seqs)
    assert (a.step_id, b.step_id) == (2, 3)  # engine 0: 2, 4, ...; engine 1: 3, 5, ...
    assert ve.stats().num_running == 4


def test_depth_is_pp_on_gpus_one_on_cpus_unless_forced_and_checked() -> None:
    auto = make_engine_config(pipeline_parallel_size=2)
    assert (steps_in_flight(auto, "cuda:1"), steps_in_flight(auto, "cpu")) == (2, 1)
    forced = make_engine_config(pipeline_parallel_size=2, pipeline_steps_in_flight=2)
    assert steps_in_flight(forced, "cpu") == 2
    assert steps_in_flight(make_engine_config(), "cuda") == 1
    for bad in (0, 3):
        with pytest.raises(
            ValueError, match=r"pipeline_steps_in_flight must be in 1\.\.pipeline_parallel_size \(2\)"
        ):
            make_engine_config(pipeline_parallel_size=2, pipeline_steps_in_flight=bad)


def test_one_step_at_a_time_plans_carry_no_tokens() -> None:
    """Depth 1 with stages is the one-step path: a Scheduler alone, tokens shared by the workers."""
    cfg = EngineConfig(block_size=4, max_request_tokens=1 << 30, pipeline_parallel_size=2)
    sched, worker = Scheduler(cfg, 64, 256, None, hash_seed=b"test"), FakeWorker(4)
    sched.add_request(make_req("r0", [5, 6, 7], max_tokens=4))
    cached: list[CachedSeq] = []
    while (batch := sched.schedule()) is not None:
        cached += batch.cached_seqs
        sched.update(batch, worker.step(batch))
    assert cached and all(cs.new_token_ids == [] for cs in cached)
