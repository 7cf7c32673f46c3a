"""RMSNorm, optionally fused with the residual add that precedes it.

    x, residual: [num_tokens, hidden]; weight: [hidden]
Without residual: returns norm(x). With residual: r = x + residual, returns (norm(r), r).
"""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)
