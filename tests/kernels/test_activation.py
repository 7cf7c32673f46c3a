"""silu_and_mul (Triton) against silu_and_mul_ref."""

from __future__ import annotations

import pytest
import torch
from pagebus.kernels.activation import silu_and_mul, silu_and_mul_ref

from tests.kernels.paged_batch import DEVICE

# silu(gate) is rounded to the input dtype before the product, as in the ref; exp() differs by an
# fp32 ulp between torch and Triton, which flips that rounding now and then: allow one ulp.
TOL = {
    torch.float32: {},
    torch.float16: {"atol": 1e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 8e-3, "rtol": 1.6e-2},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2), (9, 3072), (4, 2 * 1531), (2, 3, 2 * 200)])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Irregular widths (odd d, d > one 1024-wide block) and extra leading dims."""
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype).to(DEVICE)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOL[dtype])


def test_strided_rows_and_empty() -> None:
    x = torch.randn(6, 2, 64, device=DEVICE)[:, 1]  # [6, 64], row stride 128
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x))
    assert silu_and_mul(x[:0]).shape == (0, 32)
