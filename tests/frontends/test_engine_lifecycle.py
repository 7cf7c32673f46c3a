"""The multi-process engine's lifecycle: death of any process fails requests fast and leaves no
process behind; drain finishes in-flight work; idle costs ~no CPU; the frontend stays torch-free."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import GenerateRequest, SamplingParams
from pagebus.frontends.engine.client import AsyncEngineClient, EngineDeadError

from tests.frontends.http.server_proc import living

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _gone(pids: list[int], deadline_s: float) -> list[int]:
    """The pids still alive (not zombies) after waiting up to deadline_s for them to exit."""
    end = time.monotonic() + deadline_s
    alive = pids
    while alive and time.monotonic() < end:
        alive = living(pids)
        if alive:
            psutil.wait_procs([psutil.Process(p) for p in alive if psutil.pid_exists(p)], timeout=0.1)
    return alive


@pytest.mark.parametrize("victim", ["worker", "tokenizer", "scheduler"])
def test_sigkill_fails_every_request_within_5s_and_leaves_no_process(victim: str) -> None:
    async def run() -> None:
        client = await AsyncEngineClient.start(EngineConfig(dtype="float32", num_kv_blocks=128))
        pids = client.pids
        p = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
        started = [asyncio.Event() for _ in range(3)]

        async def one(i: int) -> None:
            async for _ in client.generate(GenerateRequest(request_id=f"k{i}", params=p, prompt="Hi")):
                started[i].set()

        tasks = [asyncio.create_task(one(i)) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60.0)
        target = next(
            (p.pid for p in client._launcher.procs if p.role == victim),
            client._launcher.ready[("scheduler", 0)].worker_pids[0],  # workers are the scheduler's children
        )
        os.kill(target, signal.SIGKILL)
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0)
        assert time.monotonic() - t0 < 5.0
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert client.is_dead and victim in (client.dead_reason or "")
        assert "exit code -9" in str(results[0]) or victim == "worker", results[0]
        with pytest.raises(EngineDeadError):
            await client.generate(GenerateRequest(request_id="late", params=p, prompt="x")).__anext__()
        await client.shutdown()
        assert _gone(pids, 10.0) == []

    asyncio.run(run())
    assert [
        c
        for c in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(c.cmdline())
    ] == []


def test_torch_free_frontend_idle_cpu_and_drain() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.frontends._engine_script"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["heavy"] == [], "the frontend imported " + ", ".join(out["heavy"])
    assert out["idle_cpu"] < 0.05, out  # all engine processes plus the frontend, cores
    assert out["counts"] == [16, 16, 16, 16]  # drained: every in-flight request completed
    assert all(code == 0 for code in out["exit_codes"].values()), out
    assert out["alive"] == []


def test_pool_and_scheduler_modules_do_not_import_torch() -> None:
    code = (
        "import sys, pagebus.frontends.engine.tokenizer_process, pagebus.frontends.engine.client, "
        "pagebus.frontends.engine.launcher, pagebus.scheduler.main, pagebus.workers.main; bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
