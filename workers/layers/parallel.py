"""Tensor-parallel layers (Megatron's split): each keeps its rank's slice of the checkpoint tensor.

- QKV and gate/up are column-parallel: a rank holds whole GQA groups of heads (KV heads
  replicated when there are fewer than ranks) and a balanced share of the MLP's columns.
- o_proj and down_proj are row-parallel: a rank multiplies its slice of the input features and
  one all-reduce sums the partial outputs.
- The embedding and the LM head split the vocabulary (padded to a multiple of the ranks): a
  lookup outside a rank's rows is zero and an all-reduce fills it in; the head's logits are
  all-gathered, so every rank holds the full logits and samples them itself. Sampling is
  deterministic given the logits and the per-request seed, so every rank draws the same tokens
  and keeps its own copy of each sequence in step, with no broadcast of the sampled ids; only
  the result rank sends them to the scheduler.

Each layer reads the parallel context that is current while the model is built
(distributed/state.py), so a model builds the same way on every rank. With one rank every
split is the whole tensor and every collective is skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from pagebus.workers.distributed.layout import balanced_split, split_heads
from pagebus.workers.distributed.state import current
from pagebus.workers.layers.linear import Embedding, Linear
from torch import nn


class QKVParallelLinear(Linear):
    """Fused q, k, v rows of this rank's heads (`heads` says which)."""

    def __init__(
        self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False
    ) -> None:
        p = current()
        self.heads = split_heads(num_heads, num_kv_heads, p.tp_size, p.tp_rank)
        q, kv = self.heads.num_q * head_dim, self.heads.num_kv * head_dim
        super().__init__(hidden, {"q": q, "k": kv, "v": kv}, bias=bias)
        if p.tp_size > 1:
            kv_row = self.heads.kv_start * head_dim
            self.checkpoint_rows = {"q": self.heads.q_start * head_dim, "k": kv_row, "v": kv_row}


class MergedColumnParallelLinear(Linear):
    """Several equally wide matrices stacked (gate/up), each split into balanced column blocks."""

    def __init__(self, in_features: int, out_features: int, num_shards: int) -> None:
        p = current()
        start, size = balanced_split(out_features, p.tp_size, p.tp_rank)
        super().__init__(in_features, dict.fromkeys(range(num_shards), size))
        if p.tp_size > 1:
            self.checkpoint_rows = dict.fromkeys(range(num_shards), start)


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T: this rank's slice of the input features, one all-reduce."""

    def __init__(self, in_features: int, out_features: int, in_split: tuple[int, int] | None = None) -> None:
        p = current()
        start, size = in_split if in_split is not None else balanced_split(in_features, p.tp_size, p.tp_rank)
        super().__init__(size, {0: out_features})  # no bias: it would be summed tp_size times
        self.parallel = p
        if p.tp_size > 1:
            self.checkpoint_cols = start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(super().forward(x))


def _vocab_rows(vocab_size: int) -> tuple[int, int, int]:
    """(first row, rows held, real rows): every rank holds ceil(vocab / tp) rows (equal shapes for
    the all-gather); the last ranks' tails past the vocabulary are zero padding."""
    p = current()
    per = -(-vocab_size // p.tp_size)
    start = p.tp_rank * per
    return start, per, max(0, min(per, vocab_size - start))


def _pad_rows(w: torch.Tensor, start: int, real: int, rows: int) -> torch.Tensor:
    part = w.narrow(0, start, real)
    if real == rows:
        return part
    out = torch.zeros((rows, *w.shape[1:]), dtype=w.dtype)
    out[:real] = part
    return out


class ParallelLMHead(Linear):
    """Vocabulary-parallel head: local logits, all-gathered into [rows, vocab]."""

    def __init__(self, hidden: int, vocab_size: int) -> None:
        self.vocab_start, rows, self.vocab_real = _vocab_rows(vocab_size)
        super().__init__(hidden, {0: rows})
        self.parallel, self.vocab_size = current(), vocab_size

    def select_checkpoint_part(self, w: Any, shard: str | int | None) -> Any:
        if self.parallel.tp_size == 1:
            return w
        return _pad_rows(w, self.vocab_start, self.vocab_real, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.parallel.all_gather_last(super().forward(x))
        return logits[..., : self.vocab_size] if logits.shape[-1] != self.vocab_size else logits

    def greedy_ids(self, x: torch.Tensor) -> torch.Tensor | None:
        """`forward(x).float().argmax(-1)` (int64 [rows]) where the weight's method computes it
        without the logits (one rank: the whole vocabulary here); else None."""
        if self.parallel.tp_size != 1 or x.dim() != 2:
            return None
        return self.quant_method.argmax(self, x)

    def argmax_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The tiles csrc's argmax_tiles takes for `greedy_ids` of activations of `dtype`, for
        the decode stack to run the argmax itself; None where greedy_ids has no such path."""
        if self.parallel.tp_size != 1:
            return None
        return self.quant_method.argmax_tiles_weight(self, dtype)


class VocabParallelEmbedding(Embedding):
    """This rank's rows of the table; other ids look up zeros and the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        self.vocab_start, rows, self.vocab_real = _vocab_rows(vocab_size)
        super().__init__(rows, hidden)
        self.parallel = current()
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard: object) -> None:
        if self.parallel.tp_size > 1:
            w = _pad_rows(w, self.vocab_start, self.vocab_real, param.shape[0])
        if param.shape != w.shape:
            raise ValueError(
                f"embedding: expected shape {tuple(param.shape)}, checkpoint has {tuple(w.shape)}"
            )
        param.data.copy_(w)

    def tie_to(self, head: Linear) -> None:
        super().tie_to(head)  # same split as the head's: the rows line up

    def stack_lookup(self) -> tuple[torch.Tensor, bool] | None:
        return super().stack_lookup() if self.parallel.tp_size == 1 else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_real)
        x = super().forward(local.masked_fill(outside, 0))
        return self.parallel.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))
