"""SiLU-and-mul, the gated MLP activation: x [num_tokens, 2 * d] -> silu(x[:, :d]) * x[:, d:]."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
