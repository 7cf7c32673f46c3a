"""GGUF weights kept in their quantized blocks (`--quantization gguf`): Q4_0, Q4_1, Q5_0, Q8_0,
Q4_K and Q6_K (what Q4_K_M files hold); and `--quantization int8` (any float checkpoint,
quantized at load) through the same kernels.

The loader hands each quantized checkpoint matrix over as a `GGUFWeight` (its raw blocks, one
row of blocks per output row), and `GGUFLinearMethod` unpacks the blocks into the arrays the CPU
kernels read (gguf_blocks.py, cpu_kernels.py) without making a float copy of the matrix. A fused
layer's shards may come in different types (llama.cpp's mixes do that): each run of one kernel
layout is multiplied on its own and the outputs concatenated.

Float tensors in the same file (F32/F16/BF16 matrices) are kept as float32 and go through
F.linear. Every other type is refused by name at load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from pagebus.workers.layers.quant import cpu_kernels, packed_mm
from pagebus.workers.layers.quant.base import LinearMethod
from pagebus.workers.layers.quant.gguf_blocks import BLOCKS, unpack

if TYPE_CHECKING:
    from pagebus.workers.layers.linear import Linear

SUPPORTED = tuple(BLOCKS)


class UnsupportedQuantType(ValueError):
    pass


@dataclass
class GGUFWeight:
    """One quantized matrix as stored: `data` is uint8 [rows, bytes per row] of `qtype` blocks."""

    qtype: str
    data: torch.Tensor
    cols: int
    name: str = ""

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> GGUFWeight:
        """Rows, or whole blocks of columns (tensor-parallel slicing; 32 or 256 wide)."""
        if dim == 0:
            return GGUFWeight(self.qtype, self.data.narrow(0, start, length), self.cols, self.name)
        group, b = BLOCKS.get(self.qtype, (32, 0))
        if start % group or length % group or not b:
            raise ValueError(
                f"{self.name}: {self.qtype} columns split at {start}+{length}, not whole groups of {group}"
            )
        return GGUFWeight(
            self.qtype, self.data.narrow(1, start // group * b, length // group * b), length, self.name
        )

    def dequantize(self) -> torch.Tensor:
        import gguf

        qtype = gguf.GGMLQuantizationType[self.qtype]
        return torch.from_numpy(gguf.quants.dequantize(self.data.numpy(), qtype).astype(np.float32))


@dataclass
class _Part:
    """Consecutive output rows held in one format."""

    kind: str  # "q4", "q8" or "dense"
    tensors: list[torch.Tensor]  # q4: qs, d, m; q8: qs, d; dense: [rows, K] float32

    @property
    def rows(self) -> int:
        return self.tensors[0].shape[0]


def _split(w: GGUFWeight) -> _Part:
    """The block bytes as the kernels' arrays."""
    if w.qtype not in BLOCKS:
        raise UnsupportedQuantType(
            f"{w.name}: GGUF type {w.qtype} cannot stay quantized (supported: {', '.join(SUPPORTED)}); "
            "serve the file without --quantization gguf to dequantize it at load"
        )
    kind, tensors = unpack(w.qtype, w.data, w.cols)
    return _Part(kind, tensors)


def _dense(p: _Part) -> torch.Tensor:
    """The part's weights as float32 [rows, K] (reference, tied-embedding rows)."""
    if p.kind == "dense":
        return p.tensors[0]
    return packed_mm.dequantize(p.kind, p.tensors)


def _rows(p: _Part, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the part, dequantized (a tied embedding's lookup)."""
    return _dense(_Part(p.kind, [t[ids] for t in p.tensors]))


def _mm(p: _Part, x: torch.Tensor) -> torch.Tensor:
    if p.kind == "dense":
        return F.linear(x, p.tensors[0])
    return packed_mm.matmul(p.kind, x, p.tensors)


def _explicit_m(p: _Part) -> _Part:
    """A symmetric q4 part (Q4_0: no m) with its m = -8 d written out, to merge with one that has m."""
    return _Part("q4", [*p.tensors, p.tensors[1] * -8.0]) if p.kind == "q4" and len(p.tensors) == 2 else p


def _merged(a: _Part, b: _Part) -> _Part | None:
    """a's rows then b's as one part, where one kernel call can take both: the same kernel and
    group size (Q8_0's 32 and Q6_K's 16 both run as q8 but cannot merge)."""
    if a.kind != b.kind:
        return None
    if len(a.tensors) != len(b.tensors):  # Q4_0 beside Q4_1/Q4_K
        a, b = _explicit_m(a), _explicit_m(b)
    if any(x.shape[1:] != y.shape[1:] for x, y in zip(a.tensors, b.tensors, strict=True)):
        return None
    return _Part(a.kind, [torch.cat([x, y]) for x, y in zip(a.tensors, b.tensors, strict=True)])


class GGUFLinearMethod(LinearMethod):
    """One per layer (it holds that layer's shards until they are merged)."""

    def __init__(self) -> None:
        self.shards: dict[str | int | None, _Part] = {}
        self.parts: list[_Part] = []

    def create_weights(self, layer: Linear, in_features: int, out_features: int) -> None:
        # A placeholder until the blocks arrive; its identity stays (a tied embedding shares it).
        layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        layer.weight.weight_loader = layer.load_weight  # type: ignore[attr-defined]

    def load(self, layer: Linear, w: Any, shard: str | int | None) -> None:
        rows = layer.shard_offsets[shard][1] if shard is not None else layer.out_features
        if tuple(w.shape) != (rows, layer.in_features):
            raise ValueError(
                f"linear shard {shard}: expected shape {(rows, layer.in_features)}, checkpoint has {tuple(w.shape)}"
            )
        self.shards[shard] = (
            _split(w) if isinstance(w, GGUFWeight) else _Part("dense", [w.float().contiguous()])
        )

    def process_after_loading(self, layer: Linear) -> None:
        if not self.shards:
            return
        order: list[str | int | None] = [None] if None in self.shards else list(layer.shard_offsets)
        parts: list[_Part] = []
        for key in order:
            p = self.shards[key]
            merged = _merged(parts[-1], p) if parts else None
            if merged is not None:  # one matrix, one kernel call
                parts[-1] = merged
            else:
                parts.append(p)
        if layer.weight.device.type == "cpu" and not cpu_kernels.available():
            # no C++ kernels (cpu_kernels warned why): float32 F.linear beats dequantizing per call
            parts = [_Part("dense", [torch.cat([_dense(p) for p in parts])])]
        self.shards, self.parts = {}, parts
        # Held by the layer too, so memory counts see them: the first part's quants are `weight`
        # itself (the Parameter a tied embedding shares), the rest buffers.
        layer.weight.data = parts[0].tensors[0]
        for i, p in enumerate(parts):
            for j, t in enumerate(p.tensors):
                if (i, j) != (0, 0):
                    layer.register_buffer(f"gguf_{i}_{j}", t, persistent=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xf = x2.float() if x2.device.type == "cpu" else x2
        parts = self.parts
        y = _mm(parts[0], xf) if len(parts) == 1 else torch.cat([_mm(p, xf) for p in parts], dim=-1)
        y = y.to(x.dtype)
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*shape[:-1], layer.out_features)

    def _one_kernel(self, layer: Linear) -> bool:
        """One packed part, no bias, float32 activations on CPU: the C++ matmul is the whole call."""
        return (
            len(self.parts) == 1
            and self.parts[0].kind in ("q4", "q8")
            and layer.bias is None
            and layer.weight.is_cpu
            and torch.get_default_dtype() is torch.float32
        )

    def direct_apply(self, layer: Linear) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if not self._one_kernel(layer):
            return None
        return cpu_kernels.bound_mm(self.parts[0].kind, self.parts[0].tensors)

    def native_matmul(self, layer: Linear) -> tuple[int, list[torch.Tensor]] | None:
        if not self._one_kernel(layer) or not cpu_kernels.available():
            return None
        return cpu_kernels.matmul_address(self.parts[0].kind), list(self.parts[0].tensors)

    def embed(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        if len(self.parts) != 1:
            raise ValueError("a tied embedding over a head of mixed GGUF types")
        return _rows(self.parts[0], ids).to(torch.get_default_dtype())


def int8_per_channel(w: torch.Tensor) -> _Part:
    """Symmetric int8 with one scale per output row (max |w| maps to 127)."""
    w = w.float()
    d = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    return _Part("q8", [torch.round(w / d).clamp_(-127, 127).to(torch.int8).contiguous(), d.contiguous()])


class Int8LinearMethod(GGUFLinearMethod):
    """`--quantization int8`: float checkpoint matrices quantized at load, weight-only, per
    output channel, through the Q8 kernels (activations stay float32)."""

    def load(self, layer: Linear, w: Any, shard: str | int | None) -> None:
        if isinstance(w, GGUFWeight):
            w = w.dequantize()
        super().load(layer, w, shard)
        self.shards[shard] = int8_per_channel(self.shards[shard].tensors[0])


def gguf_weight(tensor: Any, name: str) -> GGUFWeight:
    """A GGUF matrix (workers/gguf_file.py's GGUFTensor: shape [rows, cols], uint8 blocks per row)."""
    rows, cols = tensor.shape
    # a copy of the packed bytes: mmap views are read-only, and mmap reads stall on some VMs
    raw = torch.from_numpy(np.array(tensor.data, copy=True).view(np.uint8).reshape(rows, -1))
    return GGUFWeight(tensor.tensor_type.name, raw, int(cols), name)
