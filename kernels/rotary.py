"""Rotary position embedding, NeoX/HF layout (rotate_half over the two halves of each head).

    positions: [num_tokens] int64
    q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: [max_position, rotary_dim] float32, cos in the first half, sin in the second
Scaling schemes (e.g. llama3) only change the cache, which the worker builds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagebus.kernels._cast import cast_rtne


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


@triton.jit
def _rotate_heads(
    x_ptr, tok, stride_t, stride_h, num_heads, cos, sin, HEADS_PAD: tl.constexpr, HALF, HALF_PAD: tl.constexpr
):
    """Rotates the first 2 * HALF dims of every head of one token, in place."""
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    mask = (h[:, None] < num_heads) & (i[None, :] < HALF)
    lo = x_ptr + tok * stride_t + h[:, None] * stride_h + i[None, :]  # [HEADS_PAD, HALF_PAD]
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    ty = x_ptr.dtype.element_ty
    tl.store(lo, cast_rtne(x1 * cos[None, :] - x2 * sin[None, :], ty), mask=mask)
    tl.store(lo + HALF, cast_rtne(x2 * cos[None, :] + x1 * sin[None, :], ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens]
    q_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_ptr,  # [max_position, 2 * half]
    num_heads,
    num_kv_heads,
    half,
    max_position,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    # One program per token: one cache row, read and write every q and k head once.
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    # A position past the cache would read out of bounds; it rotates by cos=sin=0 instead.
    c_mask = (i < half) & (pos >= 0) & (pos < max_position)
    cos = tl.load(cos_sin_ptr + pos * stride_cache + i, mask=c_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cache + half + i, mask=c_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, tok, stride_qt, stride_qh, num_heads, cos, sin, HEADS_PAD, half, HALF_PAD)
    _rotate_heads(k_ptr, tok, stride_kt, stride_kh, num_kv_heads, cos, sin, KV_HEADS_PAD, half, HALF_PAD)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `rotary_embedding_ref`. Rotates q and k *in place* (so they may be views
    of a fused qkv buffer) and returns them; a copy is made only if head_dim is not contiguous.
    Dims past rotary_dim are left as they are."""
    num_tokens, num_heads, head_dim = q.shape
    rot = cos_sin_cache.shape[-1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape[0] != num_tokens:
        raise ValueError(f"positions {tuple(positions.shape)}, q {tuple(q.shape)}, k {tuple(k.shape)}")
    if rot % 2 or rot > head_dim:
        raise ValueError(f"rotary_dim {rot} must be even and <= head_dim {head_dim}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cache, num_heads, k.shape[1], rot // 2, cache.shape[0],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cache.stride(0),
            HEADS_PAD=triton.next_power_of_2(num_heads), KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
            HALF_PAD=triton.next_power_of_2(rot // 2),
        )  # fmt: skip
    return q, k
