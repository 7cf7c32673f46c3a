"""Several steps in flight through a pipeline: one Scheduler per "virtual engine" (vLLM's name).

With `-pp M` a step passes the stages in turn, so one step at a time leaves each stage idle
(M-1)/M of the time. Here D schedulers (D = the steps in flight, 2..M; bus/config.py) share one
KV block pool and each owns a disjoint set of sequences (a request joins the engine with the
fewest unfinished sequences). Each has at most one step in flight, so a sequence never has two;
the loop (scheduler/main.py) plans a step of every idle engine while others run, and stage 0
computes step N+1 while stage 1 computes step N.

Sharing the pool is safe because every stage runs the steps in the order they were planned: a
block one engine frees or registers in the prefix cache is written by its step before any later
step (of any engine) reads or rewrites it. An engine preempts only its own sequences.

Presents the Scheduler's interface to the loop; with one step in flight the loop uses a Scheduler
directly, and no plan carries tokens.
"""

from __future__ import annotations

from collections import ChainMap

from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import AddRequest, BatchResult, ExecuteBatch, SampleKey, SchedulerStats, SeqUpdate
from pagebus.scheduler.block_pool import BlockPool
from pagebus.scheduler.scheduler import Scheduler
from pagebus.scheduler.sequence import Sequence


class VirtualEngines:
    def __init__(
        self,
        cfg: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_id: int | None,
        count: int,
        hash_seed: bytes | None = None,
    ) -> None:
        pool = BlockPool(num_blocks)
        self.engines = [
            Scheduler(cfg, num_blocks, max_model_len, eos_token_id, hash_seed, pool, (i, count))
            for i in range(count)
        ]
        # Every engine's unfinished requests, as one read-only view (request id -> samples).
        self.requests: ChainMap[str, list[Sequence]] = ChainMap(*(e.requests for e in self.engines))
        self._busy: dict[int, Scheduler] = {}  # step id in flight -> its engine
        self.max_in_flight = count
        self._next = 0  # the engine asked first for the next step: round robin

    def add_request(self, req: AddRequest) -> list[SeqUpdate]:
        if req.request_id in self.requests:  # the owner names the error (id in use)
            return next(e for e in self.engines if req.request_id in e.requests).add_request(req)
        return min(self.engines, key=lambda e: len(e.live)).add_request(req)

    def abort(self, request_ids: list[str], samples: list[SampleKey] | None = None) -> list[SeqUpdate]:
        return [u for e in self.engines for u in e.abort(request_ids, samples)]

    def schedule(self) -> ExecuteBatch | None:
        """A step of the next idle engine that has work; None when none has."""
        n = len(self.engines)
        busy = set(map(id, self._busy.values()))
        for k in range(n):
            e = self.engines[(self._next + k) % n]
            if id(e) in busy:
                continue
            batch = e.schedule()
            if batch is not None:
                self._busy[batch.step_id] = e
                self._next = (self._next + k + 1) % n
                return batch
        return None

    def update(self, batch: ExecuteBatch, result: BatchResult) -> list[SeqUpdate]:
        engine = self._busy.pop(batch.step_id, None)
        if engine is None:
            raise RuntimeError(f"update() for step {batch.step_id}, which is not in flight")
        return engine.update(batch, result)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    def stats(self) -> SchedulerStats:
        """Counts summed over the engines; the block figures are the shared pool's."""
        parts = [e.stats() for e in self.engines]
        first = parts[0]

        def total(name: str) -> int:
            return sum(getattr(p, name) for p in parts)

        def per_position(name: str) -> list[int]:
            return [sum(col) for col in zip(*(getattr(p, name) for p in parts), strict=True)]

        return SchedulerStats(
            num_running=total("num_running"),
            num_waiting=total("num_waiting"),
            kv_usage=first.kv_usage,
            num_free_blocks=first.num_free_blocks,
            num_total_blocks=first.num_total_blocks,
            prefix_cache_queries=total("prefix_cache_queries"),
            prefix_cache_hits=total("prefix_cache_hits"),
            num_preemptions=total("num_preemptions"),
            num_steps=total("num_steps"),
            spec_num_drafts=total("spec_num_drafts"),
            spec_num_draft_tokens=total("spec_num_draft_tokens"),
            spec_num_accepted_tokens=total("spec_num_accepted_tokens"),
            spec_drafted_per_position=per_position("spec_drafted_per_position"),
            spec_accepted_per_position=per_position("spec_accepted_per_position"),
        )
