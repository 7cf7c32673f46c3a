"""rotary_embedding (Triton, in place) against rotary_embedding_ref."""

from __future__ import annotations

import pytest
import torch
from pagebus.kernels.rotary import rotary_embedding, rotary_embedding_ref

from tests.kernels.paged_batch import DEVICE


def _cos_sin_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = base ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)  # [max_pos, rotary_dim]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim", "rotary_dim"),
    [(1, 9, 3, 64, 64), (23, 6, 2, 128, 128), (7, 5, 1, 80, 80), (11, 4, 4, 96, 48)],
)
def test_rotary_matches_ref(
    dtype: torch.dtype, num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int
) -> None:
    """Odd head counts, non power-of-two head dims, partial rotary; q/k are views of one qkv."""
    g = torch.Generator().manual_seed(num_tokens)
    cache = _cos_sin_cache(4096, rotary_dim)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g).to(DEVICE)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, cache)
    v_before = qkv[:, num_heads + num_kv_heads :].clone()
    out_q, out_k = rotary_embedding(positions, q, k, cache)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(out_q, ref_q)
    torch.testing.assert_close(out_k, ref_k)
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], v_before)  # V untouched


def test_non_contiguous_head_dim_returns_copy() -> None:
    cache = _cos_sin_cache(64, 32)
    positions = torch.arange(3, device=DEVICE)
    q = torch.randn(3, 2, 32, 2, device=DEVICE)[..., 0]  # head_dim stride 2
    k = torch.randn(3, 1, 32, device=DEVICE)
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, cache)
    out_q, out_k = rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(out_q, ref_q)
    torch.testing.assert_close(out_k, ref_k)
