"""The engine in one process: the same TextProcessor, Scheduler and ModelRunner that the tokenizer,
scheduler and worker processes run, called directly. `LLM(...)` uses it by default."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagebus.bus.config import EngineConfig, request_limits
from pagebus.bus.messages import GenerateRequest, RequestDelta, SchedulerStats, SeqUpdate
from pagebus.frontends.engine.interface import EngineInfo
from pagebus.frontends.engine.text import TextProcessor
from pagebus.frontends.model_files import model_name
from pagebus.frontends.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagebus.scheduler.scheduler import Scheduler
    from pagebus.workers.runner import ModelRunner


class InprocEngine:
    """`Engine`: one `step()` is one schedule -> execute -> update round."""

    def __init__(self, cfg: EngineConfig, model_path: str, tokenizer: Tokenizer) -> None:
        # Heavy imports stay here: a frontend that never builds an in-process engine never
        # imports torch.
        from pagebus.scheduler.scheduler import Scheduler
        from pagebus.workers.runner import ModelRunner

        t0 = time.monotonic()
        self.runner: ModelRunner = ModelRunner(cfg, model_path)
        self.max_model_len = self.runner.max_model_len
        self.scheduler: Scheduler = Scheduler(
            cfg, self.runner.num_blocks, self.max_model_len, self.runner.eos_token_id
        )
        self.text = TextProcessor(tokenizer)
        self.info = EngineInfo(
            model_name=model_name(model_path),
            model_path=model_path,
            max_model_len=self.max_model_len,
            vocab_size=self.runner.model_config.vocab_size,
            num_kv_blocks=self.runner.num_blocks,
            startup_seconds=time.monotonic() - t0,
            limits=request_limits(cfg, self.runner.num_blocks),
        )
        # Rejections and aborts happen between steps; they reach the caller with the next step.
        self.pending: list[SeqUpdate] = []
        self.refused: list[RequestDelta] = []

    def add(self, req: GenerateRequest) -> None:
        out = self.text.generate(req)
        if isinstance(out, RequestDelta):
            self.refused.append(out)
        else:
            self.pending.extend(self.scheduler.add_request(out))

    def abort(self, request_ids: list[str]) -> None:
        self.pending.extend(self.scheduler.abort(list(request_ids)))

    def has_unfinished(self) -> bool:
        return bool(self.pending or self.refused) or self.scheduler.has_unfinished()

    def step(self) -> list[RequestDelta]:
        updates, self.pending = self.pending, []
        batch = self.scheduler.schedule()
        if batch is not None:
            result = self.runner.execute(batch)
            updates.extend(self.scheduler.update(batch, result))
        deltas, to_abort = self.text.process(updates)
        if to_abort:  # stop strings ended these samples: free their blocks now
            self.pending.extend(self.scheduler.abort([], to_abort))
        refused, self.refused = self.refused, []
        return refused + deltas

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        """Nothing to stop: the engine lives and dies with this object."""
