"""Scatter one step's new K and V into their cache slots.

key/value:       [num_tokens, num_kv_heads, head_dim]
k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
slot_mapping:    [num_tokens] int64, slot = block_id * block_size + offset; -1 skips the token

An fp8 (e4m3) cache stores key / k_scale and value / v_scale, saturated (kernels/fp8.py); the
scales are per-tensor floats, and ignored for any other cache dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from pagebus.kernels._cast import cast_rtne
from pagebus.kernels.fp8 import fp8_bytes_view, fp32_to_e4m3_bits, is_fp8, to_fp8


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if is_fp8(k_cache.dtype):  # torch has no indexed writes into fp8 tensors: write the bytes
        k_cache, v_cache = fp8_bytes_view(k_cache), fp8_bytes_view(v_cache)
        key, value = fp8_bytes_view(to_fp8(key, k_scale)), fp8_bytes_view(to_fp8(value, v_scale))
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def write_kv_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    memo: dict[str, Any] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """The torch backend's write: the ref's result, with the skipped tokens (slot -1) found once
    per step (memo: the step's scratch) instead of by a boolean mask in every layer."""
    found: tuple[torch.Tensor | None, torch.Tensor] | None = (
        None if memo is None else memo.get("kv_write_slots")
    )
    if found is None:
        kept = (slot_mapping >= 0).nonzero().squeeze(1)
        found = (None if kept.numel() == slot_mapping.numel() else kept, slot_mapping.index_select(0, kept))
        if memo is not None:
            memo["kv_write_slots"] = found
    keep, slots = found
    if keep is not None:
        key, value = key.index_select(0, keep), value.index_select(0, keep)
    if is_fp8(k_cache.dtype):
        k_cache, v_cache = fp8_bytes_view(k_cache), fp8_bytes_view(v_cache)
        key, value = fp8_bytes_view(to_fp8(key, k_scale)), fp8_bytes_view(to_fp8(value, v_scale))
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens]
    k_scale,  # fp8 caches: stored = value / scale
    v_scale,
    num_kv_heads,
    num_slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    FP8: tl.constexpr,  # the caches are e4m3, passed as their bytes (uint8)
):
    # One program per token: all its KV heads, [HEADS_PAD, HEAD_PAD] at a time.
    tok = tl.program_id(0).to(tl.int64)
    # int64: block * stride_kcb overflows int32 on caches with > 2**31 / stride_kcb blocks.
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    block = slot // PAGE_SIZE
    in_block = slot % PAGE_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_PAD)
    # slot -1 (padding, or a token whose KV is already cached) writes nothing; nor does a slot
    # past the cache, which would corrupt memory.
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD_DIM) & (slot >= 0) & (slot < num_slots)
    k = tl.load(key_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = block * stride_kcb + in_block * stride_kct + h[:, None] * stride_kch + d[None, :]
    v_dst = block * stride_vcb + in_block * stride_vct + h[:, None] * stride_vch + d[None, :]
    if FP8:
        tl.store(k_cache_ptr + k_dst, fp32_to_e4m3_bits(k.to(tl.float32) / k_scale), mask=mask)
        tl.store(v_cache_ptr + v_dst, fp32_to_e4m3_bits(v.to(tl.float32) / v_scale), mask=mask)
    else:
        # Via fp32: exact between equal dtypes, and rounds (not truncates) fp32 -> bf16.
        tl.store(k_cache_ptr + k_dst, cast_rtne(k.to(tl.float32), k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + v_dst, cast_rtne(v.to(tl.float32), v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton version of `write_kv_cache_ref`: same layout, writes k_cache/v_cache in place.
    key/value may be strided views (e.g. slices of a fused qkv projection)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)}, cache {tuple(k_cache.shape)}")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache need a contiguous head_dim")
    if num_tokens == 0:
        return
    fp8 = is_fp8(k_cache.dtype)
    if fp8:
        k_cache, v_cache = fp8_bytes_view(k_cache), fp8_bytes_view(v_cache)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale), num_kv_heads, k_cache.shape[0] * k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim), PAGE_SIZE=k_cache.shape[1], FP8=fp8,
    )  # fmt: skip
