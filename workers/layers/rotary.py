"""Rotary embedding caches, including llama3-style frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        return inv
    assert scaling is not None
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: long wavelengths slow down by `factor`, short ones stay, a smooth ramp between.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3)")


def build_cos_sin_cache(
    head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """[max_position, head_dim] float32: cos in the first half, sin in the second."""
    inv = _inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()
