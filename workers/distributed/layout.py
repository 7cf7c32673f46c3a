"""Which part of the model each rank holds: pure arithmetic, no torch, no process groups.

Ranks are numbered stage-major: world rank = pp_rank * tp_size + tp_rank, so the ranks of one
pipeline stage are consecutive and stage s's tp rank i sends its activations to stage s+1's tp
rank i. Splits are balanced rather than exact: 9 attention heads in 3 KV groups go 6 + 3 over
two ranks (whole KV groups per rank), so SmolLM2's 9 heads run on 2 ranks; a row-parallel
layer's all-reduce sums the partial products whatever their widths.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagebus.workers.distributed.state import Parallel
    from pagebus.workers.model_config import ModelConfig


class UnsplittableModelError(ValueError):
    """The model cannot be divided over the ranks asked for; the message names the numbers."""


def balanced_split(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when n items go to `parts` parts, the first n % parts one larger."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, base + (index < extra)


@dataclass(frozen=True)
class HeadSplit:
    """A rank's attention heads: query heads [q_start, q_start + num_q) and KV heads
    [kv_start, kv_start + num_kv) of the checkpoint's."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def split_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadSplit:
    """Whole GQA groups per rank. With fewer KV heads than ranks, each KV head is replicated on
    tp_size / num_kv_heads ranks, which share its query group evenly."""
    if num_heads % num_kv_heads:
        raise UnsplittableModelError(
            f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
        )
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv_start, num_kv = balanced_split(num_kv_heads, tp_size, tp_rank)
        return HeadSplit(kv_start * group, num_kv * group, kv_start, num_kv)
    replicas = tp_size // num_kv_heads
    if tp_size % num_kv_heads or group % replicas:
        raise UnsplittableModelError(
            f"tensor_parallel_size {tp_size} cannot split {num_heads} attention heads over "
            f"{num_kv_heads} KV heads: with fewer KV heads than ranks, tensor_parallel_size must be a "
            f"multiple of num_key_value_heads ({num_kv_heads}) and each KV head's {group} query heads "
            f"must divide among its {replicas} replicas"
        )
    kv = tp_rank // replicas
    per = group // replicas
    return HeadSplit(kv * group + (tp_rank % replicas) * per, per, kv, 1)


@dataclass(frozen=True)
class Layout:
    """One rank's place in a tp_size x pp_size grid."""

    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def result_rank(self) -> int:
        """The rank that returns the step's result: tp rank 0 of the last stage (which samples)."""
        return (self.pp_size - 1) * self.tp_size

    def layers(self, num_layers: int) -> range:
        """This stage's contiguous decoder layers."""
        if num_layers < self.pp_size:
            raise UnsplittableModelError(
                f"pipeline_parallel_size {self.pp_size} exceeds the model's {num_layers} layers"
            )
        start, size = balanced_split(num_layers, self.pp_size, self.pp_rank)
        return range(start, start + size)

    def tp_group_ranks(self) -> list[int]:
        base = self.pp_rank * self.tp_size
        return list(range(base, base + self.tp_size))

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world_size} (tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size})"


def local_kv_config(mc: ModelConfig, parallel: Parallel) -> ModelConfig:
    """The model config as this rank's KV cache sees it: its KV heads and its stage's layers."""
    lay = parallel.layout
    heads = split_heads(mc.num_heads, mc.num_kv_heads, lay.tp_size, lay.tp_rank)
    return dataclasses.replace(mc, num_kv_heads=heads.num_kv, num_layers=len(lay.layers(mc.num_layers)))
