"""What the packed CPU matmuls compute, in torch: x @ W^T from the dequantized weights, except
where the kernels take x as int8 (1-2 rows on VNNI machines, cpu_kernels.int8_rows()): there x
is first rounded to the int8 grid they use, per 32 columns, and q4's `m` term keeps float x."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pagebus.workers.layers.linear import Linear
from pagebus.workers.layers.quant import cpu_kernels, packed_mm
from pagebus.workers.layers.quant.base import LinearMethod


def int8_grid(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernels round it: per 32 columns, steps of max |x| / 127."""
    g = x.reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / 127.0)).reshape_as(x)


def takes_int8(x: torch.Tensor, kind: str, tensors: Sequence[torch.Tensor]) -> bool:
    if x.shape[0] > cpu_kernels.int8_rows():
        return False
    if kind == "q8":  # Q8_0's groups of 32 or one scale per row; Q6_K's 16 stay float
        return tensors[1].shape[1] in (tensors[0].shape[1] // 32, 1)
    return kind == "q4"


def packed_matmul(x: torch.Tensor, kind: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """x [M, K] float32 @ W^T as the CPU kernels compute it (up to float32 rounding)."""
    if kind == "dense":
        return x @ tensors[0].t()
    w = packed_mm.dequantize(kind, tensors)
    if not takes_int8(x, kind, tensors):
        return x @ w.t()
    if kind == "q8":
        return int8_grid(x) @ w.t()
    m = (tensors[2] if len(tensors) > 2 else tensors[1] * -8.0).float().repeat_interleave(32, dim=1)
    return int8_grid(x) @ (w - m).t() + x @ m.t()


def loaded_two_shard_linear(method: LinearMethod, rows: int) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """A fused Linear (shards of 64 and 32 rows, 320 inputs) loaded through `method` from random
    weights, with `rows` rows of x: (layer, the float32 weights, x)."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 320, generator=g), torch.randn(rows, 320, generator=g)
    layer = Linear(320, {"a": 64, "b": 32}, quant_method=method)
    layer.load_weight(layer.weight, w[:64], "a")
    layer.load_weight(layer.weight, w[64:], "b")
    layer.process_after_loading()
    return layer, w, x
