"""Forward progress: is the engine stepping while it has work?

Progress is counted per engine step, not per request: the scheduler's cumulative step count
(`SchedulerStats.num_steps`, which every step's output carries, prefill-only steps included)
must move while requests are in flight. A long prefill split in chunks, or a big batch, advances
it every step, so a slow but moving engine never counts as stalled; a worker stuck in a kernel, a
stopped process or a scheduler loop that stopped does not advance it.
"""

from __future__ import annotations


class ProgressTracker:
    def __init__(self, stall_timeout: float) -> None:
        self.stall_timeout = stall_timeout  # <= 0: never report a stall
        self.last_steps: int | None = None
        self.last_progress: float | None = None  # when work began or a step last finished
        self.busy = False

    def observe(self, num_steps: int | None, busy: bool, now: float) -> None:
        """Feed the latest step count and whether requests are in flight."""
        if num_steps is not None and num_steps != self.last_steps:
            self.last_steps = num_steps
            self.last_progress = now
        if busy and not self.busy:  # the clock starts when work arrives, not at the last idle step
            self.last_progress = now
        self.busy = busy

    def stalled_for(self, now: float) -> float | None:
        """Seconds without a step while busy, once that exceeds the stall timeout; else None."""
        if self.stall_timeout <= 0 or not self.busy or self.last_progress is None:
            return None
        idle = now - self.last_progress
        return idle if idle > self.stall_timeout else None
