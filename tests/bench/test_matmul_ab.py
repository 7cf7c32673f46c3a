"""bench/matmul_ab.py: a round over two builds (the default one twice, no compile) on a step's
matmuls (two layers' and the LM head) yields each build's timing, ratio to base and the bitwise
check."""

from __future__ import annotations

import pytest
import torch
from pagebus.kernels import cpu_native

from bench.matmul_ab import measure, step_weights


def test_measure_two_builds() -> None:
    if not cpu_native.native_ops().tiles_built():
        pytest.skip("this build has no tile matmul (no AVX-512 or AVX2 + FMA)")
    ops = cpu_native.native_ops()
    weights = step_weights(torch.float32, layers=2)
    assert len(weights) == 2 * 4 + 1
    out = measure({"base": ops, "control": ops}, weights, rows=1, dtype=torch.float32, rounds=2)
    assert set(out) == {"base", "control"}
    for figures in out.values():
        assert figures["bitwise_equal_to_base"] is True
        assert figures["median_ms"] > 0
    assert out["base"]["over_base"]["median"] == 1.0
