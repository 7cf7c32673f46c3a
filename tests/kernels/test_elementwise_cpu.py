"""The torch backend's elementwise ops (`*_cpu`) give their refs' exact bits."""

from __future__ import annotations

import pytest
import torch
from pagebus.kernels.activation import silu_and_mul_cpu, silu_and_mul_ref
from pagebus.kernels.rms_norm import rms_norm_cpu, rms_norm_ref
from pagebus.kernels.rotary import rotary_embedding_cpu, rotary_embedding_ref
from pagebus.workers.layers.rotary import build_cos_sin_cache

DTYPES = [torch.float32, torch.bfloat16]


def _equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), float((got.float() - want.float()).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_rms_norm_cpu(dtype: torch.dtype, num_tokens: int) -> None:
    g = torch.Generator().manual_seed(num_tokens)
    x = (torch.randn(num_tokens, 576, generator=g) * 3).to(dtype)
    residual = torch.randn(num_tokens, 576, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    before = x.clone(), residual.clone()
    _equal(rms_norm_cpu(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    out, new_res = rms_norm_cpu(x, weight, 1e-5, residual)
    ref_out, ref_res = rms_norm_ref(x, weight, 1e-5, residual)
    _equal(out, ref_out)
    _equal(new_res, ref_res)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim", "rotary_dim"),
    [(1, 9, 3, 64, 64), (23, 6, 2, 128, 128), (7, 4, 4, 96, 48)],
)
def test_rotary_cpu_on_fused_qkv_views(
    dtype: torch.dtype, num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int
) -> None:
    """q and k as the model passes them: adjacent views of one QKV row (one token, too); partial rotary."""
    g = torch.Generator().manual_seed(num_tokens)
    cache = build_cos_sin_cache(rotary_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.reshape(num_tokens, num_heads, head_dim), k.reshape(num_tokens, num_kv_heads, head_dim)
    before = qkv.clone()
    got_q, got_k = rotary_embedding_cpu(positions, q, k, cache)
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, cache)
    _equal(got_q, ref_q)
    _equal(got_k, ref_k)
    assert torch.equal(qkv, before)
    memo: dict = {}  # a step's layers share the cos/sin rows: the second call reuses them
    for scale in (1.0, -2.0):
        got = rotary_embedding_cpu(positions, q * scale, k * scale, cache, memo=memo)
        for g_, w_ in zip(got, rotary_embedding_ref(positions, q * scale, k * scale, cache), strict=True):
            _equal(g_, w_)


def test_rotary_cpu_separate_tensors() -> None:
    """q and k that are not adjacent views are rotated one by one."""
    g = torch.Generator().manual_seed(3)
    cache = build_cos_sin_cache(64, 512, 10000.0)
    positions = torch.randint(0, 512, (6,), generator=g)
    q, k = torch.randn(6, 4, 64, generator=g), torch.randn(6, 2, 64, generator=g)
    for got, want in zip(
        rotary_embedding_cpu(positions, q, k, cache),
        rotary_embedding_ref(positions, q, k, cache),
        strict=True,
    ):
        _equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_cpu(dtype: torch.dtype) -> None:
    x = (torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    _equal(silu_and_mul_cpu(x), silu_and_mul_ref(x))
