"""bench/interleave.py: the rounds' order, the figures' shapes, paired ratios, a failing engine, and a
peer driver kept running in interactive mode (a fake driver on the real harness, no model)."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from bench.interleave import (
    RUNNERS,
    EngineFailed,
    Interleaved,
    LocalEngine,
    PeerEngine,
    paired,
    rotated,
    wait_for_quiet,
)
from bench.peer_runners._harness import WARMUP_TOKENS, single_plan


class Fake:
    """An engine whose run takes `speed[round]` seconds a new token, and logs what it was asked."""

    def __init__(self, name: str, calls: list[tuple[str, int, int]], secs: float, warm_up: bool = True,
                 fail_at: int | None = None) -> None:  # fmt: skip
        self.name, self.calls, self.secs, self.warm_up, self.single = name, calls, secs, warm_up, warm_up
        self.fail_at = fail_at

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[int]]:
        self.calls.append((self.name, len(prompts), max_tokens))
        if self.fail_at is not None and len(self.calls) >= self.fail_at:
            raise EngineFailed(f"{self.name} broke")
        return self.secs * max_tokens, [max_tokens] * len(prompts)

    def cpu_s(self) -> float:
        return 0.0

    def extra(self) -> dict[str, Any]:
        return {}


PROMPTS = [[100 + i, 200 + i, 300 + i] for i in range(4)]


def no_wait() -> tuple[float, bool]:
    return 0.0, True


def test_rounds_rotate_and_every_engine_runs_once_a_round() -> None:
    calls: list[tuple[str, int, int]] = []
    a, b, c = Fake("a", calls, 0.01), Fake("b", calls, 0.02), Fake("c", calls, 0.04, warm_up=False)
    runs = Interleaved([a, b, c], rounds=3, settle=no_wait)
    runs.run_offline(PROMPTS, [2, 4], output_len=8)
    # per size: warm-ups of the engines that take one, then 3 rounds in rotated order
    per_size = [("a", WARMUP_TOKENS), ("b", WARMUP_TOKENS), *[(n, 8) for n in "abcbcacab"]]
    assert [(name, m) for name, _, m in calls] == per_size * 2
    assert [k for _, k, m in calls if m == 8] == [2] * 9 + [4] * 9
    res = runs.results()
    off = res["a"]["offline_by_size"]["4"]
    assert off["elapsed_runs_s"] == [0.08] * 3 and off["output_tokens"] == 32
    assert res["a"]["offline"] == res["a"]["offline_by_size"]["2"]
    assert paired(res["a"], res["b"], 4) == 2.0 and paired(res["b"], res["c"], 2) == 2.0
    assert "single" not in res["a"]


def test_single_stream_per_round_decode_rate() -> None:
    calls: list[tuple[str, int, int]] = []
    a, c = Fake("a", calls, 0.01), Fake("c", calls, 0.02, warm_up=False)  # c: no single stream
    runs = Interleaved([a, c], rounds=2, settle=no_wait)
    runs.run_single([5, 6, 7], output_len=11)
    assert [(n, m) for n, _, m in calls] == [("a", WARMUP_TOKENS), ("a", 1), ("a", 11), ("a", 1), ("a", 11)]
    single = runs.results()["a"]["single"]
    # (11 - 1) tokens in 0.11 - 0.01 s, each round
    assert single["decode_runs_tokens_per_s"] == [100.0, 100.0] and single["decode_tokens_per_s"] == 100.0
    assert single["output_tokens"] == 11 and single["first_token_s"] == 0.01
    assert "single" not in runs.results()["c"]


def test_a_failing_engine_is_reported_and_left_out() -> None:
    calls: list[tuple[str, int, int]] = []
    a, b = Fake("a", calls, 0.01), Fake("b", calls, 0.01, fail_at=4)  # b: warm-up + 1 round, then fails
    runs = Interleaved([a, b], rounds=3, settle=no_wait)
    runs.run_offline(PROMPTS, [4], output_len=8)
    res = runs.results()
    assert res["b"] == {"error": "b broke"}
    assert len(res["a"]["offline_by_size"]["4"]["elapsed_runs_s"]) == 3
    assert paired(res["a"], res["b"], 4) is None
    before = len(calls)
    runs.run_single([5, 6], output_len=4)
    assert {n for n, _, _ in calls[before:]} == {"a"}


def test_rotation_and_plans() -> None:
    assert rotated([1, 2, 3], 4) == [2, 3, 1]
    warm, plan = single_plan(29)
    used = [warm, *(v for pair in plan for v in pair)]
    assert len(used) == len(set(used)) and plan[0] == (3, 4) and max(used) <= 99
    with pytest.raises(ValueError, match="1-29"):
        single_plan(30)
    with pytest.raises(ValueError, match="at least 1"):
        Interleaved([], rounds=0, settle=no_wait)


class Machine:
    """/proc's counters as wait_for_quiet samples them, on a clock of its own: (busy CPU seconds of
    the whole machine, of this process); each window the rest of the machine uses the next of
    `others` cores, and a window takes `slow` times as long as asked (a loaded machine oversleeps)."""

    def __init__(self, others: list[float], slow: float = 1.0) -> None:
        self.others, self.slow = list(others), slow
        self.now, self.busy, self.own, self.samples = 0.0, 0.0, 0.0, 0

    def sample(self) -> tuple[float, float]:
        self.samples += 1
        return self.busy, self.own

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        slept = s * self.slow
        self.now += slept
        self.own += 0.05  # this process's own threads never count
        self.busy += 0.05 + (self.others.pop(0) if self.others else 0.0) * slept


def test_wait_for_quiet_waits_out_a_busy_machine() -> None:
    m = Machine([1.5, 0.9, 0.1], slow=1.5)
    waited, quiet = wait_for_quiet(0.2, 0.2, 5.0, sample=m.sample, sleep=m.sleep, clock=m.clock)
    assert quiet and m.samples == 4 and waited == pytest.approx(0.9)  # two busy windows, then a quiet one
    m = Machine([1.0] * 100)
    waited, quiet = wait_for_quiet(0.2, 0.2, 1.0, sample=m.sample, sleep=m.sleep, clock=m.clock)
    assert not quiet and waited == pytest.approx(1.0) and m.samples == 6  # gave up after 5 windows
    assert wait_for_quiet(sample=lambda: None) == (0.0, True)  # no /proc: nothing to wait for


def test_every_run_waits_for_a_quiet_machine() -> None:
    """The settle is called before each run (warm-ups included), its waits kept per engine, and a
    run begun on a machine that never went quiet counted; the single stream takes its own rounds."""
    calls: list[tuple[str, int, int]] = []
    settles: list[int] = []

    def settle() -> tuple[float, bool]:
        settles.append(len(calls))
        return 0.5 * (len(settles) % 2), len(settles) != 3  # the third run starts busy

    a, b = Fake("a", calls, 0.01), Fake("b", calls, 0.01)
    runs = Interleaved([a, b], rounds=2, single_rounds=4, settle=settle)
    runs.run_offline(PROMPTS, [4], output_len=8)
    assert settles == list(range(len(calls)))  # one before every run, none after
    runs.run_single([5, 6], output_len=4)
    res = runs.results()
    assert len(res["a"]["single"]["decode_runs_tokens_per_s"]) == 4
    assert len(res["a"]["offline"]["elapsed_runs_s"]) == 2
    assert res["a"]["settle_s_max"] == 0.5 and res["b"]["settle_s_max"] == 0.5
    assert res["a"]["runs_begun_busy"] + res["b"]["runs_begun_busy"] == 1
    with pytest.raises(ValueError, match="at least 1"):
        Interleaved([a], rounds=2, single_rounds=0, settle=no_wait)


def test_single_stream_rounds_carry_the_bandwidth_measured_around_them() -> None:
    """The probe runs on a settled machine just before and after each engine's two runs of a round;
    their mean is that round's figure, aligned with its decode rate."""
    calls: list[tuple[str, int, int]] = []
    probes: list[int] = []
    level = iter([40.0, 30.0, 20.0, 30.0, 44.0, 40.0, 10.0, 10.0])  # before, after; a, b; two rounds

    def probe() -> dict[str, float]:
        probes.append(len(calls))
        v = next(level)
        return {"copy": v, "read": 2 * v}

    a, b = Fake("a", calls, 0.01), Fake("b", calls, 0.02)
    runs = Interleaved([a, b], rounds=1, single_rounds=2, settle=no_wait, probe=probe)
    runs.run_single([5, 6], output_len=11)
    # warm-ups (2 calls), then per engine and round: probe, first-token run, full run, probe
    assert probes == [2, 4, 4, 6, 6, 8, 8, 10]
    res = runs.results()
    # round 0 runs a then b, round 1 b then a
    assert res["a"]["single"]["bandwidth_runs_gb_per_s"] == {"copy": [35.0, 10.0], "read": [70.0, 20.0]}
    assert res["b"]["single"]["bandwidth_runs_gb_per_s"] == {"copy": [25.0, 42.0], "read": [50.0, 84.0]}
    assert res["a"]["single"]["decode_runs_tokens_per_s"] == [100.0, 100.0]
    no_probe = Interleaved([a], rounds=1, settle=no_wait)
    no_probe.run_single([5, 6], output_len=11)
    assert "bandwidth_runs_gb_per_s" not in no_probe.results()["a"]["single"]


DRIVER = """
import sys, time
sys.path.insert(0, {runners!r})
from _harness import run_driver

def load(job):
    if job.get("options", {{}}).get("fail_load"):
        raise RuntimeError("no such model")
    def generate(prompts, n):
        if n == 13:
            raise ValueError("thirteen")
        if n == 7:  # a run that keeps a core busy for 0.3 s
            t = time.process_time()
            while time.process_time() - t < 0.3:
                pass
        return [n] * len(prompts)
    return generate

run_driver("fake", "0.1", load)
"""


@pytest.fixture
def driver(tmp_path: Path) -> list[str]:
    path = tmp_path / "fake_runner.py"
    path.write_text(textwrap.dedent(DRIVER.format(runners=str(RUNNERS))))
    return [sys.executable, str(path)]


def test_peer_engine_interactive(driver: list[str]) -> None:
    eng = PeerEngine("fake", driver, dict(os.environ), {"prompts": PROMPTS}, timeout=60)
    try:
        assert eng.loaded["engine"] == "fake" and eng.loaded["version"] == "0.1" and eng.loaded["load_s"] >= 0
        t, counts = eng.generate(PROMPTS[:3], 5)
        assert t >= 0 and counts == [5, 5, 5]
        assert eng.cpu_s() > 0  # the driver's python start-up at least
        with pytest.raises(EngineFailed, match="ValueError: thirteen"):
            eng.generate(PROMPTS, 13)
        assert eng.generate(PROMPTS[:1], 2)[1] == [2]  # an error in one run leaves the driver serving
    finally:
        eng.close()
    assert eng.proc.returncode == 0 and eng.cpu_s() == 0.0


def test_peer_engine_load_failure(driver: list[str]) -> None:
    with pytest.raises(EngineFailed, match="RuntimeError: no such model"):
        PeerEngine("fake", driver, dict(os.environ), {"prompts": PROMPTS, "options": {"fail_load": True}}, 60)
    # (the driver is closed by then: nothing left running)


def test_idle_engines_cpu_is_each_engines_own(driver: list[str]) -> None:
    """The CPU an idle engine uses during another's run: this process's own, not its children's
    (the peers' drivers are its children), and the driver's tree."""

    def busy(prompts: list[list[int]], n: int) -> list[int]:
        if n == 7:
            t = time.process_time()
            while time.process_time() - t < 0.3:
                pass
        return [n] * len(prompts)

    peer = PeerEngine("fake", driver, dict(os.environ), {"prompts": PROMPTS}, timeout=60)
    try:
        runs = Interleaved([LocalEngine("local", busy), peer], rounds=2, settle=no_wait)
        runs.run_offline(PROMPTS, [2], output_len=7)
        res = runs.results()
    finally:
        peer.close()
    assert res["fake"]["offline"]["elapsed_s"] >= 0.29  # it did spin
    assert res["fake"]["others_cpu_s_max"] < 0.15 and res["local"]["others_cpu_s_max"] < 0.15, res
