"""Run in a fresh interpreter by test_engine_lifecycle: a frontend that must stay torch-free.

Prints one JSON line: torch/transformers imported?, idle CPU of the engine processes (cores, over
2 s after a first 2 s window), drained outputs and exit codes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import psutil
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import GenerateRequest, SamplingParams
from pagebus.frontends.engine.client import AsyncEngineClient


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


async def main() -> None:
    client = await AsyncEngineClient.start(EngineConfig(dtype="float32", num_kv_blocks=128))
    heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
    pids = [*client.pids, psutil.Process().pid]
    # Idle CPU in two 2 s windows (measuring, not synchronising). The test asserts on the second:
    # on a loaded CI box the first once caught the tail of start-up (0.71 cores, never seen again
    # in reruns), which is not the steady idle this checks; both are printed.
    windows = []
    for _ in range(2):
        before, t0 = cpu_seconds(pids), time.monotonic()
        await asyncio.sleep(2.0)
        windows.append((cpu_seconds(pids) - before) / (time.monotonic() - t0))
    idle_cpu = windows[-1]

    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    started = asyncio.Event()

    async def one(i: int) -> int:
        n = 0
        async for d in client.generate(GenerateRequest(request_id=f"r{i}", params=p, prompt=f"{i} apples")):
            n += sum(len(s.new_token_ids) for s in d.samples)
            started.set()
        return n

    tasks = [asyncio.create_task(one(i)) for i in range(4)]
    await started.wait()
    await client.shutdown(drain=True, timeout=180.0)  # what SIGTERM in a server does
    counts = await asyncio.gather(*tasks)
    out = {
        "heavy": heavy,
        "idle_cpu": idle_cpu,
        "idle_cpu_first_window": windows[0],
        "counts": counts,
        "exit_codes": client.exit_codes,
    }
    out["alive"] = [
        pid for pid in client.pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
    ]
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
