"""Soak: bench.load's bursts (streaming clients, random hang-ups, seeded) back to back for a duration,
with latency percentiles and the server's RSS (the serve process and every engine process) over time.

    python -m bench.soak --launch --duration 600 [--clients 64] [--png soak.png] [-- serve flags]
    python -m bench.soak --base-url http://127.0.0.1:8000 --pid 1234 --duration 600

Each --interval seconds gives a point: requests finished in it by outcome, TTFT and end-to-end
percentiles of those completed, and RSS. RSS drift compares the end with the end of --warmup
(default a tenth of the duration): within 10% passes. After the last burst the server must be idle
(nothing running or waiting, no KV block held), no request lost and every completed one equal to
its solo text. Prints one JSON object (also written to --json); --png draws it (needs matplotlib,
the `bench` extra). Exit 1 on a failed check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from typing import Any

import aiohttp
import psutil

from bench.common import emit, log, percentiles, setup_logging
from bench.load import Report, ReqResult, combos, settle, solo_texts, verdict, wave

MAX_RSS_DRIFT = 0.10


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (the server and its engine)."""
    root = psutil.Process(pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def windows(results: list[ReqResult], rss: list[tuple[float, int]], t0: float, interval: float) -> list[dict]:
    """One point per interval: what finished in it, and the RSS sampled at its end."""
    points = []
    n = int(max([r.t_end - t0 for r in results] + [t for t, _ in rss] + [0.0]) // interval) + 1
    for k in range(n):
        lo, hi = k * interval, (k + 1) * interval
        done = [r for r in results if lo <= r.t_end - t0 < hi]
        ok = [r for r in done if r.outcome == "completed"]
        mem = [b for t, b in rss if t < hi]
        points.append(
            {
                "t_s": hi,
                "finished": len(done),
                "completed": len(ok),
                "outcomes": {o: sum(r.outcome == o for r in done) for o in {r.outcome for r in done}},
                # None when nothing completed in the window (not a latency of 0)
                "ttft_ms": percentiles([r.ttft * 1e3 for r in ok if r.ttft is not None]) if ok else None,
                "e2e_ms": percentiles([r.e2e * 1e3 for r in ok if r.e2e is not None]) if ok else None,
                "rss_mib": round(mem[-1] / 2**20, 1) if mem else None,
            }
        )
    return points


async def soak(args: argparse.Namespace, pid: int) -> dict[str, Any]:
    rng, report = random.Random(args.seed), Report()
    cs = combos(args.max_tokens)
    rss: list[tuple[float, int]] = []
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        solo = await solo_texts(session, args.base_url, cs)
        t0 = time.perf_counter()

        async def sample() -> None:
            while True:
                rss.append((time.perf_counter() - t0, tree_rss(pid)))
                await asyncio.sleep(args.rss_every)  # the sampling period

        sampler = asyncio.create_task(sample())
        waves = 0
        while time.perf_counter() - t0 < args.duration:
            await wave(session, args.base_url, args.clients, rng, cs, args.disconnect, report, args.timeout)
            waves += 1
            log.info(
                "soak: wave %d done at %.0fs, %d requests",
                waves,
                time.perf_counter() - t0,
                len(report.results),
            )
        after = await settle(session, args.base_url)
        rss.append((time.perf_counter() - t0, tree_rss(pid)))
        sampler.cancel()
    warm = [b for t, b in rss if t <= args.warmup] or [rss[0][1]]
    rss_warm, rss_end = warm[-1], rss[-1][1]
    out = verdict(report.results, solo)
    out.update(
        duration_s=round(time.perf_counter() - t0, 1),
        waves=waves,
        clients_per_wave=args.clients,
        statuses=dict(report.statuses),
        engine_after=after,
        rss_after_warmup_mib=round(rss_warm / 2**20, 1),
        rss_end_mib=round(rss_end / 2**20, 1),
        rss_drift=round(rss_end / rss_warm - 1, 4),
        series=windows(report.results, rss, t0, args.interval),
    )
    checks = {
        "nothing_lost": out["lost"] == 0,
        "outputs_equal_solo": out["mismatched_vs_solo"] == 0,
        "idle_after": not any(after.values()),
        "rss_drift_within_10pct": abs(out["rss_drift"]) <= MAX_RSS_DRIFT,
    }
    out["checks"], out["ok"] = checks, all(checks.values())
    return out


def draw(out: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = out["series"]
    t = [p["t_s"] / 60 for p in s]
    fig, (lat, mem) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for metric, style in (("ttft_ms", "-"), ("e2e_ms", "--")):
        for q in ("p50", "p99"):
            lat.plot(
                t, [p[metric][q] if p[metric] else math.nan for p in s], style, label=f"{metric[:-3]} {q}"
            )
    lat.set_ylabel("ms")
    lat.set_title(f"pagebus soak: {out['clients_per_wave']} clients per burst, {out['requests']} requests")
    lat.legend()
    mem.plot(
        t, [p["rss_mib"] if p["rss_mib"] is not None else math.nan for p in s], label="server + engine RSS"
    )
    mem.axhline(out["rss_after_warmup_mib"], color="grey", linestyle=":", label="after warm-up")
    mem.set_ylabel("MiB")
    mem.set_xlabel("minutes")
    mem.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="a running server (without /v1); needs --pid")
    ap.add_argument("--pid", type=int, default=None, help="the server's pid, for RSS")
    ap.add_argument("--launch", action="store_true", help="start pagebus serve here (flags after --)")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before RSS is the baseline")
    ap.add_argument("--interval", type=float, default=30.0, help="seconds per point of the series")
    ap.add_argument("--rss-every", type=float, default=2.0, help="seconds between RSS samples")
    ap.add_argument("--clients", type=int, default=64, help="concurrent streaming clients per burst")
    ap.add_argument("--disconnect", type=float, default=0.3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the JSON here")
    ap.add_argument("--png", default=None, help="draw latency and RSS over time here")
    args, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    if args.warmup is None:
        args.warmup = args.duration / 10
    proc = None
    if args.launch:
        from bench.serve import launch

        proc, url = launch(["--max-waiting", str(4 * args.clients), *extra])
        args.base_url, args.pid = url.removesuffix("/v1"), proc.pid
    if not args.base_url or args.pid is None:
        raise SystemExit("give --launch, or --base-url with --pid")
    try:
        out = asyncio.run(soak(args, args.pid))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.png:
        draw(out, args.png)
    log.info("soak: %s", {k: out[k] for k in ("outcomes", "lost", "rss_drift", "checks")})
    emit({"bench": "soak", **out})
    raise SystemExit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
