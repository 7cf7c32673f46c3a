"""Online serving benchmark against any OpenAI-compatible server, with vLLM's definitions.

    python -m bench.serve --base-url http://127.0.0.1:8000/v1 [--concurrency 1 8 32]
    python -m bench.serve --launch [engine flags after --] ...   # start `pagebus serve` here

For each concurrency level (or --request-rate, Poisson arrivals), streams completions with
random token-id prompts and measures:
  TTFT  time to the first streamed token
  ITL   time between consecutive streamed chunks
  TPOT  (e2e - TTFT) / (output tokens - 1), per request
  E2E   request latency
plus output tokens/s, requests/s and goodput (requests/s meeting every --slo). Token counts
come from the usage chunk (stream_options.include_usage). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp

from bench.common import emit, log, percentiles, setup_logging
from bench.ports import free_port


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, headers: dict) -> Result:
    r = Result()
    t0 = time.perf_counter()
    last = t0
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return r
            async for raw in resp.content:  # one SSE line at a time
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if r.ttft == 0.0:
                    r.ttft = now - t0
                else:
                    r.itl.append(now - last)
                last = now
        r.e2e = time.perf_counter() - t0
        r.ok = True
    except Exception as e:  # a failed request is counted, never fatal to the run
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run_level(args: argparse.Namespace, concurrency: int | None, rate: float | None) -> dict:
    rng = random.Random(args.seed)
    bodies = [
        {
            "model": args.model_name,
            "prompt": [rng.randrange(100, 20000) for _ in range(args.input_len)],
            "max_tokens": args.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for _ in range(args.num_requests)
    ]
    if args.model_name is None:  # the server's own model
        for b in bodies:
            del b["model"]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.base_url.rstrip("/") + "/completions"
    sem = asyncio.Semaphore(concurrency or len(bodies))
    connector = aiohttp.TCPConnector(limit=max(64, concurrency or 0))
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        warm = dict(bodies[0], max_tokens=2)
        await one_request(client, url, warm, headers)

        async def guarded(body: dict) -> Result:
            async with sem:
                return await one_request(client, url, body, headers)

        t0 = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(guarded(body)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    return summarize(results, elapsed, args, concurrency, rate)


def summarize(
    results: list[Result], elapsed: float, args: argparse.Namespace, conc: int | None, rate: float | None
) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    slo = dict(s.split(":") for s in args.slo)
    good = [
        r for r in ok
        if r.ttft * 1e3 <= float(slo.get("ttft", "inf"))
        and (r.output_tokens <= 1 or (r.e2e - r.ttft) / (r.output_tokens - 1) * 1e3 <= float(slo.get("tpot", "inf")))
        and r.e2e * 1e3 <= float(slo.get("e2e", "inf"))
    ]  # fmt: skip
    ms = lambda xs: {k: round(v * 1e3, 2) for k, v in percentiles(xs).items()}  # noqa: E731
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "max_concurrency": conc,
        "request_rate": rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "duration_s": round(elapsed, 3),
        "request_throughput": round(len(ok) / elapsed, 3),
        "output_throughput": round(out_tokens / elapsed, 2),
        "total_output_tokens": out_tokens,
        "goodput": round(len(good) / elapsed, 3),
        "ttft_ms": ms([r.ttft for r in ok]),
        "tpot_ms": ms(tpot),
        "itl_ms": ms([x for r in ok for x in r.itl]),
        "e2e_ms": ms([r.e2e for r in ok]),
    }


def launch(extra: list[str]) -> tuple[subprocess.Popen, str]:
    """Start `pagebus serve` on a free port and wait for /health (deadline 10 min)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagebus.frontends.cli", "serve", "--port", str(port), *extra]
    log.info("starting: %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"pagebus serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            pass
        time.sleep(0.5)  # polling a server we do not control, with a deadline
    proc.kill()
    raise SystemExit("pagebus serve did not become healthy within 10 minutes")


def main() -> None:
    setup_logging()
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--launch", action="store_true", help="start pagebus serve here (flags after --)")
    ap.add_argument("--model-name", default=None, help="the served model name (default: the server's own)")
    ap.add_argument("--api-key", default=os.environ.get("PAGEBUS_API_KEY"))
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--request-rate", type=float, nargs="*", default=[], help="Poisson rates (req/s) instead")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--slo", nargs="*", default=["ttft:2000", "tpot:200"], help="goodput SLOs in ms")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    proc = None
    if args.launch:
        proc, args.base_url = launch(extra)
    try:
        levels = [(None, r) for r in args.request_rate] or [(c, None) for c in args.concurrency]
        results = []
        for conc, rate in levels:
            res = asyncio.run(run_level(args, conc, rate))
            log.info("concurrency=%s rate=%s: TTFT p50 %.0f ms, ITL p50 %.0f ms, %.1f tok/s",
                     conc, rate, res["ttft_ms"]["p50"], res["itl_ms"]["p50"], res["output_throughput"])  # fmt: skip
            results.append(res)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    emit({
        "bench": "serve",
        "config": {k: v for k, v in vars(args).items() if k != "api_key"} | {"server_flags": extra},
        "results": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()
