"""How steady this machine is right now: whether a speed figure taken on it can be trusted.

    python -m bench.steadiness [--seconds 60] [--threads 1]

For `--seconds`, round after round, on `--threads` threads (one by default: a core's own swings):
- fma: bench/peer_runners/ceilings.py's FMA loop (registers and the FMA pipes only);
- matmul: the engine's tile matmul (float16 tiles, float32 x; torch.mm in float32 where this build
  has no tiles) on 48 rows x 576 x 256 columns, whose operands stay in L2: what the engine's
  kernels do, with loads from cache beside every FMA;
- copy: a 64 MiB tensor copy (DRAM bytes/s, read and write counted).
Prints one JSON object: each probe's min / p10 / median / max over the rounds, and the matmul's
ratio to the FMA loop of its round at p10 and median.

On a quiet core the matmul's p10 sits near its median. On shared cloud machines it does not
always: a Zen 3 VM (2 vCPU) gave, over 60 s, the FMA loop at 100 (p10) / 102 (median) GFLOP/s
while the matmul fell to 62 / 93: for a tenth of the rounds it ran at 0.6 of the FMA loop where it
usually runs at 0.9. Whatever shares the core from outside the VM takes its loads and caches and
leaves the FMA pipes alone, so the FMA peak a run measures stays put while every engine's kernels
slow down. A speed figure from such a window moves by that much, whichever code it measures.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from pagebus.kernels.cpu_native import linear_tiles, pack_linear

from bench.common import cpu_flags, emit, setup_logging
from bench.peer_runners import ceilings

ROWS, K, N = 48, 576, 256


def matmul_probe() -> tuple[str, Callable[[], object]]:
    """(what it runs, a call of it) for the L2-resident matmul."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(N, K, generator=g), torch.randn(ROWS, K, generator=g)
    tiles = pack_linear(w, half=True)
    if tiles is not None:
        return "tile matmul, float16 tiles", lambda: linear_tiles(x, tiles)
    return "torch.mm float32", lambda: torch.mm(x, w.t())


def per_second(fn: Callable[[], object], work: float, reps: int) -> float:
    """work / seconds of one call, over `reps` calls."""
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return work * reps / (time.perf_counter() - t)


def spread(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "min": round(s[0], 2),
        "p10": round(s[len(s) // 10], 2),
        "median": round(statistics.median(s), 2),
        "max": round(s[-1], 2),
    }


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    what, mm = matmul_probe()
    src = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    mm()
    dst.copy_(src)
    fma: list[float] = []
    matmul: list[float] = []
    copy: list[float] = []
    ratio: list[float] = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end or len(matmul) < 3:  # the FMA loop is absent without FMA
        f = ceilings.fma_flops(0.02)
        m = per_second(mm, 2 * ROWS * K * N, 200)
        copy.append(per_second(lambda: dst.copy_(src), 2 * src.numel(), 3) / 1e9)
        matmul.append(m / 1e9)
        if f:
            fma.append(f / 1e9)
            ratio.append(m / f)
    emit(
        {
            "bench": "steadiness",
            "cpu_flags": cpu_flags(),
            "threads": args.threads,
            "seconds": args.seconds,
            "rounds": len(matmul),
            "matmul": what,
            "matmul_shape": [ROWS, K, N],
            "fma_gflops": spread(fma) if fma else None,
            "matmul_gflops": spread(matmul),
            "copy_gb_per_s": spread(copy),
            "matmul_over_fma": {
                "p10": round(sorted(ratio)[len(ratio) // 10], 3),
                "median": round(statistics.median(ratio), 3),
            }
            if ratio
            else None,
        }
    )


if __name__ == "__main__":
    main()
