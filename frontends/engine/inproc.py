"""The engine in one process: the same Scheduler and ModelRunner classes that the scheduler
and worker processes run, called directly. Used by `LLM(...)` (the default) and by tests."""

from __future__ import annotations

from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import AbortRequest, AddRequest, SchedulerStats, SeqUpdate


class InprocEngine:
    def __init__(self, cfg: EngineConfig, model_path: str) -> None:
        # Heavy imports stay here: a frontend that never builds an in-process engine never
        # imports torch.
        from pagebus.scheduler.scheduler import Scheduler
        from pagebus.workers.runner import ModelRunner

        self.runner = ModelRunner(cfg, model_path)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.model_config.vocab_size
        self.scheduler = Scheduler(cfg, self.runner.num_blocks, self.max_model_len, self.runner.eos_token_id)
        self.pending: list[SeqUpdate] = []  # rejections and aborts, delivered with the next step

    def add(self, req: AddRequest) -> None:
        self.pending.extend(self.scheduler.add_request(req))

    def abort(self, req: AbortRequest) -> None:
        self.pending.extend(self.scheduler.abort(req.request_ids, req.samples))

    def has_unfinished(self) -> bool:
        return bool(self.pending) or self.scheduler.has_unfinished()

    def step(self) -> list[SeqUpdate]:
        """One schedule -> execute -> update round; returns every client-visible update."""
        updates, self.pending = self.pending, []
        batch = self.scheduler.schedule()
        if batch is not None:
            result = self.runner.execute(batch)
            updates.extend(self.scheduler.update(batch, result))
        return updates

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()
