"""The weights in huge pages (workers/host_memory.py into_huge_pages) against torch's own
allocations: two engines in this process, one with each, their runs interleaved, the order
alternating by round. Prints one JSON object: each workload's per-round time ratios (huge / plain)
and their median.

    python -m bench.huge_page_weights [--rounds 10]

Workloads: 64 requests x 128 prompt tokens x 128 new, and a single stream of 32 x 128 (greedy,
ignore_eos, the default model in `dtype auto`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.common import cpu_flags, device_name, emit, git_sha, log, setup_logging
from bench.peers import pagebus_generate


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    import pagebus.workers.runner as runner_mod

    huge, _ = pagebus_generate("auto")
    real = runner_mod.into_huge_pages
    runner_mod.into_huge_pages = lambda tensors: 0  # the second engine keeps torch's allocations
    try:
        plain, _ = pagebus_generate("auto")
    finally:
        runner_mod.into_huge_pages = real
    rng = random.Random(0)
    workloads = {
        "64x128x128": ([[rng.randrange(1000, 40000) for _ in range(128)] for _ in range(64)], 128),
        "single_32x128": ([[rng.randrange(1000, 40000) for _ in range(32)]], 128),
    }
    for gen in (huge, plain):
        gen(workloads["64x128x128"][0][:4], 4)  # first calls: thread pools, the decode stack
    times: dict[str, dict[str, list[float]]] = {w: {"huge": [], "plain": []} for w in workloads}
    for r in range(args.rounds):
        order = [("huge", huge), ("plain", plain)]
        for w, (prompts, n) in workloads.items():
            for name, gen in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                gen(prompts, n)
                times[w][name].append(time.perf_counter() - t0)
        log.info("round %d of %d", r + 1, args.rounds)
    out = {}
    for w, t in times.items():
        ratios = [a / b for a, b in zip(t["huge"], t["plain"], strict=True)]
        out[w] = {
            "huge_over_plain_time": round(statistics.median(ratios), 4),
            "rounds": [round(x, 4) for x in ratios],
            "median_s": {k: round(statistics.median(v), 3) for k, v in t.items()},
        }
    emit({
        "bench": "huge_page_weights", "git_sha": git_sha(), "device": device_name(), "cpu_flags": cpu_flags(),
        "rounds": args.rounds, "workloads": out,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
