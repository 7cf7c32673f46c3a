"""write_kv_cache (Triton) against write_kv_cache_ref."""

from __future__ import annotations

import pytest
import torch
from pagebus.kernels.kv_cache_write import write_kv_cache, write_kv_cache_cpu, write_kv_cache_ref

from tests.kernels.paged_batch import DEVICE


def _run_both(key, value, k_cache, v_cache, slots) -> None:
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)
    write_kv_cache(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)],
)
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(3, 40, 16), (1, 64, 8), (8, 16, 32)])
def test_scatter_matches_ref(
    src_dtype: torch.dtype, cache_dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    g = torch.Generator().manual_seed(num_kv_heads * head_dim)
    num_tokens, num_blocks = 37, 11
    # Key/value as strided views of a fused qkv buffer: [37, 2 + 2*kvh, head_dim] sliced per head.
    qkv = torch.randn(num_tokens, 2 + 2 * num_kv_heads, head_dim, generator=g).to(src_dtype).to(DEVICE)
    key, value = qkv[:, 2 : 2 + num_kv_heads], qkv[:, 2 + num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[0, 5, 36]] = -1  # padding tokens
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(cache_dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=g).to(cache_dtype).to(DEVICE)
    _run_both(key, value, k_cache, v_cache, slots.to(DEVICE))


def test_empty_and_all_skipped() -> None:
    cache = torch.zeros(2, 16, 2, 32, device=DEVICE)
    kv = torch.randn(4, 2, 32, device=DEVICE)
    _run_both(kv[:0], kv[:0], cache, cache.clone(), torch.zeros(0, dtype=torch.int64, device=DEVICE))
    _run_both(kv, kv, cache, cache.clone(), torch.full((4,), -1, dtype=torch.int64, device=DEVICE))
    assert not cache.any()


def test_slots_past_int32_offsets() -> None:
    """slot * stride > 2**31 elements: a 4 GiB fp16 K/V buffer, only a few pages touched."""
    block_size, kvh, hd = 16, 2, 16
    per_block = 2 * block_size * kvh * hd
    num_blocks = 2**31 // per_block + 8
    kv = torch.empty(num_blocks, 2, block_size, kvh, hd, dtype=torch.float16, device=DEVICE)
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    top = (num_blocks - 3) * block_size
    slots = torch.tensor([top + 5, -1, top + 31, top + 32], device=DEVICE)
    key, value = torch.randn(2, 4, kvh, hd, device=DEVICE).unbind(0)
    write_kv_cache(key, value, k_cache, v_cache, slots)
    assert (num_blocks - 3) * k_cache.stride(0) > 2**31
    for i in (0, 2, 3):
        block, offset = divmod(int(slots[i]), block_size)  # index, don't reshape: that would copy 4 GiB
        torch.testing.assert_close(k_cache[block, offset], key[i].half(), rtol=0, atol=0)
        torch.testing.assert_close(v_cache[block, offset], value[i].half(), rtol=0, atol=0)


@pytest.mark.parametrize("skipped", [[], [0, 5, 36]])
def test_cpu_write_with_a_step_memo(skipped: list[int]) -> None:
    """The torch backend's write: the ref's bits, with the slots found once for every layer."""
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(11 * 16, generator=g)[:37]
    slots[skipped] = -1
    memo: dict = {}
    for _layer in range(3):
        key, value = torch.randn(37, 3, 40, generator=g), torch.randn(37, 3, 40, generator=g)
        k_cache, v_cache = torch.randn(11, 16, 3, 40, generator=g), torch.randn(11, 16, 3, 40, generator=g)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        write_kv_cache_ref(key, value, k_ref, v_ref, slots)
        write_kv_cache_cpu(key, value, k_cache, v_cache, slots, memo=memo)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert "kv_write_slots" in memo
