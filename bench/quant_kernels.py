"""Which CPU kernel multiplies quantized weights fastest at this model's shapes, per format.

    python -m bench.quant_kernels [--rows 1 32 256] [--rounds 3] [--compile] [--kernels FILE]

Candidates, all computing `x @ W^T` for fp32 x from 32-wide groups of quantized weights:
- fp32: F.linear on the dequantized weight in linear.py's layout (the unquantized path);
- q4_pagebus, q8_0_pagebus: the engine's C++ kernels (workers/layers/quant/cpu_kernels.py, or
  another revision of that file with --kernels, e.g. `git show REV:workers/layers/quant/cpu_kernels.py`
  saved with its extension name changed), with the weight bytes they read per second
  (`GBps`: packed quants plus float32 scales) beside `dram_read_GBps`, a 512 MiB tensor's sum;
- int4pack: torch's `_weight_int4pack_mm_for_cpu` (Q4_0/Q4_1: w = (q - 8) * scale + zero, exact);
- int8pack: torch's `_weight_int8pack_mm` (per-channel scales: int8, or Q8_0 re-scaled per row);
- int8pack_blocks: Q8_0 exactly, one int8pack call per 32-column group, summed;
- dequant: unpack to fp32 at each call, then F.linear (Q4 and Q8_0);
- compiled: torch.compile of the dequant-then-matmul (with --compile; slow to build).
Each figure is the fastest single call of many, candidates interleaved, so load spikes hit all.
Prints one JSON object: microseconds per call per (shape, rows, kernel).
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from bench.common import best_of as _best
from bench.common import cpu_flags, emit, setup_logging
from bench.linear_layout import SHAPES

G = 32


def _kernels(path: str | None) -> ModuleType:
    if path is None:
        from pagebus.workers.layers.quant import cpu_kernels

        return cpu_kernels
    spec = importlib.util.spec_from_file_location("bench_quant_kernels_under_test", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _dram_read_gbps() -> float:
    big = torch.ones(128 << 20)  # 512 MiB, far above the last-level cache
    return round(big.numel() * 4 / _best(lambda: big.sum(), 5) / 1e9, 1)


def _candidates(
    n: int, k: int, x: torch.Tensor, compile_: bool, ck: ModuleType
) -> dict[str, Callable[[], torch.Tensor]]:
    q4 = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale, zero = torch.rand(n, k // G) * 0.01, torch.randn(n, k // G) * 0.01
    w4 = ((q4 - 8).float().view(n, k // G, G) * scale[..., None] + zero[..., None]).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
    sz = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()  # [k/G, n, 2]
    nib = (q4[:, 0::2] | (q4[:, 1::2] << 4)).to(torch.uint8)  # two per byte, GGUF-like
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s8 = torch.rand(n, k // G) * 0.01
    row_s = torch.rand(n) * 0.01
    q8_groups = [q8[:, g * G : (g + 1) * G].contiguous() for g in range(k // G)]
    x_groups = [x[:, g * G : (g + 1) * G].contiguous() for g in range(k // G)]
    s8_groups = [s8[:, g].contiguous() for g in range(k // G)]
    w_t = w4.t().contiguous().t()

    def dequant4() -> torch.Tensor:
        q = torch.stack([nib & 15, nib >> 4], dim=-1).view(n, k // G, G).float()
        return F.linear(x, ((q - 8) * scale[..., None] + zero[..., None]).view(n, k))

    def dequant8() -> torch.Tensor:
        return F.linear(x, (q8.view(n, k // G, G).float() * s8[..., None]).view(n, k))

    def blocks8() -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x_groups[0], q8_groups[0], s8_groups[0])
        for g in range(1, k // G):
            y += torch.ops.aten._weight_int8pack_mm(x_groups[g], q8_groups[g], s8_groups[g])
        return y

    ours_q4 = (nib.view(n, k // G, 16), scale.contiguous(), (-8 * scale + zero).contiguous())
    c: dict[str, Callable[[], torch.Tensor]] = {
        "fp32": lambda: F.linear(x, w_t),
        "q4_pagebus": lambda: ck.q4_mm(x, *ours_q4),
        "q8_0_pagebus": lambda: ck.q8_mm(x, q8, s8),
        "q4_int4pack": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, sz),
        "q4_dequant": dequant4,
        "int8pack_per_channel": lambda: torch.ops.aten._weight_int8pack_mm(x, q8, row_s),
        "q8_0_int8pack_blocks": blocks8,
        "q8_0_dequant": dequant8,
    }
    if compile_:
        c["q4_compiled"] = torch.compile(dequant4, dynamic=False)
        c["q8_0_compiled"] = torch.compile(dequant8, dynamic=False)
    return c


# Bytes the engine's kernels read per weight: quants, plus float32 scales per 32 (q4: d and m).
_BYTES_PER_WEIGHT = {"q4_pagebus": 0.5 + 8 / G, "q8_0_pagebus": 1 + 4 / G}


def measure(
    rows: list[int], rounds: int, compile_: bool, ck: ModuleType
) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, (n, k) in SHAPES.items():
        out[name] = {}
        for m in rows:
            x = torch.randn(m, k)
            cands = _candidates(n, k, x, compile_, ck)
            reps = max(3, min(50, int(3e8 / (2 * m * n * k))))
            best = dict.fromkeys(cands, float("inf"))
            for fn in cands.values():
                fn()  # warm-up (and compile)
            for _ in range(rounds):
                for kname, fn in cands.items():
                    best[kname] = min(best[kname], _best(fn, reps))
            out[name][str(m)] = {kname: round(t * 1e6, 1) for kname, t in best.items()}
            for kname, per_weight in _BYTES_PER_WEIGHT.items():
                out[name][str(m)][f"{kname}_GBps"] = round(n * k * per_weight / best[kname] / 1e9, 1)
    return out


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd dequant-matmul")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--kernels", default=None, help="a cpu_kernels.py revision to time (default: the engine's)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ck = _kernels(args.kernels)
    with torch.inference_mode():
        results = measure(args.rows, args.rounds, args.compile, ck)
        dram = _dram_read_gbps()
    emit({
        "bench": "quant_kernels", "unit": "us_per_call", "kernels": args.kernels or "engine",
        "cpu_flags": cpu_flags(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "dram_read_GBps": dram, "results": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()
