"""Scatter one step's new K and V into their cache slots.

key/value:       [num_tokens, num_kv_heads, head_dim]
k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
slot_mapping:    [num_tokens] int64, slot = block_id * block_size + offset; -1 skips the token
"""

from __future__ import annotations

import torch


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)
