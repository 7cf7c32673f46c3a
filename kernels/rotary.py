"""Rotary position embedding, NeoX/HF layout (rotate_half over the two halves of each head).

    positions: [num_tokens] int64
    q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: [max_position, rotary_dim] float32, cos in the first half, sin in the second
Scaling schemes (e.g. llama3) only change the cache, which the worker builds.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1] * 2
    xr, xpass = x[..., :rot].float(), x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return torch.cat((out, xpass), dim=-1) if xpass.numel() else out


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rot/2] each
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
