"""The machine's own ceilings, measured with torch in the run that compares the engines.

    python -m bench.peer_runners.ceilings          (prints one JSON object; bench/peers.py imports it)

- matmul: dense FLOP/s of torch.mm in float32 and bfloat16, at a large square size and at one layer's
  projections of the benchmarked model (M rows = tokens in the step: 1, a decode batch, a prefill
  chunk), plus its lm_head. FLOPs = 2 * M * K * N.
- fma: float32 FLOP/s of the CPU's widest vector FMAs on every torch thread, 12 independent chains
  a thread, no memory operands (a tiny native loop built here with the machine's compiler): what no
  float32 kernel can beat. The floors in bench/peers.py's targets are worked out from it.
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

FLAGS = ("fma", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")


def cpu_info(path: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The first CPU's model name, its family and model numbers (the generation where the name
    says only "AMD EPYC": family 25 model 1 is Zen 3) and which of FLAGS it has."""
    model: str | None = None
    ids: dict[str, str] = {}
    flags: set[str] = set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key in ("cpu family", "model") and key not in ids:
                    ids[key] = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    cpu_id = f"family {ids['cpu family']} model {ids['model']}" if len(ids) == 2 else None
    return {"model": model, "id": cpu_id, "flags": {f: f in flags for f in FLAGS}}


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


_FMA_LOOP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
// `iters` x 12 independent FMA chains on every torch thread; returns the FLOPs done (the sums are
// kept, so the loop stays).
#ifdef __AVX512F__
using V = __m512;
#define FMA _mm512_fmadd_ps
#define SET1 _mm512_set1_ps
#define LANES 16
#else
using V = __m256;
#define FMA _mm256_fmadd_ps
#define SET1 _mm256_set1_ps
#define LANES 8
#endif
double fma_loop(int64_t iters) {
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const V b = SET1(0.999f), c = SET1(1e-3f);
      V a0 = SET1(1), a1 = SET1(2), a2 = SET1(3), a3 = SET1(4), a4 = SET1(5), a5 = SET1(6), a6 = SET1(7),
        a7 = SET1(8), a8 = SET1(9), a9 = SET1(10), a10 = SET1(11), a11 = SET1(12);
      for (int64_t n = 0; n < iters; ++n) {
        a0 = FMA(a0, b, c); a1 = FMA(a1, b, c); a2 = FMA(a2, b, c); a3 = FMA(a3, b, c);
        a4 = FMA(a4, b, c); a5 = FMA(a5, b, c); a6 = FMA(a6, b, c); a7 = FMA(a7, b, c);
        a8 = FMA(a8, b, c); a9 = FMA(a9, b, c); a10 = FMA(a10, b, c); a11 = FMA(a11, b, c);
        asm("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
        asm("" : "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));
      }
      float total = 0.f;
      for (const V& v : {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11}) {
        float lane;
        std::memcpy(&lane, &v, sizeof lane);
        total += lane;
      }
      sink[t] = total;
    }
  });
  volatile float keep = sink[0];
  (void)keep;
  return 2.0 * LANES * 12 * iters * threads;
}
"""


def fma_flops(min_s: float) -> float | None:
    """float32 FLOP/s of vector FMAs on every torch thread (see the module doc); None where the
    CPU has no FMA or the loop cannot be built (no compiler)."""
    if not cpu_info()["flags"]["fma"]:
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        mod = load_inline(
            name="pagebus_bench_fma_peak", cpp_sources=[_FMA_LOOP], functions=["fma_loop"],
            extra_cflags=["-O2", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
        )  # fmt: skip
    except Exception:  # a bench on a machine without a toolchain still reports the rest
        return None
    iters = 5_000_000  # ~20 ms a call on 2 threads of a 3 GHz AVX2 core
    return mod.fma_loop(iters) / _best_seconds(lambda: mod.fma_loop(iters), min_s)


def dram_bytes_per_s(mib: int, min_s: float) -> float:
    """A copy's bytes read + written a second (the write's read for ownership not counted)."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src), min_s)


def dram_read_bytes_per_s(mib: int, min_s: float) -> float:
    """Bytes read a second by a sum over them: the access a decode's weight stream makes."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    return src.numel() * 4 / _best_seconds(src.sum, min_s)


def memory_probe(mib: int = 256, min_s: float = 0.1) -> dict[str, float]:
    """GB/s of a copy and of a read, quickly (~0.3 s): the memory's state at one moment."""
    return {"copy": dram_bytes_per_s(mib, min_s) / 1e9, "read": dram_read_bytes_per_s(mib, min_s) / 1e9}


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
    fma = fma_flops(min_s)
    out["fma_gflops_float32"] = round(fma / 1e9, 1) if fma else None
    out["dram_gb_per_s"] = round(dram_bytes_per_s(copy_mib, min_s) / 1e9, 2)
    out["dram_read_gb_per_s"] = round(dram_read_bytes_per_s(copy_mib, min_s) / 1e9, 2)
    out["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return out


if __name__ == "__main__":
    print(json.dumps(measure(min_s=0.5)))
