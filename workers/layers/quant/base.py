"""The quant-method hook of `Linear` (vLLM's `LinearMethodBase`).

A method owns everything about how a layer's weight is held: it creates the layer's
parameters and buffers, places each checkpoint tensor (a whole matrix, or one shard of a
fused one) into them, may repack once every shard is in, and computes `x @ W^T`. The
layer keeps only the shape and the shard offsets, so a new format never touches a model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pagebus.workers.layers.linear import Linear


class LinearMethod:
    # True where everything `process_after_loading` leaves is in the layer's parameters and
    # buffers (nothing on the method itself), so the weights as held can be saved after loading
    # and put back at the next start (workers/weight_cache.py).
    held_in_tensors = False

    def create_weights(self, layer: Linear, in_features: int, out_features: int) -> None:
        """Register the layer's weight tensors (named `weight` where the loader routes by name)."""
        raise NotImplementedError

    def load(self, layer: Linear, w: Any, shard: str | int | None) -> None:
        """Place one checkpoint tensor: the whole matrix (shard None) or the rows of `shard`."""
        raise NotImplementedError

    def process_after_loading(self, layer: Linear) -> None:
        """Called once every tensor is loaded: repack into the layout `apply` reads."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T (+ bias) for x of shape [..., in_features]."""
        raise NotImplementedError

    def direct_apply(self, layer: Linear) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`apply` for 2-D x in the default dtype as one call with the weights bound, made once
        after loading; None where the general path is the only one. A decode step makes ~120
        linear calls, and `apply`'s reshapes, casts and dispatch cost 10-15 us each against a
        kernel of 20-90 us (the default model, one row, CPU)."""
        return None

    def native_matmul(self, layer: Linear) -> tuple[int, list[torch.Tensor]] | None:
        """The layer's matmul for compiled callers (the CPU decode stack, kernels/csrc/cpu_ops.cpp):
        the address of a C++ function `y = f(x, tensors)` over 2-D float32 x, and the tensors it
        takes; None where only Python can run this layer."""
        return None

    def argmax(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """(x @ W^T).argmax(-1) for 2-D x, int64 [rows], computed without storing the product
        (a greedy step's LM head); None where this method has no such path."""
        return None

    def argmax_tiles_weight(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor | None:
        """The column tiles csrc's argmax_tiles multiplies activations of `dtype` by, for a
        native caller that runs the argmax itself (the decode stack's tail); None where this
        method has none."""
        return None

    def embed(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W, for an embedding tied to this layer."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve a tied embedding")

    def resident_bytes(self, layer: Linear) -> int:
        """Bytes the layer's weight holds (parameters and buffers)."""
        return sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])


# Which method new `Linear`s get when the model does not pass one: the loader sets it for
# the checkpoint it builds a model for, so model files never name a format.
LinearMethodFactory = Callable[["Linear"], LinearMethod]
_factory: ContextVar[LinearMethodFactory | None] = ContextVar("pagebus_linear_method", default=None)


@contextmanager
def linear_methods(factory: LinearMethodFactory | None) -> Iterator[None]:
    token = _factory.set(factory)
    try:
        yield
    finally:
        _factory.reset(token)


def current_linear_method_factory() -> LinearMethodFactory | None:
    return _factory.get()
