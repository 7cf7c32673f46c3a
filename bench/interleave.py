"""Every engine loaded at once, then their timed runs interleaved, one engine's run after another's.

These shared 2-vCPU boxes change speed by 10-30% from one minute to the next (the same 64-request
batch took 27.7-33.4 s in one process over 25 minutes). Engines timed one after the other, minutes
apart, compared the box's moods more than the engines. Here each round times every engine once on
the same prompts, the order rotating from round to round, and a ratio between two engines is the
median over rounds of the ratio within a round (see `paired`), runs a minute or two apart.

The protocol is bench/peer_runners/_harness.py's: each size is warmed up with 4 new tokens, every
timed run gets prompts of its own (offline_plan, single_plan), and an engine's figures have the
shapes of a peer driver's result ("offline", "offline_by_size", "single"). Engines here:
- `LocalEngine`: a generate function in this process (pagebus's LLM.generate);
- `PeerEngine`: a peer's driver kept running in interactive mode (its venv's python);
- `RunBatchEngine`: `pagebus run-batch`, a fresh multi-process engine each run (offline only; its
  time is run-batch's own summary line, start-up excluded), so it takes no warm-up.
An engine whose run fails is reported with its error and left out of the later runs. Each timed
run also records the CPU seconds the idle engines' processes used meanwhile, which should be ~0.

Before every run the machine settles (`wait_for_quiet`): an engine's threads can stay busy for a
second or more after its run has returned (a peer winding down, a run-batch engine's processes
exiting), and the engine timed next ran that long on a core short. pagebus's worker then stepped
down to one thread for ~1.5 s: in two short single-stream runs (Zen 4, 2026-12-07) the first round
read 95 and 78 tok/s, the later ones 114-130. Every engine waits alike.
"""

from __future__ import annotations

import argparse
import collections
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import psutil
from pagebus.workers.threads import cpu_seconds

from bench.peer_runners._harness import (
    WARMUP_TOKENS,
    Generate,
    offline_plan,
    offline_result,
    single_plan,
    variant,
)

RUNNERS = Path(__file__).resolve().parent / "peer_runners"
T = TypeVar("T")


class EngineFailed(RuntimeError):
    pass


class Engine(Protocol):
    name: str
    warm_up: bool  # False: every run starts a fresh engine, a warm-up would warm nothing
    single: bool  # whether it takes part in the single stream

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[int]]:
        """(seconds, new tokens per prompt); EngineFailed when it cannot."""
        ...

    def cpu_s(self) -> float:
        """CPU seconds its processes have used so far (checked around the others' runs)."""
        ...

    def extra(self) -> dict[str, Any]:
        """Figures of its last run beyond the time (run-batch: ok, failed, process_s)."""
        ...


class LocalEngine:
    def __init__(self, name: str, generate: Generate) -> None:
        self.name, self._generate = name, generate
        self.warm_up, self.single = True, True

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[int]]:
        t = time.perf_counter()
        try:
            counts = self._generate(prompts, max_tokens)
        except Exception as e:
            raise EngineFailed(f"{type(e).__name__}: {e}") from e
        return time.perf_counter() - t, counts

    def cpu_s(self) -> float:
        t = psutil.Process().cpu_times()  # this process alone: the peers' drivers are its children
        return t.user + t.system

    def extra(self) -> dict[str, Any]:
        return {}


class RunBatchEngine:
    def __init__(self, name: str, opts: argparse.Namespace) -> None:
        self.name, self.opts = name, opts
        self.warm_up, self.single = False, False
        self._extra: dict[str, Any] = {}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[int]]:
        from bench.throughput import run_batch

        try:
            r = run_batch(self.opts, [(p, max_tokens) for p in prompts])
        except Exception as e:
            raise EngineFailed(f"{type(e).__name__}: {e}") from e
        self._extra = {"ok": r["ok"], "failed": r["failed"], "process_s": r["process_s"]}
        return r["elapsed_s"], [int(r["output_tokens"])]  # one total: offline_result only sums them

    def cpu_s(self) -> float:
        return 0.0  # nothing of it runs between its runs

    def extra(self) -> dict[str, Any]:
        return self._extra


class PeerEngine:
    """A peer's driver in interactive mode: loaded once, then one command line a timed run."""

    def __init__(
        self, name: str, cmd: list[str], env: dict[str, str], job: dict[str, Any], timeout: float
    ) -> None:
        """cmd: the driver, e.g. [the peer's python, RUNNERS / "llamacpp_runner.py"]; it runs in RUNNERS."""
        self.name, self.timeout = name, timeout
        self.warm_up, self.single = True, True
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env, cwd=RUNNERS, bufsize=1,
        )  # fmt: skip
        self.tail: collections.deque[str] = collections.deque(maxlen=15)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._relay, daemon=True).start()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.loaded = self._ask(job | {"interactive": True})  # {"engine", "version", "load_s"}
        except EngineFailed:
            self.close()
            raise

    def _relay(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            sys.stderr.write(f"[{self.name}] {line}")
            self.tail.append(line.rstrip())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):  # anything else a library printed is not ours
                self._lines.put(line)
        self._lines.put(None)

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self._lines.get(timeout=self.timeout)
        except (OSError, queue.Empty) as e:
            self.close()
            raise EngineFailed(f"{self.name}: no answer ({type(e).__name__}): {list(self.tail)[-8:]}") from e
        if line is None:
            self.close()
            raise EngineFailed(f"{self.name} exited {self.proc.returncode}: {list(self.tail)[-8:]}")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise EngineFailed(out["error"])
        return out

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[int]]:
        out = self._ask({"prompts": prompts, "max_tokens": max_tokens})
        return out["elapsed_s"], out["counts"]

    def cpu_s(self) -> float:
        """The driver and whatever it started (vLLM's engine core)."""
        total = 0.0
        try:
            p = psutil.Process(self.proc.pid)
            for q in [p, *p.children(recursive=True)]:
                t = q.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
        return total

    def extra(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def wait_for_quiet(
    max_cores: float = 0.2,
    window_s: float = 0.2,
    timeout_s: float = 5.0,
    sample: Callable[[], tuple[float, float] | None] = cpu_seconds,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[float, bool]:
    """Waits, a window at a time, until the rest of the machine (all but this process, whose
    threads are the in-process engine's) used under `max_cores` cores over a window, or
    `timeout_s` has passed: (seconds waited, whether it was quiet)."""
    last, waited = sample(), 0.0
    if last is None:  # no /proc to tell: nothing to wait for
        return 0.0, True
    while True:
        t = clock()
        sleep(window_s)
        cur = sample()
        elapsed = clock() - t
        waited += elapsed
        if cur is None:
            return waited, True
        others = ((cur[0] - last[0]) - (cur[1] - last[1])) / max(elapsed, 1e-3)
        if others < max_cores:
            return waited, True
        if waited >= timeout_s:
            return waited, False
        last = cur


Settle = Callable[[], tuple[float, bool]]


def rotated(engines: Sequence[T], r: int) -> list[T]:
    """Round r's order: each engine takes each place in turn, so none always runs first or last."""
    k = r % len(engines) if engines else 0
    return [*engines[k:], *engines[:k]]


class Interleaved:
    """The runs of one measurement; `results()` gives each engine's figures or its error."""

    def __init__(
        self,
        engines: Sequence[Engine],
        rounds: int,
        single_rounds: int | None = None,
        settle: Settle = wait_for_quiet,
        probe: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        """single_rounds: the single stream's rounds (default `rounds`); settle: called before every
        run, (seconds waited, whether the machine went quiet); probe: {name: GB/s} of the machine's
        memory, measured around each single-stream round (see run_single)."""
        if rounds < 1 or (single_rounds is not None and single_rounds < 1):
            raise ValueError(f"rounds must be at least 1, got {rounds} and {single_rounds}")
        self.engines, self.rounds = list(engines), rounds
        self.single_rounds = rounds if single_rounds is None else single_rounds
        self.settle, self.probe = settle, probe
        self.errors: dict[str, str] = {}
        self.offline: dict[str, dict[str, Any]] = {e.name: {} for e in engines}
        self.single: dict[str, dict[str, Any]] = {}
        self.others_cpu_s: dict[str, float] = {e.name: 0.0 for e in engines}  # most while it ran
        self.settle_s: dict[str, float] = {e.name: 0.0 for e in engines}  # the longest wait before its runs
        self.unsettled: dict[str, int] = {e.name: 0 for e in engines}  # its runs begun on a busy machine

    def _live(self, which: Sequence[Engine]) -> list[Engine]:
        return [e for e in which if e.name not in self.errors]

    def _run(self, e: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[int]] | None:
        others = [o for o in self._live(self.engines) if o is not e]
        waited, quiet = self.settle()
        self.settle_s[e.name] = max(self.settle_s[e.name], round(waited, 2))
        self.unsettled[e.name] += not quiet
        before = sum(o.cpu_s() for o in others)
        try:
            out = e.generate(prompts, max_tokens)
        except EngineFailed as err:
            self.errors[e.name] = str(err)
            return None
        used = sum(o.cpu_s() for o in others) - before
        self.others_cpu_s[e.name] = max(self.others_cpu_s[e.name], round(used, 3))
        return out

    def run_offline(self, prompts: list[list[int]], sizes: list[int], output_len: int) -> None:
        for n, warm, timed in offline_plan(sizes, self.rounds):
            base = prompts[:n]
            for e in self._live(self.engines):
                if e.warm_up:
                    self._run(e, variant(base, warm), WARMUP_TOKENS)
            runs: dict[str, list[tuple[float, list[int], dict[str, Any]]]] = {
                e.name: [] for e in self.engines
            }
            for r, v in enumerate(timed):
                for e in rotated(self._live(self.engines), r):
                    if (out := self._run(e, variant(base, v), output_len)) is not None:
                        runs[e.name].append((*out, e.extra()))
            for e in self._live(self.engines):
                got = runs[e.name]
                res = offline_result(base, [t for t, _, _ in got], sum(got[0][1]))
                self.offline[e.name][str(n)] = res | got[0][2]

    def _probe(self) -> dict[str, float]:
        """The probe's figures on a settled machine ({} without a probe)."""
        if self.probe is None:
            return {}
        self.settle()
        return self.probe()

    def run_single(self, prompt: list[int], output_len: int) -> None:
        """Each round, each engine: a one-token run, then the full one. With a probe, the machine's
        bandwidth is measured just before and after the two (their mean kept per round): these boxes'
        DRAM bandwidth flips between two levels ~30% apart from one few seconds to the next (a
        256 MB read, every 0.5 s, Zen 4: 27-31 then 40-44 GB/s), so a ceiling measured once at the
        start compared a round with whichever level it had met."""
        warm, plan = single_plan(self.single_rounds)
        singles = [e for e in self._live(self.engines) if e.single]
        for e in singles:
            self._run(e, variant([prompt], warm), WARMUP_TOKENS)
        runs: dict[str, list[tuple[float, float, int, dict[str, float]]]] = {e.name: [] for e in singles}
        for r, (v1, vn) in enumerate(plan):
            for e in rotated(self._live(singles), r):
                before = self._probe()
                first = self._run(e, variant([prompt], v1), 1)
                full = self._run(e, variant([prompt], vn), output_len) if first else None
                if first and full:
                    after = self._probe()
                    bw = {k: (before[k] + after[k]) / 2 for k in before.keys() & after.keys()}
                    runs[e.name].append((first[0], full[0], full[1][0], bw))
        for e in self._live(singles):
            got = [g for g in runs[e.name] if g[2] > 1 and g[1] > g[0]]  # rounds with a decode rate
            t1s, tns, out = [g[0] for g in runs[e.name]], [g[1] for g in runs[e.name]], runs[e.name][0][2]
            rates = [(out - 1) / (tn - t1) for t1, tn, _, _ in got]
            tn = statistics.median(tns)
            bandwidth = {k: [round(g[3][k], 2) for g in got] for k in (got[0][3] if got else {})}
            self.single[e.name] = {
                "input_tokens": len(prompt),
                "output_tokens": out,
                "elapsed_s": round(tn, 3),
                "elapsed_runs_s": [round(t, 3) for t in tns],
                "first_token_s": round(statistics.median(t1s), 4),
                "output_tokens_per_s": round(out / tn, 2),
                # per round: (n - 1) / (t_n - t_1) of that round's two runs; the median kept
                "decode_tokens_per_s": round(statistics.median(rates), 2) if rates else None,
                "decode_runs_tokens_per_s": [round(x, 2) for x in rates],
            } | ({"bandwidth_runs_gb_per_s": bandwidth} if bandwidth else {})

    def results(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for e in self.engines:
            if e.name in self.errors:
                out[e.name] = {"error": self.errors[e.name]}
                continue
            res: dict[str, Any] = {
                "others_cpu_s_max": self.others_cpu_s[e.name],
                "settle_s_max": self.settle_s[e.name],
                "runs_begun_busy": self.unsettled[e.name],
            }
            if by_size := self.offline[e.name]:
                res |= {"offline": next(iter(by_size.values())), "offline_by_size": by_size}
            if e.name in self.single:
                res["single"] = self.single[e.name]
            out[e.name] = res
        return out


def runs_tps(r: dict[str, Any], n: int | None) -> list[float]:
    """Per-round throughputs: offline output tok/s at size n, or single-stream decode tok/s."""
    if n is None:
        return list((r.get("single") or {}).get("decode_runs_tokens_per_s") or [])
    off = (r.get("offline_by_size") or {}).get(str(n)) or {}
    return [off["output_tokens"] / t for t in off.get("elapsed_runs_s", []) if t > 0]


def paired(a: dict[str, Any], b: dict[str, Any], n: int | None) -> float | None:
    """a's throughput over b's, the median over rounds of the two engines' runs in the same round;
    None where either has no runs or their rounds do not line up."""
    ra, rb = runs_tps(a, n), runs_tps(b, n)
    if not ra or len(ra) != len(rb):
        return None
    return round(statistics.median(x / y for x, y in zip(ra, rb, strict=True)), 3)
