"""Where a batched bf16 decode step's time goes on this CPU, against the floors it cannot beat.

    python -m bench.decode_floor [--batch 32 64] [--context 192] [--dtype bfloat16]

float32 also times attention over float16 caches of the same values (--kv-cache-dtype float16).

The default model's decode stack op by op (csrc/cpu_ops.cpp, as DecodeStack runs it), on random
weights and caches of its shapes, a separate weight set and cache per layer as in the engine (the
weights in 2 MiB pages, in step order, as the engine moves them), so weights and K/V come from
DRAM as they do there. The block tables follow the engine's allocation
order (a fresh FIFO pool): each sequence's prompt blocks in one run, the blocks it grows by during
decode interleaved with the other sequences'. Beside each op, its floor measured in the same run:
- matmuls and the LM head: their FLOPs at torch.mm's square ceiling (bench/peer_runners/ceilings.py);
- attention: a plain read of exactly the K/V blocks it reads, in the same order (a tiny native
  reader built here), and of as many blocks lying in order, one sequence's after another's; and
  the kernel itself on one layer's cache for every call (K/V in L3: its arithmetic alone);
- the weights (the floor of a step of one or a few rows, which streams them): each op's as a plain
  read, layer after layer as the op reads them, and all of them as one region.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import best_of as common_best_of
from bench.common import cpu_flags, device_name, emit, git_sha, log, setup_logging
from bench.peer_runners import ceilings

_READER = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
static int64_t lane_sum(__m256i acc) {
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  int64_t s = 0;
  for (int32_t x : lanes) s += x;
  return s;
}

// Every row of every sequence's blocks, K then V, in table order (as decode attention reads
// them), summed so the loads stay; the next-but-one block prefetched as the kernel does.
int64_t read_blocks(torch::Tensor k, torch::Tensor v, torch::Tensor tables, torch::Tensor lens) {
  const int32_t* t = tables.data_ptr<int32_t>();
  const int32_t* L = lens.data_ptr<int32_t>();
  const int64_t width = tables.size(1), row = k.stride(1) * k.element_size(), block = k.stride(0) * k.element_size();
  std::atomic<int64_t> total{0};
  at::parallel_for(0, tables.size(0), 1, [&](int64_t b0, int64_t b1) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t b = b0; b < b1; ++b)
      for (const char* base : {static_cast<const char*>(k.data_ptr()), static_cast<const char*>(v.data_ptr())}) {
        const int64_t nb = (L[b] + 15) / 16;
        for (int64_t j = 0; j < nb; ++j) {
          const char* p = base + t[b * width + j] * block;
          if (j + 2 < nb)
            for (int64_t o = 0; o < block; o += 64) _mm_prefetch(base + t[b * width + j + 2] * block + o, _MM_HINT_T0);
          const int64_t bytes = std::min<int64_t>(16, L[b] - 16 * j) * row;
          for (int64_t o = 0; o < bytes; o += 32)
            acc = _mm256_add_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o)));
        }
      }
    total += lane_sum(acc);
  });
  return total;
}

// A plain read of a contiguous tensor, each thread a contiguous share front to back (the hardware
// prefetcher's best case), summed so the loads stay: the floor of a GEMV that streams its weights.
int64_t read_flat(torch::Tensor w) {
  const char* base = static_cast<const char*>(w.data_ptr());
  const int64_t lines = w.numel() * w.element_size() / 64;
  std::atomic<int64_t> total{0};
  at::parallel_for(0, lines, 256, [&](int64_t l0, int64_t l1) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t l = l0; l < l1; ++l) {
      acc = _mm256_add_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 64 * l)));
      acc = _mm256_add_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 64 * l + 32)));
    }
    total += lane_sum(acc);
  });
  return total;
}
"""


def _reader() -> Any:
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="pagebus_bench_read_blocks", cpp_sources=[_READER], functions=["read_blocks", "read_flat"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
    )  # fmt: skip


def engine_tables(batch: int, context: int, prompt: int) -> torch.Tensor:
    """Block ids as a fresh FIFO pool hands them out: prompts first, one after another, then every
    decode block boundary gives each sequence its next block, in sequence order."""
    first = -(-prompt // 16)
    total = -(-context // 16)
    rows = []
    for b in range(batch):
        own = [1 + b * first + j for j in range(first)]
        own += [1 + batch * first + g * batch + b for g in range(total - first)]
        rows.append(own)
    return torch.tensor(rows, dtype=torch.int32)


def best_of(fn: Callable[[], object], reps: int) -> float:
    fn()  # first call: builds, faults pages in
    return common_best_of(fn, reps)


def measure(
    batch: int, context: int, prompt: int, dtype: torch.dtype, reps: int, ceiling_flops: float
) -> dict[str, Any]:
    from pagebus.frontends.model_files import default_model_path
    from pagebus.kernels.cpu_native import k_cache_shape, native_ops
    from pagebus.workers.host_memory import into_huge_pages
    from pagebus.workers.loader import read_config

    ops, reader = native_ops(), _reader()
    mc = read_config(default_model_path())
    h, kvh, d, hid, inter = mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.hidden_size, mc.intermediate_size
    g = torch.Generator().manual_seed(0)

    def weights(n: int, k: int) -> torch.Tensor:
        return ops.pack_tiles((torch.randn(n, k, generator=g) * 0.05).to(dtype))

    tables = engine_tables(batch, context, prompt)
    num_blocks = int(tables.max()) + 1
    layers = [
        {
            "qkv": weights((h + 2 * kvh) * d, hid),
            "o": weights(hid, h * d),
            "gate_up": weights(2 * inter, hid),
            "down": weights(hid, inter),
            "norm": torch.ones(hid, dtype=dtype),
            "k": torch.randn(num_blocks, 16, kvh, d, generator=g).to(dtype),
            "v": torch.randn(num_blocks, 16, kvh, d, generator=g).to(dtype),
        }
        for _ in range(mc.num_layers)
    ]
    # The engine's K layout (token pairs on AVX-512 BF16 builds): the same values as "k".
    k_layout = k_cache_shape(num_blocks, 16, kvh, d, dtype)
    for w in layers:
        k = w["k"]
        w["k_engine"] = (
            k
            if len(k_layout) == 4
            else k.view(num_blocks, 16, kvh, d // 2, 2).permute(0, 2, 3, 1, 4).contiguous()
        )
    lm_head = weights(mc.vocab_size, hid)
    # in 2 MiB pages, in step order, as the engine holds its weights (workers/host_memory.py)
    into_huge_pages([w[op] for w in layers for op in ("qkv", "o", "gate_up", "down")] + [lm_head])
    lens = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    positions = torch.full((batch,), context - 1, dtype=torch.int64)
    slots = (tables[:, (context - 1) // 16].long() * 16 + (context - 1) % 16).contiguous()
    inv = 1.0 / (mc.rope_theta ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(context + 1).float()[:, None] * inv[None]
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).contiguous()
    x = torch.randn(batch, hid, generator=g).to(dtype)
    qkv = torch.randn(batch, (h + 2 * kvh) * d, generator=g).to(dtype)
    a = torch.randn(batch, h * d, generator=g).to(dtype)
    gu = torch.randn(batch, 2 * inter, generator=g).to(dtype)
    s = torch.randn(batch, inter, generator=g).to(dtype)
    scale = d**-0.5

    def each(fn: Callable[[dict[str, torch.Tensor]], object]) -> Callable[[], None]:
        def run() -> None:
            for w in layers:
                fn(w)

        return run

    timed: dict[str, Callable[[], object]] = {
        "qkv": each(lambda w: ops.linear_tiles(x, w["qkv"])),
        "attention": each(lambda w: ops.qkv_decode_attention(
            qkv, h, kvh, positions, cos_sin, w["k_engine"], w["v"], slots, tables, lens, starts, scale)),
        "o": each(lambda w: ops.linear_tiles(a, w["o"])),
        "gate_up": each(lambda w: ops.linear_tiles(x, w["gate_up"])),
        "down": each(lambda w: ops.linear_tiles(s, w["down"])),
        "norms": each(lambda w: (ops.add_rms_norm(x, x, w["norm"], 1e-5), ops.add_rms_norm(x, x, w["norm"], 1e-5))),
        "silu_and_mul": each(lambda w: ops.silu_and_mul(gu)),
        "lm_head": lambda: ops.linear_tiles(x, lm_head),
    }  # fmt: skip
    ms = {k: round(best_of(fn, reps) * 1e3, 3) for k, fn in timed.items()}
    rows_k = each(lambda w: ops.qkv_decode_attention(
        qkv, h, kvh, positions, cos_sin, w["k"], w["v"], slots, tables, lens, starts, scale))  # fmt: skip
    attention_rows_k = round(best_of(rows_k, reps) * 1e3, 3) if len(k_layout) == 5 else ms["attention"]
    f16: dict[str, float] = {}
    if (
        dtype is torch.float32 and ops.f16_built()
    ):  # --kv-cache-dtype float16: the same values, half the bytes
        for w in layers:
            w["k16"], w["v16"] = w["k"].half(), w["v"].half()
        f16["attention_ms_f16_cache"] = round(
            best_of(
                each(
                    lambda w: ops.qkv_decode_attention(
                        qkv,
                        h,
                        kvh,
                        positions,
                        cos_sin,
                        w["k16"],
                        w["v16"],
                        slots,
                        tables,
                        lens,
                        starts,
                        scale,
                    )
                ),
                reps,
            )
            * 1e3,
            3,
        )
        f16["attention_f16_cache_in_cache_ms"] = round(best_of(lambda: [ops.qkv_decode_attention(
            qkv, h, kvh, positions, cos_sin, layers[0]["k16"], layers[0]["v16"], slots, tables, lens, starts, scale)
            for _ in layers], reps) * 1e3, 3)  # fmt: skip
    one = layers[0]  # every call on one layer's cache: its K/V stay in L3, so this is the arithmetic
    in_cache = best_of(
        lambda: [
            ops.qkv_decode_attention(
                qkv, h, kvh, positions, cos_sin, one["k_engine"], one["v"], slots, tables, lens, starts, scale
            )
            for _ in layers
        ],
        reps,
    )
    flops = {
        "qkv": hid * (h + 2 * kvh) * d, "o": h * d * hid, "gate_up": hid * 2 * inter, "down": inter * hid,
    }  # fmt: skip
    matmul_floor = {
        k: round(2 * batch * n * mc.num_layers / ceiling_flops * 1e3, 3) for k, n in flops.items()
    }
    matmul_floor["lm_head"] = round(2 * batch * hid * mc.vocab_size / ceiling_flops * 1e3, 3)
    kv_bytes = 2 * batch * context * kvh * d * torch.empty((), dtype=dtype).element_size() * mc.num_layers
    scattered = best_of(lambda: [reader.read_blocks(w["k"], w["v"], tables, lens) for w in layers], reps)
    in_order = torch.arange(1, tables.numel() + 1, dtype=torch.int32).view_as(tables)
    contiguous = best_of(lambda: [reader.read_blocks(w["k"], w["v"], in_order, lens) for w in layers], reps)
    # the weights: each op's read as a plain stream, layer after layer as the op runs them, and
    # all of them as one region (what a GEMV step would read if nothing split it into regions)
    matmuls = ("qkv", "o", "gate_up", "down")
    weight_bytes = {k: sum(w[k].numel() * w[k].element_size() for w in layers) for k in matmuls}
    weight_bytes["lm_head"] = lm_head.numel() * lm_head.element_size()
    read_ms = {k: round(best_of(each(lambda w, k=k: reader.read_flat(w[k])), reps) * 1e3, 3) for k in matmuls}
    read_ms["lm_head"] = round(best_of(lambda: reader.read_flat(lm_head), reps) * 1e3, 3)
    one_region = torch.ones(sum(weight_bytes.values()), dtype=torch.uint8)
    one_read_ms = round(best_of(lambda: reader.read_flat(one_region), reps) * 1e3, 3)
    # In step order (each layer's qkv, o, gate_up, down, then the LM head): the matmuls alone, a
    # plain read of the same regions, and one region of their bytes, timed in turn round after round
    # (the box's memory speed changes by ~30% from one second to the next), ratios paired by round.
    in_order = [w[k] for w in layers for k in matmuls] + [lm_head]
    rows_in = {"qkv": x, "o": a, "gate_up": x, "down": s}
    step_runs: dict[str, Callable[[], object]] = {
        "matmuls": lambda: ([ops.linear_tiles(rows_in[k], w[k]) for w in layers for k in matmuls],
                            ops.linear_tiles(x, lm_head)),
        "read_regions": lambda: [reader.read_flat(t) for t in in_order],
        "read_one_region": lambda: reader.read_flat(one_region),
    }  # fmt: skip
    step_ms: dict[str, list[float]] = {k: [] for k in step_runs}
    for fn in step_runs.values():
        fn()
    for _ in range(3 * reps):
        for k, fn in step_runs.items():
            t0 = time.perf_counter()
            fn()
            step_ms[k].append(time.perf_counter() - t0)
    one = step_ms["read_one_region"]
    weights_in_step_order = {
        "median_ms": {k: round(statistics.median(v) * 1e3, 3) for k, v in step_ms.items()},
        "over_one_region": {  # per round, the median kept
            k: round(statistics.median(t / o for t, o in zip(v, one, strict=True)), 3)
            for k, v in step_ms.items() if k != "read_one_region"
        },
    }  # fmt: skip
    total = sum(ms.values())
    return {
        "batch": batch, "context": context, "prompt": prompt,
        "step_ms_op_by_op": round(total, 3),
        "op_ms": ms,
        "matmul_floor_ms": matmul_floor,
        "matmul_vs_floor": {k: round(ms[k] / v, 3) for k, v in matmul_floor.items()},
        "attention_k_layout": "token_pairs" if len(k_layout) == 5 else "rows",
        "attention_ms_k_rows": attention_rows_k,  # the same attention on a row-layout K cache
        **f16,
        "attention_kv_mb": round(kv_bytes / 1e6, 1),
        "attention_kv_in_cache_ms": round(in_cache * 1e3, 3),
        "attention_floor_ms": {
            "read_same_blocks": round(scattered * 1e3, 3),
            "read_same_bytes_blocks_in_order": round(contiguous * 1e3, 3),
        },
        "attention_gb_per_s": {
            "kernel": round(kv_bytes / ms["attention"] / 1e6, 1),  # ms: bytes / 1e6 / ms = GB/s
            "read_same_blocks": round(kv_bytes / scattered / 1e9, 1),
            "read_blocks_in_order": round(kv_bytes / contiguous / 1e9, 1),
        },
        "weights_mb": round(sum(weight_bytes.values()) / 1e6, 1),
        "weights_read_ms": read_ms,  # per op, a plain read of its weights layer by layer
        "weights_one_region_read_ms": one_read_ms,  # the same bytes as one region
        "weights_in_step_order": weights_in_step_order,
        "weights_gb_per_s": {
            "matmul": {k: round(b / ms[k] / 1e6, 1) for k, b in weight_bytes.items()},
            "read": {k: round(b / read_ms[k] / 1e6, 1) for k, b in weight_bytes.items()},
            "one_region": round(sum(weight_bytes.values()) / one_read_ms / 1e6, 1),
        },
        "share_of_step": {k: round(v / total, 3) for k, v in ms.items()},
    }  # fmt: skip


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--context", type=int, default=192, help="every sequence's length at the step")
    ap.add_argument("--prompt", type=int, default=128, help="its prompt (blocks in one run)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    ceiling = ceilings.matmul_flops(2048, [(2048, 2048)], dtype, 1.0)
    log.info("matmul ceiling %.1f GFLOP/s", ceiling / 1e9)
    copy = ceilings.dram_bytes_per_s(512, 1.0)
    rows = [measure(b, args.context, args.prompt, dtype, args.reps, ceiling) for b in args.batch]
    emit({
        "bench": "decode_floor", "git_sha": git_sha(), "device": device_name(), "cpu_flags": cpu_flags(),
        "torch_threads": torch.get_num_threads(), "dtype": args.dtype,
        "ceilings": {"matmul_gflops_square_2048": round(ceiling / 1e9, 1), "dram_copy_gb_per_s": round(copy / 1e9, 1)},
        "steps": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
