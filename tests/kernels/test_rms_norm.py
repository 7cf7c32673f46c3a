"""rms_norm (Triton) against rms_norm_ref, with and without the fused residual add."""

from __future__ import annotations

import pytest
import torch
from pagebus.kernels.rms_norm import rms_norm, rms_norm_ref

from tests.kernels.paged_batch import DEVICE

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 1000), (3, 5, 96)])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, _, weight = _inputs(shape, dtype, seed=shape[-1])
    x_before = x.clone()
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (13, 1000)])
def test_rms_norm_fused_residual(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, residual, weight = _inputs(shape, dtype, seed=shape[0])
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    torch.testing.assert_close(new_residual, ref_residual, rtol=0, atol=0)  # one rounding, both sides
    torch.testing.assert_close(out, ref_out)


def test_mixed_dtypes_promote_like_ref() -> None:
    """bf16 activations with an fp32 weight and an fp32 residual stream, rows strided."""
    x, _, _ = _inputs((5, 2, 200), torch.bfloat16, seed=1)
    x = x[:, 0]  # [5, 200], row stride 400
    residual = torch.randn(5, 200, device=DEVICE)
    weight = torch.rand(200, device=DEVICE) + 0.5
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
    assert out.dtype == ref_out.dtype == torch.float32 and new_residual.dtype == ref_residual.dtype
    torch.testing.assert_close(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out)
