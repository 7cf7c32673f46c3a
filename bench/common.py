"""Shared bits of the bench scripts: provenance, seeds, percentiles, one JSON object out."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("bench")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s bench: %(message)s")


def git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu} x{os.cpu_count()}"


def cpu_flags() -> list[str]:
    """The SIMD flags that decide kernels and dtypes (avx*, sse4*, fma, amx*)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next(x for x in f if x.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(x for x in line.split(":", 1)[1].split() if x.startswith(("avx", "sse4", "fma", "amx")))


def best_of(fn: Callable[[], object], reps: int) -> float:
    """The fastest of `reps` calls of fn, in seconds (the least disturbed by the rest of the machine)."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{p}": 0.0 for p in ps} | {"mean": 0.0}
    xs = sorted(values)
    out = {f"p{p}": xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] for p in ps}
    out["mean"] = sum(xs) / len(xs)
    return out


def emit(result: dict[str, Any]) -> None:
    """The one JSON object a bench script prints on stdout."""
    result = {"git_sha": git_sha(), "device": device_name(), **result}
    sys.stdout.write(json.dumps(result, indent=None, sort_keys=False) + "\n")
    sys.stdout.flush()
