"""bus.proc: start-up handshake failures, the death monitor, parent-death protection, shutdown."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import zmq
from pagebus.bus.messages import PROTOCOL_VERSION
from pagebus.bus.proc import (
    BusProcess,
    ProcessMonitor,
    StartupError,
    describe_exit,
    shutdown,
    spawn,
    wait_ready,
)
from pagebus.bus.sockets import RuntimeDir, make_runtime_dir, make_socket

from tests.bus import _children as kids
from tests.bus import _torch_child

CTX = multiprocessing.get_context("spawn")


@pytest.fixture
def rd() -> Iterator[RuntimeDir]:
    with make_runtime_dir() as d:
        yield d


@pytest.fixture
def handshake(rd: RuntimeDir) -> Iterator[tuple[zmq.Socket, str]]:
    ctx = zmq.Context()
    ep = rd.endpoint("handshake")
    sock = make_socket(ctx, zmq.PULL, ep, bind=True, linger_ms=0)
    yield sock, ep
    sock.close()
    ctx.term()


@pytest.fixture
def procs() -> Iterator[list[BusProcess]]:
    started: list[BusProcess] = []
    yield started
    shutdown(started, timeout=0.0)


def test_ready_facts_per_role_and_rank(handshake: tuple[zmq.Socket, str], procs: list[BusProcess]) -> None:
    sock, ep = handshake
    procs += [spawn(kids.good_child, f"worker-{r}", "worker", r, (ep, "worker", r)) for r in range(2)]
    ready = wait_ready(sock, procs, {("worker", 0), ("worker", 1)}, deadline_s=30.0)
    assert {k: r.model for k, r in ready.items()} == {
        ("worker", 0): kids.model_facts(0),
        ("worker", 1): kids.model_facts(1),
    }


def test_startup_failed_raises_its_reason_and_names_the_process(
    handshake: tuple[zmq.Socket, str], procs: list[BusProcess]
) -> None:
    sock, ep = handshake
    procs.append(spawn(kids.good_child, "worker-0", "worker", 0, (ep, "worker", 0)))
    procs.append(spawn(kids.failing_child, "worker-1", "worker", 1, (ep, "worker", 1)))
    with pytest.raises(StartupError, match=r"^worker-1 failed during start-up: no GPU$") as info:
        wait_ready(sock, procs, {("worker", 0), ("worker", 1)}, deadline_s=60.0)
    assert (info.value.role, info.value.rank) == ("worker", 1)


def test_child_that_raises_during_startup(handshake: tuple[zmq.Socket, str], procs: list[BusProcess]) -> None:
    sock, ep = handshake
    procs.append(spawn(kids.good_child, "worker-0", "worker", 0, (ep, "worker", 0)))
    procs.append(spawn(kids.crash_child, "worker-1", "worker", 1, (ep, "worker", 1)))
    t0 = time.monotonic()
    with pytest.raises(
        StartupError, match=r"worker-1 \(pid \d+\) exited with code 1 .*see the traceback above"
    ):
        wait_ready(sock, procs, {("worker", 0), ("worker", 1)}, deadline_s=60.0)
    assert time.monotonic() - t0 < 30.0  # the sentinel, not the deadline, ended the wait


def test_version_mismatch_is_fatal(handshake: tuple[zmq.Socket, str], procs: list[BusProcess]) -> None:
    sock, ep = handshake
    procs.append(spawn(kids.old_version_child, "scheduler-0", "scheduler", 0, (ep, "scheduler", 0)))
    v = PROTOCOL_VERSION
    with pytest.raises(StartupError, match=rf"scheduler-0 .* protocol v{v + 1}, this launcher v{v}"):
        wait_ready(sock, procs, {("scheduler", 0)}, deadline_s=30.0)


def test_deadline_names_the_silent_child(handshake: tuple[zmq.Socket, str], procs: list[BusProcess]) -> None:
    sock, ep = handshake
    procs.append(spawn(kids.silent_child, "worker-3", "worker", 3, (ep, "worker", 3)))
    with pytest.raises(StartupError, match="timed out after 2s waiting for worker-3"):
        wait_ready(sock, procs, {("worker", 3)}, deadline_s=2.0)


def test_monitor_reports_a_sigkilled_child_within_a_second(procs: list[BusProcess]) -> None:
    started = CTX.Event()
    procs.append(spawn(kids.ignore_sigterm, "worker-0", "worker", 0, (started,)))
    procs.append(spawn(kids.wait_forever, "worker-1", "worker", 1))
    assert started.wait(30.0)
    died: list[BusProcess] = []
    fired = threading.Event()
    monitor = ProcessMonitor(procs, lambda p: (died.append(p), fired.set())).start()
    try:
        t0 = time.monotonic()
        os.kill(procs[0].pid, signal.SIGKILL)
        assert fired.wait(1.0), "monitor did not report the death within 1 s"
        assert time.monotonic() - t0 < 1.0
        assert [p.tag for p in died] == ["worker-0"] and died[0].exitcode == -signal.SIGKILL
    finally:
        monitor.stop()


def test_describe_exit_hints_at_the_oom_killer() -> None:
    assert "OOM" in describe_exit(-9) and "SIGKILL" in describe_exit(-9)
    assert describe_exit(3) == "exited with code 3"


def test_shutdown_escalates_to_kill(procs: list[BusProcess]) -> None:
    started = CTX.Event()
    p = spawn(kids.ignore_sigterm, "stubborn", "worker", 0, (started,))
    procs.append(p)
    assert started.wait(30.0)
    t0 = time.monotonic()
    codes = shutdown([p], timeout=0.2, kill_grace_s=1.0)
    assert codes == {"stubborn": -signal.SIGKILL}
    assert time.monotonic() - t0 < 5.0


def test_grandchild_dies_with_its_parent(procs: list[BusProcess]) -> None:
    pids = CTX.Queue()
    mid = spawn(kids.middle, "middle", "launcher", 0, (pids,))
    procs.append(mid)
    grandchild = psutil.Process(pids.get(timeout=30.0))  # sent after its protection is installed
    assert grandchild.ppid() == mid.pid
    os.kill(mid.pid, signal.SIGKILL)
    mid.join(10.0)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            if grandchild.status() == psutil.STATUS_ZOMBIE:  # dead, waiting for init to reap it
                break
        except psutil.NoSuchProcess:
            break
        threading.Event().wait(0.02)
    else:
        grandchild.kill()
        pytest.fail("the grandchild outlived its parent by 5 s")


def torch_default_threads() -> int:
    """What a fresh interpreter gets (this test process may have changed its own)."""
    code = "import torch; print(torch.get_num_threads())"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout)


def test_light_roles_leave_the_cores_to_workers(procs: list[BusProcess]) -> None:
    """The tokenizer pool runs at lower priority with one torch thread; a worker keeps both."""
    out = CTX.Queue()
    base = os.nice(0)
    procs.append(spawn(_torch_child.report_cores, "tokenizer-0", "tokenizer", 0, (out,)))
    procs.append(spawn(_torch_child.report_cores, "worker-0", "worker", 0, (out,)))
    got = sorted([out.get(timeout=60), out.get(timeout=60)])
    (worker_nice, worker_threads), (tok_nice, tok_threads) = got
    assert worker_nice == base and tok_nice > base
    assert tok_threads == 1 and worker_threads == torch_default_threads()


FREEZE_CHILD = """
import gc, weakref
from pagebus.bus.proc import freeze_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

kept = Node()
dead_before = cycle()  # garbage from "start-up"
freeze_heap()
collected_at_freeze = dead_before() is None
frozen = gc.get_freeze_count()
dead_after = cycle()  # garbage made while serving
gc.collect()
print(collected_at_freeze, frozen >= 1, gc.is_tracked(kept), kept not in gc.get_objects(), dead_after() is None)
"""


def test_freeze_heap_collects_start_up_garbage_and_leaves_live_objects_out_of_later_collections() -> None:
    """What start-up left is collected first; the survivors are frozen, out of every later full
    collection's walk; garbage made afterwards is still collected."""
    out = subprocess.run(
        [sys.executable, "-c", FREEZE_CHILD], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["True"] * 5
