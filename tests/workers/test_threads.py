"""CoreShare: the CPU worker's thread count follows the CPU time other processes use."""

from __future__ import annotations

import torch
from pagebus.workers.threads import CoreShare, cpu_seconds


class FakeMachine:
    """A clock and /proc readings that the test advances: `others` cores busy besides us."""

    def __init__(self) -> None:
        self.t = 0.0
        self.busy = 0.0
        self.own = 0.0

    def run(self, seconds: float, ours: float, others: float) -> None:
        self.t += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds

    def sample(self) -> tuple[float, float]:
        return self.busy, self.own


def test_steps_down_under_contention_and_back_up() -> None:
    before = torch.get_num_threads()
    m = FakeMachine()
    share = CoreShare(2, interval_s=0.5, clock=lambda: m.t, sample=m.sample)
    try:
        m.run(0.2, ours=2.0, others=1.5)
        assert share.update() == 2  # not yet half a second: no reading
        m.run(0.4, ours=2.0, others=1.5)
        assert share.update() == 1 and torch.get_num_threads() == 1
        m.run(0.6, ours=1.0, others=1.0)
        assert share.update() == 1  # never below one
        m.run(0.6, ours=1.0, others=0.4)
        assert share.update() == 1  # between low and high: stays
        m.run(0.6, ours=1.0, others=0.1)
        assert share.update() == 2 and torch.get_num_threads() == 2
        m.run(0.6, ours=2.0, others=0.0)
        assert share.update() == 2  # never above the start
    finally:
        torch.set_num_threads(before)


def test_a_window_of_idle_time_only_starts_a_new_one() -> None:
    """Others were busy while the worker idled (no steps, no readings): by the next step that
    says nothing about now, so the count stays until a window of its own says otherwise."""
    before = torch.get_num_threads()
    m = FakeMachine()
    share = CoreShare(2, interval_s=0.5, clock=lambda: m.t, sample=m.sample)
    try:
        m.run(10.0, ours=0.0, others=1.0)  # idle, while another process ran
        assert share.update() == 2  # the stale window: no decision
        m.run(0.6, ours=2.0, others=0.1)
        assert share.update() == 2
        m.run(0.6, ours=2.0, others=1.0)  # contention that lasts a whole window still counts
        assert share.update() == 1
        m.run(5.0, ours=0.0, others=0.0)
        assert share.update() == 1  # nor does an idle window raise it
        m.run(0.6, ours=1.0, others=0.0)
        assert share.update() == 2
    finally:
        torch.set_num_threads(before)


def test_without_proc_it_keeps_the_count() -> None:
    share = CoreShare(2, interval_s=0.0, sample=lambda: None)
    assert share.update() == 2


def test_reads_this_machine() -> None:
    first = cpu_seconds()
    assert first is not None
    sum(i * i for i in range(3_000_000))  # some CPU time of our own (ticks are 10 ms)
    second = cpu_seconds()
    assert second is not None
    assert second[1] > first[1] and second[0] >= first[0]
    assert second[0] - first[0] >= second[1] - first[1] - 0.05  # the machine includes us
