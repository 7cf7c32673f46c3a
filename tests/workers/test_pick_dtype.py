"""`dtype auto`: bf16 where the CPU multiplies bf16 natively, float32 for quantized weights on CPUs."""

from __future__ import annotations

import pytest
import torch
from pagebus.bus.config import EngineConfig
from pagebus.workers import device


@pytest.mark.parametrize("native_bf16", [True, False])
@pytest.mark.parametrize("held", ["none", "gguf", "int8", "gptq", "awq", "fp8"])
def test_auto_on_cpus(monkeypatch: pytest.MonkeyPatch, native_bf16: bool, held: str) -> None:
    monkeypatch.setattr(device, "cpu_has_bf16", lambda: native_bf16)
    want = torch.bfloat16 if native_bf16 and held == "none" else torch.float32
    assert device.pick_dtype(EngineConfig(), torch.device("cpu"), held) is want


def test_auto_on_gpus_and_explicit_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "cpu_has_bf16", lambda: True)
    assert device.pick_dtype(EngineConfig(), torch.device("cuda"), "gguf") is torch.bfloat16
    assert device.pick_dtype(EngineConfig(dtype="bfloat16"), torch.device("cpu"), "gguf") is torch.bfloat16
    assert device.pick_dtype(EngineConfig(dtype="float16"), torch.device("cpu")) is torch.float16
