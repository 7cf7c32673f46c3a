"""The compiled decode stack (kernels/csrc/cpu_ops.cpp DecodeStack, built by workers/models/
llama.py) runs every layer of a decode-only step in one call: its logits must equal, bit for
bit, those of the same layers called one by one from Python, for packed GGUF weights and for
float32 and bfloat16 column tiles, with steps of one and of several sequences: six at once,
more than the GEMV path's rows on any build, so the batched tile path runs too."""

from __future__ import annotations

import pytest
import torch
from pagebus.bus.config import EngineConfig
from pagebus.kernels import cpu_native as native
from pagebus.workers.runner import ModelRunner

from tests.workers.drive import drive_greedy_seen

BF16_TILES = pytest.mark.skipif(
    native.available() is not None or not native.native_ops().bf16_tiles_built(),
    reason="bfloat16 tiles need the compiled ops on an AVX-512 BF16 CPU",
)

PROMPTS = {f"p{i}": ([100 + 7 * i + j for j in range(18 + 9 * i)], 10) for i in range(6)}


def _logits_of_each_step(runner: ModelRunner) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    seen: list[torch.Tensor] = []
    tokens = drive_greedy_seen(runner, PROMPTS, lambda fb, logits: seen.append(logits.clone()))
    return tokens, seen


@pytest.mark.parametrize(
    ("quantization", "dtype"),
    [
        ("gguf", "float32"),  # Q4_1 packed
        ("none", "float32"),  # dequantized to float32 tiles
        pytest.param("none", "bfloat16", marks=BF16_TILES),  # bfloat16 tiles
    ],
)
def test_stack_equals_layer_by_layer(default_model: str, quantization: str, dtype: str) -> None:
    cfg = EngineConfig(dtype=dtype, num_kv_blocks=64, max_num_seqs=8, quantization=quantization)
    runner = ModelRunner(cfg, default_model)
    if runner.ops.decode_stack is None:
        pytest.skip("the compiled CPU ops did not build: the torch backend has no decode stack")
    model = runner.model.model
    with_stack, logits = _logits_of_each_step(runner)
    assert model._stack is not None and model._stack[1] is not None
    assert model._stack[1].num_layers() == len(model.held_layers)
    model.use_decode_stack = False
    without, ref = _logits_of_each_step(runner)
    assert with_stack == without
    assert len(logits) == len(ref)
    for a, b in zip(logits, ref, strict=True):
        assert torch.equal(a, b)
