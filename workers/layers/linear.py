"""Linear layers whose parameters know how to load checkpoint tensors, including fused ones.

A fused layer (QKV, gate+up) holds several checkpoint matrices stacked along the output
dimension; `weight_loader(param, tensor, shard)` copies a checkpoint tensor into its rows.
Tensor-parallel layers (parallel.py) say which slice of a checkpoint tensor they keep
(`checkpoint_rows`, `checkpoint_cols`), and loading cuts it here, so models never branch on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from pagebus.workers.layers.direct_call import DirectCall
from pagebus.workers.layers.quant.base import LinearMethod, current_linear_method_factory
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


class UnquantizedLinearMethod(LinearMethod):
    """The checkpoint's values in the default dtype, in `_weight_storage`'s layout; F.linear.
    After loading, float32 weights on AVX-512 and AVX2 CPUs, and bfloat16 ones on AVX-512 BF16 CPUs, are
    re-laid as column tiles (kernels/cpu_native.py `pack_linear`), multiplied by the tile kernel
    (or, float32 above 160 rows, MKL's batched GEMM): float32 1.3-1.7x F.linear at 5-160 rows,
    bfloat16 3-20x at 1-32, no slower elsewhere (on AMX CPUs bfloat16 tiles run on AMX from 2 rows). The Parameter keeps its identity (a
    tied embedding shares it) and its element count; only its shape says which layout it holds."""

    held_in_tensors = True

    def create_weights(self, layer: Linear, in_features: int, out_features: int) -> None:
        layer.weight = nn.Parameter(_weight_storage(out_features, in_features), requires_grad=False)
        layer.weight.weight_loader = layer.load_weight  # type: ignore[attr-defined]

    def load(self, layer: Linear, w: Any, shard: str | int | None) -> None:
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"unquantized linear: cannot load a {type(w).__name__}; pass --quantization")
        layer.copy_rows(layer.weight.data, w, shard)

    def process_after_loading(self, layer: Linear) -> None:
        from pagebus.kernels.cpu_native import pack_linear

        tiles = pack_linear(layer.weight.data)
        if tiles is not None:
            layer.weight.data = tiles

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.weight.dim() > 2:
            from pagebus.kernels.cpu_native import linear_tiles

            return linear_tiles(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def direct_apply(self, layer: Linear) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if layer.weight.dim() < 3:
            return None
        from pagebus.kernels.cpu_native import direct_linear_tiles

        return direct_linear_tiles(layer.weight, layer.bias)

    def native_matmul(self, layer: Linear) -> tuple[int, list[torch.Tensor]] | None:
        if layer.weight.dim() < 3 or layer.bias is not None:
            return None
        from pagebus.kernels.cpu_native import tiles_matmul_address

        return tiles_matmul_address(), [layer.weight]

    def argmax(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        if self.argmax_tiles_weight(layer, x.dtype) is None:
            return None
        from pagebus.kernels.cpu_native import argmax_tiles

        return argmax_tiles(x, layer.weight)

    def argmax_tiles_weight(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor | None:
        if layer.weight.dim() < 3 or layer.bias is not None:
            return None
        from pagebus.kernels.cpu_native import argmax_tiles_take

        return layer.weight if argmax_tiles_take(dtype, layer.weight) else None

    def embed(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        if layer.weight.dim() > 2:
            from pagebus.kernels.cpu_native import embed_tiles

            return embed_tiles(layer.weight, ids)
        return F.embedding(ids, layer.weight)


class Linear(DirectCall):
    """y = x W^T (+ b). Output rows are split into named shards when fused.

    How W is held and multiplied is `quant_method`'s business (see quant/base.py): the
    argument, else the loader's choice for this checkpoint, else the unquantized method.
    """

    weight: nn.Parameter  # set by the quant method (packed formats hold their quants in it)

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str | int, int],
        bias: bool = False,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for key, size in shard_sizes.items():
            self.shard_offsets[key] = (offset, size)
            offset += size
        self.in_features, self.out_features = in_features, offset
        if quant_method is None:
            factory = current_linear_method_factory()
            quant_method = factory(self) if factory is not None else UnquantizedLinearMethod()
        self.quant_method = quant_method
        quant_method.create_weights(self, in_features, offset)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(offset), requires_grad=False)
            self.bias.weight_loader = self._load_bias  # type: ignore[attr-defined]

    # Tensor parallelism (layers/parallel.py): the first checkpoint row each shard keeps, and the
    # first input column; unset, the layer keeps the whole checkpoint tensor.
    checkpoint_rows: dict[str | int, int] = {}  # noqa: RUF012 (read-only default)
    checkpoint_cols: int | None = None

    def select_checkpoint_part(self, w: Any, shard: str | int | None) -> Any:
        """This rank's part of a checkpoint tensor (a shard's, or the whole matrix's when shard is
        None): rows [checkpoint_rows[shard], + the shard's size), columns [checkpoint_cols, +
        in_features). Anything with torch's `narrow` slices, so a quantized format can too."""
        if self.checkpoint_rows:
            key = shard if shard is not None else next(iter(self.shard_offsets))
            size = self.shard_offsets[key][1] if shard is not None else self.out_features
            w = w.narrow(0, self.checkpoint_rows[key], size)
        if self.checkpoint_cols is not None and w.dim() == 2:
            w = w.narrow(1, self.checkpoint_cols, self.in_features)
        return w

    def load_weight(self, param: nn.Parameter, w: Any, shard: str | int | None) -> None:
        """The `weight_loader` of the layer's weight: the quant method places this rank's part."""
        self.quant_method.load(self, self.select_checkpoint_part(w, shard), shard)

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, shard: str | int | None) -> None:
        """Copy a checkpoint tensor into dst's rows for `shard` (all rows when None)."""
        if shard is None:
            _copy_checked(dst, src, "linear")
            return
        start, size = self.shard_offsets[shard]
        _copy_checked(dst.narrow(0, start, size), src, f"linear shard {shard}")

    def _load_bias(self, param: nn.Parameter, w: torch.Tensor, shard: str | int | None) -> None:
        self.copy_rows(param.data, self.select_checkpoint_part(w, shard), shard)

    def process_after_loading(self) -> None:
        self.quant_method.process_after_loading(self)
        self.bind_held_weights()

    def bind_held_weights(self) -> None:
        """The calls made once from the weights as held: after loading, or once a weight cache
        has put the held tensors back."""
        self._direct = self.quant_method.direct_apply(self)
        self._direct_dtype = torch.get_default_dtype()
        self.native_mm = self.quant_method.native_matmul(self)

    _direct: Callable[[torch.Tensor], torch.Tensor] | None = None
    native_mm: tuple[int, list[torch.Tensor]] | None = None  # LinearMethod.native_matmul, once loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        direct = self._direct
        if direct is not None and x.dim() == 2 and x.dtype is self._direct_dtype:
            return direct(x)
        return self.quant_method.apply(self, x)


class Embedding(DirectCall):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden), requires_grad=False)
        self._head: Linear | None = None

    def tie_to(self, head: Linear) -> None:
        """Share the LM head's matrix: one Parameter (so the checkpoint's single tensor loads
        once, through the head's method), looked up through the head's method, since a
        quantized head holds packed rows, not values. Quant methods keep `weight`'s identity."""
        self.weight = head.weight
        self.__dict__["_head"] = head  # a plain reference: not a submodule, no duplicate names

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._head is not None:
            return self._head.quant_method.embed(self._head, ids)
        return F.embedding(ids, self.weight)

    def stack_lookup(self) -> tuple[torch.Tensor, bool] | None:
        """(the tensor, whether it holds column tiles) in which csrc's DecodeStack looks ids up
        as `forward` does: embed_rows of an unquantized tied head's tiles, or rows of the
        [vocab, hidden] table; None where `forward` takes another path (a quantized tied head)."""
        if self._head is None:
            return self.weight, False
        if type(self._head.quant_method) is not UnquantizedLinearMethod:
            return None
        return self.weight, self.weight.dim() > 2
