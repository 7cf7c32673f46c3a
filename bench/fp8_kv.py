"""What --kv-cache-dtype fp8 (and --quantization fp8) cost and give here; and that the fp8 cache's
hook costs auto caches nothing.

    python -m bench.fp8_kv [--rounds 5] [--steps 32] [--batch 1 8] [--parts hook_ab default_model]

1. `hook_ab`: Ops.attention as committed (it checks ForwardBatch.kv_scales and passes k_scale /
   v_scale only for an fp8 cache) against the body it had before fp8 caches, swapped in place,
   interleaved over --rounds. On bench.step_overhead's 30-layer, 64-wide model (its matmuls cost
   next to nothing, so the ops' dispatch is what a step's CPU time measures), auto cache, both
   CPU backends: the median thread CPU time of a decode step.
2. `default_model`: the default model (fp32 weights) with an auto (fp32) and an fp8 cache in the
   same 256 MiB budget: KV blocks, and decode tok/s (thread CPU time of decode-only steps).
3. `fp8_weights` (asked for by name): --quantization fp8 against fp32 weights, likewise.
One thread. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch
from pagebus.bus.config import EngineConfig
from pagebus.frontends.model_files import default_model_path
from pagebus.workers import ops as ops_module
from pagebus.workers.loader import resident_weight_bytes
from pagebus.workers.runner import ModelRunner

from bench.common import cpu_flags, emit, git_sha, log, setup_logging
from bench.gpu_e2e import write_llama_config
from bench.step_overhead import SHAPE, decode_step_times


def _attention_before_fp8(self: Any, q: Any, k: Any, v: Any, fb: Any, layer: int, scale: float) -> Any:
    """Ops.attention as it was before fp8 caches (the A side of the A/B)."""
    k_cache, v_cache = fb.kv_caches[layer]
    memo = fb.step_cache
    self.write_kv_cache(k, v, k_cache, v_cache, fb.slot_mapping, memo=memo)
    return self.paged_attention(
        q, k_cache, v_cache, fb.block_tables, fb.seq_lens, fb.query_start_loc, scale,
        max_query_len=fb.max_query_len, max_seq_len=fb.max_seq_len,
        seq_lens_host=fb.seq_lens_host, query_start_loc_host=fb.query_start_loc_host, memo=memo,
    )  # fmt: skip


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def hook_ab(rounds: int, steps: int, batches: list[int]) -> dict[str, Any]:
    committed = ops_module.Ops.attention
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        write_llama_config(d, SHAPE)
        for backend in ("cpu", "torch"):
            cfg = EngineConfig(
                model=d, load_format="dummy", dtype="float32", num_kv_blocks=1024, attention_backend=backend
            )
            runner = ModelRunner(cfg, d)
            for batch in batches:
                samples: dict[str, list[float]] = {"before": [], "committed": []}
                for _ in range(rounds):
                    for side, fn in (("before", _attention_before_fp8), ("committed", committed)):
                        ops_module.Ops.attention = fn  # type: ignore[method-assign]
                        try:
                            samples[side] += decode_step_times(runner, batch, steps)
                        finally:
                            ops_module.Ops.attention = committed  # type: ignore[method-assign]
                a, b = _median(samples["before"]), _median(samples["committed"])
                log.info(
                    "%s b%d: before %.3f ms, committed %.3f ms", runner.ops.name, batch, a * 1e3, b * 1e3
                )
                out[f"{runner.ops.name}_b{batch}"] = {
                    "before_ms": round(a * 1e3, 3),
                    "committed_ms": round(b * 1e3, 3),
                    "ratio": round(b / a, 3),
                    "steps_each": len(samples["before"]),
                }
    return out


def default_model(rounds: int, steps: int, batches: list[int]) -> dict[str, Any]:
    path = default_model_path()
    runners = {
        d: ModelRunner(EngineConfig(dtype="float32", kv_cache_memory=256 << 20, kv_cache_dtype=d), path)
        for d in ("auto", "fp8")
    }
    out: dict[str, Any] = {d: {"kv_blocks": r.num_blocks} for d, r in runners.items()}
    for batch in batches:
        samples: dict[str, list[float]] = {d: [] for d in runners}
        for _ in range(rounds):
            for d, r in runners.items():
                samples[d] += decode_step_times(r, batch, steps)
        for d in runners:
            ms = _median(samples[d])
            out[d][f"b{batch}"] = {"ms_per_step": round(ms * 1e3, 2), "tok_per_s": round(batch / ms, 1)}
            log.info("default model, %s cache, b%d: %.2f ms a step", d, batch, ms * 1e3)
    return out


def fp8_weights(rounds: int, steps: int, batches: list[int]) -> dict[str, Any]:
    """The default model's weights as fp32 and as --quantization fp8 (made at load; on a CPU each
    matmul dequantizes its weight): bytes held, and decode ms a step (auto cache)."""
    path = default_model_path()
    runners = {
        q: ModelRunner(EngineConfig(dtype="float32", kv_cache_memory=256 << 20, quantization=q), path)
        for q in ("none", "fp8")
    }
    out: dict[str, Any] = {
        q: {"weight_mib": round(resident_weight_bytes(r.model) / 2**20, 1)} for q, r in runners.items()
    }
    for batch in batches:
        samples: dict[str, list[float]] = {q: [] for q in runners}
        for _ in range(rounds):
            for q, r in runners.items():
                samples[q] += decode_step_times(r, batch, steps)
        for q in runners:
            ms = _median(samples[q])
            out[q][f"b{batch}"] = {"ms_per_step": round(ms * 1e3, 2), "tok_per_s": round(batch / ms, 1)}
            log.info("default model, weights %s, b%d: %.2f ms a step", q, batch, ms * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument(
        "--parts",
        nargs="+",
        choices=["hook_ab", "default_model", "fp8_weights"],
        default=["hook_ab", "default_model"],
    )
    args = ap.parse_args()
    setup_logging()
    torch.set_num_threads(1)
    parts = {"hook_ab": hook_ab, "default_model": default_model, "fp8_weights": fp8_weights}
    results = {p: parts[p](args.rounds, args.steps, args.batch) for p in args.parts}
    emit({"bench": "fp8_kv", "sha": git_sha(), "cpu_flags": cpu_flags(), "threads": 1, **results})


if __name__ == "__main__":
    main()
