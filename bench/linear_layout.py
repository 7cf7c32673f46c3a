"""Which weight layout multiplies fastest on this CPU: `x @ W^T` with W stored [out, in] (the
checkpoint's layout) or stored [in, out] (a transposed view, what workers/layers/linear.py
allocates on CPUs), at this model's shapes and the row counts that decode and prefill use.

    python -m bench.linear_layout [--dtype float32] [--rows 1 2 4 8 16 32 64 256] [--threads N]

The two layouts alternate, and each figure is the fastest single call of many: on a busy
machine that is the call nobody interrupted.
Prints one JSON object: GFLOP/s per (shape, rows, layout) and the ratio transposed / checkpoint.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.common import cpu_flags, emit, setup_logging

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536, vocabulary 49152.
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def _best(x: torch.Tensor, w: torch.Tensor, reps: int) -> float:
    """The fastest of `reps` products: on a shared machine, the run nobody interrupted."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - t)
    return best


def measure(dtype: torch.dtype, rows: list[int], rounds: int) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=dtype)
        w_t = w.t().contiguous().t()  # same values, [in, out] storage
        out[name] = {}
        for m in rows:
            x = torch.randn(m, k, dtype=dtype)
            reps = max(5, min(100, int(1e9 / (2 * m * n * k))))
            best = {"checkpoint": float("inf"), "transposed": float("inf")}
            for _ in range(rounds):
                for layout, weight in (("checkpoint", w), ("transposed", w_t)):
                    F.linear(x, weight)
                    best[layout] = min(best[layout], _best(x, weight, reps))
            flops = 2 * m * n * k
            out[name][str(m)] = {
                "checkpoint_gflops": round(flops / best["checkpoint"] / 1e9, 1),
                "transposed_gflops": round(flops / best["transposed"] / 1e9, 1),
                "ratio": round(best["checkpoint"] / best["transposed"], 2),
            }
    return out


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = measure(getattr(torch, args.dtype), args.rows, args.rounds)
    emit({
        "bench": "linear_layout",
        "cpu_flags": cpu_flags(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "dtype": args.dtype, "results": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()
