"""Load with disconnects against `pagebus serve`: many concurrent streaming clients, some of which
hang up mid-stream, bursts past --max-waiting, long and short prompts, every one seeded.

    python -m bench.load --launch [--clients 200] [--disconnect 0.3] [-- engine/serve flags]
    python -m bench.load --base-url http://127.0.0.1:8000 --clients 200

Before the burst, each distinct (prompt, seed, max_tokens) runs alone; afterwards every completed
request must equal its solo text, and the server must be idle: nothing running or waiting and no
KV block held. A 429 is retried after its retry-after (a refusal, not a loss); a request is lost
when it neither completed, nor was hung up on purpose, nor was refused for good. Prints one JSON
object; exit 1 when anything was lost, leaked or differed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.common import emit, log, percentiles, setup_logging

SHORT = ["Tell me about rivers.", "Name a colour.", "What is 2+2?", "Write a haiku about snow."]
LONG = [
    " ".join(f"Line {i}: the {w} walked past the old mill and kept going." for i in range(12))
    for w in ("fox", "cat", "dog", "owl")
]
Combo = tuple[str, int, int]  # prompt, seed, max_tokens


def combos(max_tokens: int) -> list[Combo]:
    return [(p, 1000 + i, max(2, max_tokens - 3 * (i % 4))) for i, p in enumerate(SHORT + LONG)]


def body(combo: Combo, stream: bool) -> dict[str, Any]:
    prompt, seed, max_tokens = combo
    return {"prompt": prompt, "seed": seed, "max_tokens": max_tokens, "temperature": 0.8, "stream": stream}


@dataclass
class ReqResult:
    combo: Combo
    outcome: str = "lost"  # completed | disconnected | refused | error | lost
    text: str = ""
    ttft: float | None = None
    e2e: float | None = None
    retries: int = 0  # attempts, the first included
    error_kind: str | None = None
    t_end: float = 0.0


@dataclass
class Report:
    results: list[ReqResult] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)


async def one_client(
    session: aiohttp.ClientSession, url: str, combo: Combo, cut: int | None, report: Report, patience: float
) -> ReqResult:
    """One streaming request; `cut`: hang up after that many token events. A 429 is retried after
    its retry-after for up to `patience` seconds; then the request counts as refused."""
    r = ReqResult(combo)
    report.results.append(r)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < patience:
        r.retries += 1
        try:
            async with session.post(url, json=body(combo, True)) as resp:
                report.statuses[resp.status] += 1
                if resp.status == 429:
                    await resp.read()
                    await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                    continue
                if resp.status != 200:
                    r.outcome, r.error_kind = "error", f"http_{resp.status}"
                    return r
                events = 0
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        r.outcome, r.e2e = "completed", time.perf_counter() - t0
                        return r
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        r.outcome, r.error_kind = "error", str(ev["error"].get("code"))
                        return r
                    r.text += "".join(c["text"] for c in ev["choices"])
                    if r.ttft is None:
                        r.ttft = time.perf_counter() - t0
                    events += 1
                    if cut is not None and events >= cut:
                        r.outcome = "disconnected"
                        return r  # leaving the context manager closes the connection
                r.outcome, r.error_kind = "error", "stream_ended_without_done"
                return r
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            r.outcome, r.error_kind = "error", type(e).__name__
            return r
        finally:
            r.t_end = time.perf_counter()
    r.outcome = "refused"
    return r


async def solo_texts(session: aiohttp.ClientSession, base: str, cs: list[Combo]) -> dict[Combo, str]:
    out = {}
    for c in cs:
        async with session.post(f"{base}/v1/completions", json=body(c, False)) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise SystemExit(f"solo request failed: {resp.status} {data}")
            out[c] = data["choices"][0]["text"]
    return out


async def engine_state(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """running, waiting and KV usage from /metrics."""
    async with session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    want = {
        "pagebus:num_requests_running": "running",
        "pagebus:num_requests_waiting": "waiting",
        "pagebus:kv_cache_usage_perc": "kv_usage",
    }
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in want:
            out[want[name]] = float(value)
    return out


async def settle(session: aiohttp.ClientSession, base: str, deadline_s: float = 60.0) -> dict[str, float]:
    """The engine's state once idle (aborts land a step later), or as it is at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        state = await engine_state(session, base)
        if not any(state.values()) or time.monotonic() > end:
            return state
        await asyncio.sleep(0.1)  # polling /metrics


async def wave(
    session: aiohttp.ClientSession,
    base: str,
    clients: int,
    rng: random.Random,
    cs: list[Combo],
    disconnect: float,
    report: Report,
    patience: float = 900.0,
) -> list[ReqResult]:
    """All clients at once (a burst), each drawing a combo and maybe a point to hang up."""
    url = f"{base}/v1/completions"
    plan = [
        (rng.choice(cs), rng.randint(1, 3) if rng.random() < disconnect else None) for _ in range(clients)
    ]
    return await asyncio.gather(*(one_client(session, url, c, cut, report, patience) for c, cut in plan))


def verdict(results: list[ReqResult], solo: dict[Combo, str]) -> dict[str, Any]:
    outcomes = Counter(r.outcome for r in results)
    mismatched = [r.combo[0][:40] for r in results if r.outcome == "completed" and r.text != solo[r.combo]]
    return {
        "requests": len(results),
        "outcomes": dict(outcomes),
        "errors_by_kind": dict(Counter(r.error_kind for r in results if r.error_kind)),
        "lost": outcomes.get("lost", 0),
        "mismatched_vs_solo": len(mismatched),
        "ttft_ms": percentiles([r.ttft * 1e3 for r in results if r.ttft is not None]),
        "e2e_ms": percentiles([r.e2e * 1e3 for r in results if r.e2e is not None]),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng, report = random.Random(args.seed), Report()
    cs = combos(args.max_tokens)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    conn = aiohttp.TCPConnector(limit=0)  # every client its own connection: that is the load
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        solo = await solo_texts(session, args.base_url, cs)
        t0 = time.perf_counter()
        results = await wave(
            session, args.base_url, args.clients, rng, cs, args.disconnect, report, args.timeout
        )
        wall = time.perf_counter() - t0
        after = await settle(session, args.base_url)
    out = verdict(results, solo)
    out.update(
        clients=args.clients, wall_s=round(wall, 2), statuses=dict(report.statuses), engine_after=after
    )
    out["leaked_kv_usage"] = after.get("kv_usage", 0.0)
    out["ok"] = not out["lost"] and not out["mismatched_vs_solo"] and not any(after.values())
    out["ok"] = out["ok"] and set(report.statuses) <= {200, 429} and not out["errors_by_kind"]
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--base-url", default=None, help="a running server (without /v1)")
    ap.add_argument("--launch", action="store_true", help="start pagebus serve here (flags after --)")
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--disconnect", type=float, default=0.3, help="share of clients that hang up mid-stream")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per request at most, 429 retries included"
    )
    ap.add_argument("--seed", type=int, default=0)


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    args, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    proc = None
    if args.launch:
        from bench.serve import launch

        proc, url = launch(["--max-waiting", "64", *extra])
        args.base_url = url.removesuffix("/v1")
    if not args.base_url:
        raise SystemExit("give --base-url or --launch")
    try:
        out = asyncio.run(run(args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    log.info("load: %s", {k: out[k] for k in ("outcomes", "lost", "mismatched_vs_solo", "ok")})
    emit({"bench": "load", **out})
    raise SystemExit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
