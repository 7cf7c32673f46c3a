"""Decode attention of builds side by side: kernels/csrc/cpu_ops.cpp as it is ("base") and edited
copies of it (bench/kernel_ab.py builds them), timed op by op on the default model's heads, where
kernel_ab times whole engines. Prints one JSON object.

    cp kernels/csrc/cpu_ops.cpp /tmp/deep.cpp   # then edit the copy
    python -m bench.attention_ab --variant deep=/tmp/deep.cpp --control --shapes 64x192 8x2048

A shape BxL is B sequences decoding at L tokens of context each, their blocks laid out as a fresh
FIFO pool hands them out (bench/decode_floor.py). Each timing is 30 layers' fused QKV attention
(rotary, cache write, attention): "dram" on a cache per layer, as a step reads them, "cache" on
one layer's cache for every call (K/V from L3 at most: the arithmetic). Within a round every build
runs each timing in turn, the order rotating; each build's ratio to base is the median over rounds
of the per-round ratios. Every build's outputs are checked bitwise against base's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import cpu_flags, device_name, emit, git_sha, log, setup_logging
from bench.decode_floor import engine_tables
from bench.interleave import rotated
from bench.kernel_ab import add_build_options, build, build_sources, ratio_spread

REPS = 3  # calls per timing, the fastest kept


def parse_shape(text: str) -> tuple[int, int]:
    """BxL: B sequences, L tokens of context each (both at least 1)."""
    b, sep, ctx = text.partition("x")
    if not (sep and b.isdigit() and ctx.isdigit() and int(b) > 0 and int(ctx) > 0):
        raise argparse.ArgumentTypeError(f"a shape is BxL, e.g. 64x192: {text!r}")
    return int(b), int(ctx)


class Case:
    """One shape's inputs: q/k/v rows, per-layer caches of the engine's layout, block tables."""

    def __init__(self, batch: int, context: int, dtype: torch.dtype, layers: int, seed: int = 0) -> None:
        from pagebus.frontends.model_files import default_model_path
        from pagebus.kernels.cpu_native import k_cache_shape
        from pagebus.workers.loader import read_config

        mc = read_config(default_model_path())
        self.h, self.kvh, d = mc.num_heads, mc.num_kv_heads, mc.head_dim
        g = torch.Generator().manual_seed(seed)
        self.tables = engine_tables(batch, context, min(128, context - 1))
        blocks = int(self.tables.max()) + 1
        pairs = len(k_cache_shape(blocks, 16, self.kvh, d, dtype)) == 5  # bf16 K in token pairs

        def k_layout(k: torch.Tensor) -> torch.Tensor:
            return k.view(blocks, 16, self.kvh, d // 2, 2).permute(0, 2, 3, 1, 4).contiguous() if pairs else k

        self.caches = [
            (
                k_layout(torch.randn(blocks, 16, self.kvh, d, generator=g).to(dtype)),
                torch.randn(blocks, 16, self.kvh, d, generator=g).to(dtype),
            )
            for _ in range(layers)
        ]
        self.lens = torch.full((batch,), context, dtype=torch.int32)
        self.starts = torch.arange(batch + 1, dtype=torch.int32)
        self.positions = torch.full((batch,), context - 1, dtype=torch.int64)
        last = context - 1
        self.slots = (self.tables[:, last // 16].long() * 16 + last % 16).contiguous()
        inv = 1.0 / (mc.rope_theta ** (torch.arange(0, d, 2).float() / d))
        angles = torch.arange(context + 1).float()[:, None] * inv[None]
        self.cos_sin = torch.cat([angles.cos(), angles.sin()], -1).contiguous()
        self.qkv = torch.randn(batch, (self.h + 2 * self.kvh) * d, generator=g).to(dtype)
        self.scale = d**-0.5

    def call(self, ops: Any, layer: int) -> torch.Tensor:
        k, v = self.caches[layer]
        return ops.qkv_decode_attention(
            self.qkv, self.h, self.kvh, self.positions, self.cos_sin, k, v, self.slots, self.tables,
            self.lens, self.starts, self.scale,
        )  # fmt: skip

    def timing(self, ops: Any, in_cache: bool) -> Callable[[], None]:
        def run() -> None:
            for i in range(len(self.caches)):
                self.call(ops, 0 if in_cache else i)

        return run


def best_ms(fn: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(REPS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def measure(builds: dict[str, Any], case: Case, rounds: int) -> dict[str, Any]:
    names = list(builds)
    outs = {n: case.call(ops, 0) for n, ops in builds.items()}
    ms: dict[str, dict[str, list[float]]] = {n: {"dram": [], "cache": []} for n in names}
    for n in names:  # first calls: page faults, thread pools
        case.timing(builds[n], False)()
    for r in range(rounds):
        for kind in ("dram", "cache"):
            for n in rotated(names, r):
                ms[n][kind].append(best_ms(case.timing(builds[n], kind == "cache")))
    out: dict[str, Any] = {}
    for n in names:
        out[n] = {"bitwise_equal_to_base": bool(torch.equal(outs[n], outs["base"]))}
        for kind, runs in ms[n].items():
            out[n][kind] = {
                "median_ms": round(statistics.median(runs), 3),
                "over_base": ratio_spread(runs, ms["base"][kind]),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_build_options(ap)
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=[(64, 192), (32, 192), (8, 2048)])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.layers < 1:
        ap.error("--rounds and --layers must be at least 1")
    sources = build_sources(args)
    builds = {name: build(name, path) for name, path in sources}
    dtype = getattr(torch, args.dtype)
    shapes = {}
    for batch, context in args.shapes:
        log.info("%d x %d: %d rounds", batch, context, args.rounds)
        shapes[f"{batch}x{context}"] = measure(builds, Case(batch, context, dtype, args.layers), args.rounds)
    emit({
        "bench": "attention_ab", "git_sha": git_sha(), "device": device_name(), "cpu_flags": cpu_flags(),
        "torch_threads": torch.get_num_threads(), "dtype": args.dtype, "layers": args.layers,
        "rounds": args.rounds, "builds": {name: str(path) for name, path in sources}, "shapes": shapes,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
