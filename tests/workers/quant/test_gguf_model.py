"""The default model served from its own Q4_1 GGUF, kept packed, against the same weights
dequantized at load: greedy tokens on the oracle prompts, and the weights' resident bytes."""

from __future__ import annotations

from typing import NoReturn

import pytest
import torch
from pagebus.bus.config import EngineConfig
from pagebus.frontends.tokenizer import Tokenizer
from pagebus.workers.layers.quant import cpu_kernels, select
from pagebus.workers.layers.quant.gguf import GGUFLinearMethod
from pagebus.workers.loader import resident_weight_bytes
from pagebus.workers.runner import ModelRunner

from tests.workers.drive import drive_greedy
from tests.workers.oracle import PROMPTS

STEPS = 8


def _runner(path: str, quantization: str) -> ModelRunner:
    cfg = EngineConfig(dtype="float32", num_kv_blocks=128, max_num_seqs=8, quantization=quantization)
    return ModelRunner(cfg, path)


@pytest.fixture(scope="module")
def runners(default_model: str) -> dict[str, ModelRunner]:
    return {q: _runner(default_model, q) for q in ("gguf", "none")}


def _no_build() -> NoReturn:
    raise cpu_kernels.KernelBuildError("building the quantized-weight CPU kernels failed (test)")


def test_greedy_tokens_match_dequantized(runners: dict[str, ModelRunner], default_model: str) -> None:
    tok = Tokenizer.from_model(default_model)
    prompts = {f"p{i}": (tok.encode(p), STEPS) for i, p in enumerate(PROMPTS[:4])}  # the time budget
    packed, _ = drive_greedy(runners["gguf"], prompts)
    dense, _ = drive_greedy(runners["none"], prompts)
    assert packed == dense


def test_without_kernels_tokens_still_match(runners: dict[str, ModelRunner], default_model: str) -> None:
    """A machine that cannot build the C++ kernels serves --quantization gguf dequantized at load."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernels, "_ops", _no_build)
        cpu_kernels.available.cache_clear()
        try:
            fallback = _runner(default_model, "gguf")
        finally:
            cpu_kernels.available.cache_clear()
    methods = [m.quant_method for m in fallback.model.modules() if hasattr(m, "quant_method")]
    parts = [p for q in methods if isinstance(q, GGUFLinearMethod) for p in q.parts]
    assert parts and all(p.kind == "dense" for p in parts)
    tok = Tokenizer.from_model(default_model)
    prompts = {f"p{i}": (tok.encode(p), STEPS) for i, p in enumerate(PROMPTS[:2])}
    assert drive_greedy(fallback, prompts)[0] == drive_greedy(runners["none"], prompts)[0]


def test_q4_1_weights_take_at_most_half_their_bf16_bytes(runners: dict[str, ModelRunner]) -> None:
    """Counted on the parameters and buffers the model holds (packed ones as packed)."""
    dense = runners["none"].model
    params = sum(p.numel() for p in dense.parameters())  # fp32 model: one value per weight
    bf16_bytes = params * 2
    held = resident_weight_bytes(runners["gguf"].model)
    assert held <= bf16_bytes // 2, (held, bf16_bytes)
    assert resident_weight_bytes(dense) == params * 4
    packed = [m for m in runners["gguf"].model.modules() if hasattr(m, "quant_method")]
    assert packed and all(m.weight.dtype in (torch.uint8, torch.int8) for m in packed)


def test_gguf_quantization_needs_a_gguf_file() -> None:
    with pytest.raises(ValueError, match=r"needs a \.gguf file"):
        select.resolve("gguf", is_gguf=False)
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported"):
        select.resolve("bitsandbytes", is_gguf=True)
    with pytest.raises(ValueError, match=r"--quantization awq needs a checkpoint whose config\.json"):
        select.resolve("awq", is_gguf=True)  # a GGUF file has no quantization_config
