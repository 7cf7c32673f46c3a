"""The decode step's matmuls of builds side by side: kernels/csrc/cpu_ops.cpp as it is ("base")
and edited copies of it (bench/kernel_ab.py builds them), timed on the default model's shapes,
where kernel_ab times whole engines. Prints one JSON object.

    cp kernels/csrc/cpu_ops.cpp /tmp/one.cpp   # then edit the copy
    python -m bench.matmul_ab --variant one=/tmp/one.cpp --control --rows 1 4

A timing is every matmul of one decode step in the engine's order (per layer qkv, o, gate_up,
down; then the LM head) on x of `rows` rows, weights packed as the engine packs them and moved
into 2 MiB pages as the engine moves them (workers/host_memory.py), a separate weight per layer,
so at one row they stream from DRAM as in a single-stream step. Within a round every build runs
in turn, the order rotating; each build's ratio to base is the median over rounds of the
per-round ratios. Every build's outputs are checked bitwise against base's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import cpu_flags, device_name, emit, git_sha, log, setup_logging
from bench.interleave import rotated
from bench.kernel_ab import add_build_options, build, build_sources, ratio_spread

REPS = 3  # each timing the best of this many back-to-back runs


def step_weights(dtype: torch.dtype, layers: int | None = None) -> list[tuple[torch.Tensor, int]]:
    """(packed weight, K) of every matmul of a decode step of the default model, in step order,
    random values in the engine's tile layout, in huge pages."""
    from pagebus.frontends.model_files import default_model_path
    from pagebus.kernels.cpu_native import native_ops
    from pagebus.workers.host_memory import into_huge_pages
    from pagebus.workers.loader import read_config

    mc = read_config(default_model_path())
    h, kvh, d, hid, inter = mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.hidden_size, mc.intermediate_size
    shapes = [((h + 2 * kvh) * d, hid), (hid, h * d), (2 * inter, hid), (hid, inter)] * (
        layers or mc.num_layers
    )
    shapes.append((mc.vocab_size, hid))
    g = torch.Generator().manual_seed(0)
    packed = [
        (native_ops().pack_tiles((torch.randn(n, k, generator=g) * 0.05).to(dtype)), k) for n, k in shapes
    ]
    into_huge_pages([w for w, _ in packed])
    return packed


def measure(
    builds: dict[str, Any],
    weights: list[tuple[torch.Tensor, int]],
    rows: int,
    dtype: torch.dtype,
    rounds: int,
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in {k for _, k in weights}}

    def step(ops: Any) -> Callable[[], list[torch.Tensor]]:
        return lambda: [ops.linear_tiles(xs[k], w) for w, k in weights]

    outs = {name: step(ops)() for name, ops in builds.items()}  # also the first calls' page faults
    ms: dict[str, list[float]] = {name: [] for name in builds}
    for r in range(rounds):
        for name in rotated(list(builds), r):
            run, best = step(builds[name]), float("inf")
            for _ in range(REPS):
                t0 = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - t0)
            ms[name].append(best * 1e3)
    return {
        name: {
            "bitwise_equal_to_base": all(
                torch.equal(a, b) for a, b in zip(outs[name], outs["base"], strict=True)
            ),
            "median_ms": round(statistics.median(runs), 3),
            "over_base": ratio_spread(runs, ms["base"]),
        }
        for name, runs in ms.items()
    }


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_build_options(ap)
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args(argv)
    if args.rounds < 1 or min(args.rows) < 1:
        ap.error("--rounds and --rows must be at least 1")
    sources = build_sources(args)
    builds = {name: build(name, path) for name, path in sources}
    dtype = getattr(torch, args.dtype)
    weights = step_weights(dtype)
    by_rows = {}
    for rows in args.rows:
        log.info("%d rows: %d rounds", rows, args.rounds)
        by_rows[str(rows)] = measure(builds, weights, rows, dtype, args.rounds)
    emit({
        "bench": "matmul_ab", "git_sha": git_sha(), "device": device_name(), "cpu_flags": cpu_flags(),
        "torch_threads": torch.get_num_threads(), "dtype": args.dtype, "matmuls": len(weights),
        "weights_mb": round(sum(w.numel() * w.element_size() for w, _ in weights) / 1e6, 1),
        "rounds": args.rounds, "builds": {name: str(path) for name, path in sources}, "rows": by_rows,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
