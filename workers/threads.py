"""How many cores a CPU worker's matmuls use: all of them while the machine is otherwise idle,
fewer while other processes want them.

torch's OpenMP threads wait for each other at the end of every parallel region by spinning.
On idle cores that is the fastest wait there is (single stream on 2 threads: about 1.8x
OMP_WAIT_POLICY=PASSIVE); but when another process holds a core, every region waits for a thread
the kernel has descheduled, and a step takes 5-20x longer than on one thread (measured on a
2-core machine at load 4-7: the default model's single stream fell to 0.5-1 tok/s from 8-11 on
one thread). So the worker measures, about twice a second, how much CPU time the rest of the
machine used (/proc/stat's busy time less this process's own), and steps down to fewer threads
while others use more than `high` cores, back up when they use less than `low`.

It is called before each step, so a window in which the worker itself was mostly idle (used
less than `idle` cores) says what others did while it had nothing to do, not what they do now:
such a window only starts a new one. Served, the benchmark client's own start-up (10 s of one
core) ended just as its first requests came, and the stale window put the worker on one thread
for their prefill: that request's TTFT was 2x the others' (1270 against ~600 ms at 1,024
tokens), and the first wave of a 32-way run waited 1.9-2.7 s against 0.84-1.71 s for the second.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy, CPU seconds this process has used), or
    None where /proc is not there to tell."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    busy = sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)  # all but idle and iowait
    return busy / _TICKS, (int(own[11]) + int(own[12])) / _TICKS  # utime + stime


class CoreShare:
    """Call `update()` before each step; it changes torch's thread count when it should and
    returns the count in use."""

    def __init__(
        self,
        max_threads: int,
        interval_s: float = 0.5,
        high: float = 0.6,
        low: float = 0.25,
        idle: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        sample: Callable[[], tuple[float, float] | None] = cpu_seconds,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self.interval_s, self.high, self.low, self.idle = interval_s, high, low, idle
        self._clock, self._sample = clock, sample
        self._last_t = clock()
        self._last = sample()

    def update(self) -> int:
        now = self._clock()
        if now - self._last_t < self.interval_s or self._last is None:
            return self.threads
        cur = self._sample()
        if cur is None:
            return self.threads
        elapsed = now - self._last_t
        ours = (cur[1] - self._last[1]) / elapsed
        others = ((cur[0] - self._last[0]) - (cur[1] - self._last[1])) / elapsed  # cores in use
        self._last_t, self._last = now, cur
        if ours < self.idle:  # the worker mostly waited for work: start a fresh window instead
            return self.threads
        want = self.threads
        if others > self.high and self.threads > 1:
            want = self.threads - 1
        elif others < self.low and self.threads < self.max_threads:
            want = self.threads + 1
        if want != self.threads:
            log.info("other processes use %.2f cores: %d -> %d threads", others, self.threads, want)
            self.threads = want
            torch.set_num_threads(want)
        return self.threads
