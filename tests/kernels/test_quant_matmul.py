"""W4A16 / W8A16 (Triton) against dequantize-then-matmul in torch: GGUF-style 32-column blocks,
GPTQ/AWQ group sizes (one group per row too), and a GPTQ act-order matrix as the layer holds it
on CUDA. Tiny shapes: on CPU this runs under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch
from pagebus.kernels.quant_matmul import dequantize_q4, dequantize_q8, q4_matmul, q8_matmul
from pagebus.workers.layers.quant.group_quant import GroupQuantConfig, Unpacked, dense, repack

from tests.kernels.paged_batch import DEVICE

# float32: an IEEE dot, only the order of the sums differs. Half types: x and the dequantized W
# are rounded to the dtype before the product (as a 16-bit GEMM would), the sum is float32.
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 2e-2, "atol": 2e-2}}


def _ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.to(x.dtype).float().t()).to(x.dtype)


@pytest.mark.parametrize(("k", "gs"), [(64, 32), (256, 128), (96, 96)])
@pytest.mark.parametrize("rows", [1, 17])
def test_w4a16(k: int, gs: int, rows: int) -> None:
    g = torch.Generator().manual_seed(k + rows)
    n = 40  # not a multiple of the 32/64-wide tiles
    qs = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g)
    d = torch.rand(n, k // gs, generator=g) * 0.02
    m = -d * torch.randint(0, 16, (n, k // gs), generator=g)
    x = torch.randn(rows, k, generator=g)
    y = q4_matmul(x.to(DEVICE), qs.to(DEVICE), d.to(DEVICE), m.to(DEVICE))
    torch.testing.assert_close(y.cpu(), _ref(x, dequantize_q4(qs, d, m)), **TOL[torch.float32])


@pytest.mark.parametrize(("gs", "dtype"), [(128, torch.float32), (32, torch.float16), (16, torch.float32)])
def test_w8a16(gs: int, dtype: torch.dtype) -> None:
    """Per channel, GGUF Q8_0's 32, and Q6_K's 16 (smaller than the kernel's K step)."""
    g = torch.Generator().manual_seed(gs)
    n, k = 24, 128
    qs = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    d = torch.rand(n, k // gs, generator=g) * 0.01
    x = torch.randn(3, k, generator=g).to(dtype)
    y = q8_matmul(x.to(DEVICE), qs.to(DEVICE), d.to(DEVICE))
    assert y.dtype == dtype
    torch.testing.assert_close(y.cpu(), _ref(x, dequantize_q8(qs, d)), **TOL[dtype])


def test_gptq_act_order_as_held_on_cuda() -> None:
    """The layer's CUDA layout: d and m per checkpoint group (not per 32), x permuted first."""
    g = torch.Generator().manual_seed(5)
    n, k, gs = 16, 128, 64
    perm = torch.randperm(k, generator=g)
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[perm] = torch.arange(k) // gs
    u = Unpacked(
        torch.randint(0, 16, (n, k), generator=g, dtype=torch.int16),
        torch.rand(n, k // gs, generator=g) * 0.02,
        torch.randint(1, 16, (n, k // gs), generator=g).float(),
        g_idx,
    )
    cfg = GroupQuantConfig.from_hf({"quant_method": "gptq", "bits": 4, "group_size": gs, "desc_act": True})
    p = repack(cfg, u, torch.device("cuda"), "test")
    assert p.perm is not None and p.tensors[1].shape == (n, k // gs)
    x = torch.randn(2, k, generator=g)
    y = q4_matmul(x[:, p.perm].contiguous().to(DEVICE), *(t.to(DEVICE) for t in p.tensors))
    torch.testing.assert_close(dense(p), u.dequantize(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(y.cpu(), x @ u.dequantize().t(), **TOL[torch.float32])
