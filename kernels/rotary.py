"""Rotary position embedding, NeoX/HF layout (rotate_half over the two halves of each head).

    positions: [num_tokens] int64
    q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: [max_position, rotary_dim] float32, cos in the first half, sin in the second
Scaling schemes (e.g. llama3) only change the cache, which the worker builds.
"""

from __future__ import annotations

from typing import Any

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


def rotary_embedding_cpu(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    memo: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend's rotary: the ref's arithmetic (the same bits in float32), with q and k
    rotated as one [tokens, heads + kv_heads, head_dim] tensor when they are adjacent views of
    the fused QKV output (the model's case): a handful of ops in all, no cat, no upcast copies.
    Returns new tensors (views of one buffer), like the ref; other dtypes run the ref.
    memo: the step's scratch; the positions' cos/sin rows are looked up once per step."""
    if q.dtype != torch.float32 or k.dtype != torch.float32:
        return rotary_embedding_ref(positions, q, k, cos_sin_cache)
    cached = None if memo is None else memo.get("rotary_cos_sin")
    if cached is None:
        cs = cos_sin_cache.index_select(0, positions).unsqueeze(1)  # [T, 1, rot]
        half = cs.shape[-1] // 2
        cached = (cs[..., :half], cs[..., half:])
        if memo is not None:
            memo["rotary_cos_sin"] = cached
    cos, sin = cached
    num_heads = q.shape[1]
    qk = _adjacent(q, k)
    if qk is None:
        return _rotate_cpu(q, cos, sin), _rotate_cpu(k, cos, sin)
    out = _rotate_cpu(qk, cos, sin)
    return out[:, :num_heads], out[:, num_heads:]


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[T, h + kvh, d] over q's storage when k's heads directly follow q's in every row."""
    t, h, d = q.shape
    stride = q.stride()
    if stride[1:] != (d, 1) or k.stride()[1:] != (d, 1) or k.shape[0] != t or k.shape[2] != d:
        return None
    if t > 1 and k.stride(0) != stride[0]:  # a single row's stride is arbitrary
        return None
    if k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr():
        return None
    if k.storage_offset() != q.storage_offset() + h * d:
        return None
    return q.as_strided((t, h + k.shape[1], d), stride)


def _rotate_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    rot = 2 * half
    x1, x2 = x[..., :half], x[..., half:rot]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:rot]
    # o1 = x1 cos - x2 sin, o2 = x2 cos + x1 sin, each product rounded before the sum as in the ref.
    torch.mul(x1, cos, out=o1)
    torch.mul(x2, cos, out=o2)
    o1.sub_(x2 * sin)
    o2.add_(x1 * sin)
    if rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]
    return out


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
