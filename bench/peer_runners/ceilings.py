"""The machine's own ceilings, measured with torch in the run that compares the engines.

    python -m bench.peer_runners.ceilings          (prints one JSON object; bench/peers.py imports it)

- matmul: dense FLOP/s of torch.mm in float32 and bfloat16, at a large square size and at one layer's
  projections of the benchmarked model (M rows = tokens in the step: 1, a decode batch, a prefill
  chunk), plus its lm_head. FLOPs = 2 * M * K * N.
- dram: bytes/s of a large tensor copy, counting the read and the write (2 x size per copy), on
  buffers far larger than any cache.
- cpu: model name and the flags that decide which dtypes are native (avx512_bf16, amx_bf16).
Each measurement repeats until it has run for `min_s` after a warm-up, and reports the best
repeat: the machine is shared, and the best is the closest to what it can do.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")


def cpu_info(path: str = "/proc/cpuinfo") -> dict[str, Any]:
    model: str | None = None
    flags: set[str] = set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": {f: f in flags for f in FLAGS}}


def native_bf16(flags: dict[str, bool]) -> bool:
    """bf16 matmuls run in hardware (AVX-512 BF16 or AMX); elsewhere torch emulates them."""
    return bool(flags.get("avx512_bf16") or flags.get("amx_bf16"))


def _best_seconds(fn: Callable[[], object], min_s: float, max_reps: int = 1000) -> float:
    fn()  # warm-up: first-touch pages, oneDNN primitive creation
    best, spent, reps = float("inf"), 0.0, 0
    while (spent < min_s or reps < 3) and reps < max_reps:
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def matmul_flops(m: int, shapes: list[tuple[int, int]], dtype: torch.dtype, min_s: float) -> float:
    """FLOP/s of M x K @ K x N for every (K, N) in `shapes`, run back to back (one layer's worth)."""
    g = torch.Generator().manual_seed(0)
    mats = [
        (torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype))
        for k, n in shapes
    ]

    def run() -> None:
        for a, b in mats:
            torch.mm(a, b)

    flops = sum(2 * m * k * n for k, n in shapes)
    return flops / _best_seconds(run, min_s)


def dram_bytes_per_s(mib: int, min_s: float) -> float:
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src), min_s)


def layer_shapes(hidden: int, intermediate: int, q_dim: int, kv_dim: int) -> list[tuple[int, int]]:
    """(K, N) of one decoder layer's projections: q, k, v, o, gate, up, down."""
    return [
        (hidden, q_dim), (hidden, kv_dim), (hidden, kv_dim), (q_dim, hidden),
        (hidden, intermediate), (hidden, intermediate), (intermediate, hidden),
    ]  # fmt: skip


def measure(
    model_dims: dict[str, int] | None = None,
    rows: tuple[int, ...] = (1, 32, 2048),
    square: int = 2048,
    copy_mib: int = 512,
    min_s: float = 1.0,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
) -> dict[str, Any]:
    """Every ceiling above. model_dims: hidden, intermediate, q_dim, kv_dim, vocab (None: square only)."""
    out: dict[str, Any] = {
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
        "matmul_gflops": {},
    }
    for name in dtypes:
        dt = getattr(torch, name)
        res: dict[str, Any] = {
            f"square_{square}": round(matmul_flops(square, [(square, square)], dt, min_s) / 1e9, 3)
        }
        if model_dims:
            shapes = layer_shapes(
                model_dims["hidden"], model_dims["intermediate"], model_dims["q_dim"], model_dims["kv_dim"]
            )
            for m in rows:
                res[f"layer_m{m}"] = round(matmul_flops(m, shapes, dt, min_s / 2) / 1e9, 3)
            for m in rows[:2]:  # lm_head runs on the rows that sample: decode steps, not prefill
                head = [(model_dims["hidden"], model_dims["vocab"])]
                res[f"lm_head_m{m}"] = round(matmul_flops(m, head, dt, min_s / 2) / 1e9, 3)
        out["matmul_gflops"][name] = res
    out["dram_gb_per_s"] = round(dram_bytes_per_s(copy_mib, min_s) / 1e9, 2)
    out["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return out


if __name__ == "__main__":
    print(json.dumps(measure(min_s=0.5)))
