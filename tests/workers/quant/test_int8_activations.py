"""Single-stream rows of x as int8 (AVX-512 VNNI machines): the q4/q8 CPU kernels equal their
torch emulation to float32 rounding, and differ from the float matmul by no more than rounding x
to its int8 grid can explain: half a grid step per group of 32 columns, times that group's
|w| sum. On machines without VNNI (int8_rows() == 0) every row stays float."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pagebus.workers.layers.quant import cpu_kernels, packed_mm
from pagebus.workers.layers.quant.gguf import _split

from tests.workers.quant.packed_reference import packed_matmul, takes_int8
from tests.workers.quant.test_gguf_linear import _quantized

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels did not build")


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    """Activations with the outliers real hidden states have: a few columns 20x the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, torch.randint(0, k, (k // 64,), generator=g)] *= 20
    return x


# K = 576 and 544 leave a last chunk of 2 and 1 groups of 32; K-quants need whole 256s.
_CASES = [
    (q, rows, k) for q in ("Q4_0", "Q4_1", "Q8_0") for rows, k in ((1, 576), (2, 544), (1, 96), (3, 576))
]
_CASES += [(q, rows, 768) for q in ("Q4_K", "Q6_K") for rows in (1, 2)]


@pytest.mark.parametrize(("qtype", "rows", "k"), _CASES)
def test_kernel_equals_emulation_and_error_is_bounded(qtype: str, rows: int, k: int) -> None:
    w, _ = _quantized(200, k, qtype, seed=7)
    p = _split(w)
    x = _x(rows, k, seed=rows + k)
    y = cpu_kernels.q4_mm(x, *p.tensors) if p.kind == "q4" else cpu_kernels.q8_mm(x, *p.tensors)
    want = packed_matmul(x, p.kind, p.tensors)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    dense = packed_mm.dequantize(p.kind, p.tensors)
    exact = x @ dense.t()
    if not takes_int8(x, p.kind, p.tensors):
        torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
        return
    # The m term of q4 multiplies float x, so only d * q sees x's rounding.
    m = (p.tensors[2] if len(p.tensors) > 2 else p.tensors[1] * -8.0) if p.kind == "q4" else None
    scaled = dense - m.repeat_interleave(32, dim=1) if m is not None else dense
    step = x.reshape(rows, -1, 32).abs().amax(-1) / 127  # [rows, groups]
    w_sum = scaled.abs().reshape(scaled.shape[0], -1, 32).sum(-1)  # [N, groups]
    bound = step / 2 @ w_sum.t()
    err = (y - exact).abs()
    assert bool((err <= bound * (1 + 1e-4) + 1e-4).all()), float((err - bound).max())
    assert float(err.max()) > 0  # the rows really went in as int8


def test_machine_reports_its_int8_rows() -> None:
    """2 on AVX-512 VNNI machines (what the kernels were tuned on), 0 elsewhere."""
    flags = Path("/proc/cpuinfo").read_text().split()
    vnni = "avx512_vnni" in flags and "avx512bw" in flags
    assert cpu_kernels.int8_rows() == (2 if vnni else 0)
