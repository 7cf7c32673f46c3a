"""Multi-process runtime bench: start-up time, bus round trip, idle CPU, and throughput through the
processes vs the in-process engine on the same workload. Prints ONE JSON object; logs to stderr.

    python -m bench.runtime [--requests 64 --input-len 128 --output-len 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import subprocess
import sys
import time
from typing import Any

import psutil
import zmq
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import AbortRequest, GenerateRequest, SamplingParams
from pagebus.bus.sockets import Channel, make_runtime_dir

log = logging.getLogger("bench.runtime")


def bus_round_trip(n: int = 2000) -> dict[str, float]:
    """p50/p99 of a ZMQ ipc round trip between two Channels (an echo thread on the far end)."""
    import threading

    ctx: zmq.Context[Any] = zmq.Context()
    with make_runtime_dir() as rd:
        ep = rd.endpoint("rtt")
        a = Channel.open(ctx, zmq.PAIR, ep, bind=True, recv_type=AbortRequest)
        b = Channel.open(ctx, zmq.PAIR, ep, bind=False, recv_type=AbortRequest)

        def echo() -> None:
            for _ in range(n):
                b.send(b.recv())

        t = threading.Thread(target=echo)
        t.start()
        msg, lat = AbortRequest(request_ids=["r1"]), []
        for _ in range(n):
            t0 = time.perf_counter()
            a.send(msg)
            a.recv()
            lat.append(time.perf_counter() - t0)
        t.join()
        a.close(0)
        b.close(0)
    ctx.term()
    lat.sort()
    return {"p50_us": lat[n // 2] * 1e6, "p99_us": lat[int(n * 0.99)] * 1e6}


def workload(n: int, in_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(in_len)] for _ in range(n)]


def inproc_tps(prompts: list[list[int]], params: SamplingParams) -> float:
    from pagebus import LLM

    llm = LLM(dtype="float32", seed=0)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


async def mp_numbers(prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    from pagebus.frontends.engine.client import AsyncEngineClient

    client = await AsyncEngineClient.start(EngineConfig(dtype="float32", seed=0))
    procs = [psutil.Process(p) for p in client.pids]

    def cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    c0, t0 = cpu(), time.monotonic()
    await asyncio.sleep(3.0)  # idle measurement window
    idle = 100.0 * (cpu() - c0) / (time.monotonic() - t0)

    async def one(i: int, ids: list[int]) -> int:
        n = 0
        req = GenerateRequest(request_id=f"b{i}", params=params, prompt_token_ids=ids)
        async for d in client.generate(req):
            n += sum(len(s.new_token_ids) for s in d.samples)
        return n

    await asyncio.gather(*(one(-1 - i, p) for i, p in enumerate(prompts[:2])))  # warm-up
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    dt = time.perf_counter() - t0
    startup = client.info.startup_seconds
    await client.shutdown(drain=False)
    return {"startup_s": startup, "idle_cpu_pct": idle, "tokens_per_s": sum(counts) / dt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    random.seed(0)
    prompts = workload(args.requests, args.input_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rtt = bus_round_trip()
    mp = asyncio.run(mp_numbers(prompts, params))
    inproc = inproc_tps(prompts, params)
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    out = {
        "bench": "runtime",
        "git_sha": sha,
        "device": "cpu",
        "config": {
            **vars(args),
            "dtype": "float32",
            "greedy": True,
            "ignore_eos": True,
            "tokenizer_workers": 1,
        },
        "startup_s": round(mp["startup_s"], 2),
        "bus_rtt_us": {k: round(v, 1) for k, v in rtt.items()},
        "idle_cpu_pct_3s": round(mp["idle_cpu_pct"], 2),
        "multiprocess_tokens_per_s": round(mp["tokens_per_s"], 1),
        "inproc_tokens_per_s": round(inproc, 1),
        "ratio": round(mp["tokens_per_s"] / inproc, 3),
        "load_avg_1m": round(psutil.getloadavg()[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
