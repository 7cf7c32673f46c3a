"""bench/quant_matmul_gpu.py: its no-GPU answer, and its checks end to end at a toy shape."""

from __future__ import annotations

import json

import pytest
import torch

from bench.quant_matmul_gpu import main, run
from tests.kernels.paged_batch import DEVICE


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path is for machines without CUDA")
def test_without_cuda_prints_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert json.loads(capsys.readouterr().out) == {"bench": "quant_matmul_gpu", "skipped": "no CUDA device"}


def test_checks_pass_at_a_toy_shape() -> None:
    out = run([("toy", 40, 256)], [1, 3], 2, DEVICE)
    json.dumps(out)
    assert out["all_ok"], out
    r = out["results"]
    assert set(r) == {f"{k}_rows{m}" for k in ("w4a16", "w8a16", "bf16") for m in (1, 3)}
    # what each format reads: 4 bits + two float32 per 128 weights; 8 bits + one per row
    assert r["w4a16_rows1"]["weight_bytes_per_layer"] == 40 * 256 // 2 + 2 * 4 * 40 * 2
    assert r["w8a16_rows1"]["weight_bytes_per_layer"] == 40 * 256 + 4 * 40
