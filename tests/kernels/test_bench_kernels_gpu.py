"""bench/kernels_gpu.py: its no-GPU answer, and its checks run end to end at toy sizes."""

from __future__ import annotations

import json

import pytest
import torch

from bench.kernels_gpu import BenchConfig, main, run
from tests.kernels.paged_batch import DEVICE


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path is for machines without CUDA")
def test_without_cuda_prints_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert json.loads(capsys.readouterr().out) == {"bench": "kernels_gpu", "skipped": "no CUDA device"}


def test_checks_pass_at_toy_sizes() -> None:
    """The same code path as on the GPU (interpreter on CPU), so a broken check shows up here."""
    cfg = BenchConfig(
        num_seqs=5, max_context=70, prefill_seqs=2, prefill_len=9, num_heads=4, num_kv_heads=2,
        head_dim=64, hidden=96, intermediate=80, num_tokens=7,
    )  # fmt: skip
    out = run(cfg, DEVICE)
    json.dumps(out)
    assert out["all_ok"], out
    attn = out["results"]["paged_attention_mixed"]
    assert attn["num_tokens"] == 2 * 9 + 3 and "sdpa_gathered_ms" in attn, attn
    assert attn["sdpa_max_abs_err"] < 1.6e-2  # the baseline computes the same attention
    assert {"rms_norm", "rms_norm_residual", "rotary", "silu_and_mul", "kv_write"} <= out["results"].keys()
