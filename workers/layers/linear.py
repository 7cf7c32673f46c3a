"""Linear layers whose parameters know how to load checkpoint tensors, including fused ones.

A fused layer (QKV, gate+up) holds several checkpoint matrices stacked along the output
dimension; `weight_loader(param, tensor, shard)` copies a checkpoint tensor into its rows.
Tensor parallelism will slice here too, so models never branch on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, checkpoint has {tuple(src.shape)}")
    dst.copy_(src)


def _weight_storage(out_features: int, in_features: int) -> torch.Tensor:
    """An empty [out, in] weight on the default device. On CPUs its storage is [in, out]
    row-major (the tensor is a transposed view): `x @ W^T` then multiplies by a contiguous
    [in, out] matrix, which MKL runs 3-5x faster than the [out, in] layout for 2-32 rows of x
    (fp32, this model's shapes, bench/linear_layout.py) and no slower for 1 or 64+ rows.
    On GPUs cuBLAS takes either layout; they keep the checkpoint's."""
    w = torch.empty(out_features, in_features)
    if w.device.type == "cpu":
        w = torch.empty(in_features, out_features).t()
    return w


class Linear(nn.Module):
    """y = x W^T (+ b). Output rows are split into named shards when fused."""

    def __init__(self, in_features: int, shard_sizes: dict[str | int, int], bias: bool = False) -> None:
        super().__init__()
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for key, size in shard_sizes.items():
            self.shard_offsets[key] = (offset, size)
            offset += size
        self.weight = nn.Parameter(_weight_storage(offset, in_features), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(offset), requires_grad=False)
            self.bias.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard: str | int | None) -> None:
        if shard is None:
            _copy_checked(param.data, w, "linear")
            return
        start, size = self.shard_offsets[shard]
        _copy_checked(param.data.narrow(0, start, size), w, f"linear shard {shard}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
