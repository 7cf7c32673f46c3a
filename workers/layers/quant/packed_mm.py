"""x @ W^T from the packed q4/q8 layouts (documented in cpu_kernels.py) on the device x is on:
the C++ kernels on CPU (in float32), the Triton W4A16/W8A16 kernels on CUDA (in x's dtype), and
dequantize-then-F.linear anywhere else. GGUF, int8 and GPTQ/AWQ layers all multiply through here."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from pagebus.kernels import quant_matmul
from pagebus.workers.layers.quant import cpu_kernels


def dequantize(kind: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The weights as float32 [N, K] (references, tied-embedding lookups)."""
    if kind == "q4":
        return quant_matmul.dequantize_q4(*tensors)
    if kind == "q8":
        return quant_matmul.dequantize_q8(*tensors)
    raise ValueError(f"unknown packed layout {kind!r} (q4, q8)")


def matmul(kind: str, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ W^T, in x's dtype."""
    if kind not in ("q4", "q8"):
        raise ValueError(f"unknown packed layout {kind!r} (q4, q8)")
    if x.device.type == "cpu":
        xf = x.float()
        y = cpu_kernels.q4_mm(xf, *tensors) if kind == "q4" else cpu_kernels.q8_mm(xf, *tensors)
        return y.to(x.dtype)
    if x.device.type == "cuda":
        return quant_matmul.q4_matmul(x, *tensors) if kind == "q4" else quant_matmul.q8_matmul(x, *tensors)
    return F.linear(x, dequantize(kind, tensors).to(x.dtype))
