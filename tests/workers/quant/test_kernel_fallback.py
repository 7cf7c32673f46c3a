"""When the C++ kernels cannot be built, a failed build names what it needs, and quantized
layers still compute the same values: GGUF weights dequantized at load, and the q4/q8 matmuls
other formats call run in torch. (The model-level token check is in test_gguf_model.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
import torch
from pagebus.workers.layers.linear import Linear
from pagebus.workers.layers.quant import cpu_kernels
from pagebus.workers.layers.quant.gguf import GGUFLinearMethod

from tests.workers.quant.test_gguf_linear import _quantized


def test_build_without_a_compiler_names_what_it_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(cpu_kernels.KernelBuildError, match=r"g\+\+\) and ninja"):
        cpu_kernels._build(str(tmp_path))


def _no_build() -> NoReturn:
    raise cpu_kernels.KernelBuildError("building the quantized-weight CPU kernels failed (test)")


@pytest.fixture
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(cpu_kernels, "_ops", _no_build)
    cpu_kernels.available.cache_clear()
    yield
    cpu_kernels.available.cache_clear()


@pytest.mark.usefixtures("no_kernels")
def test_gguf_layer_dequantizes_at_load(caplog: pytest.LogCaptureFixture) -> None:
    k = 512
    a, ra = _quantized(32, k, "Q4_K", seed=20)
    b, rb = _quantized(16, k, "Q6_K", seed=21)
    layer = Linear(k, {"a": 32, "b": 16}, quant_method=GGUFLinearMethod())
    layer.load_weight(layer.weight, a, "a")
    layer.load_weight(layer.weight, b, "b")
    with caplog.at_level("WARNING"):
        layer.process_after_loading()
    assert "run in torch instead" in caplog.text
    method = layer.quant_method
    assert isinstance(method, GGUFLinearMethod)
    assert [(p.kind, p.rows) for p in method.parts] == [("dense", 48)]
    x = torch.randn(3, k)
    ref = torch.cat([ra, rb])
    torch.testing.assert_close(layer(x), x @ ref.t(), rtol=1e-5, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.usefixtures("no_kernels")
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_q4_q8_matmuls_run_in_torch(qtype: str) -> None:
    """What GPTQ/AWQ/int8 layers call: the torch path gives dequantize-then-matmul."""
    from pagebus.workers.layers.quant.gguf import _split

    w, ref = _quantized(64, 256, qtype, seed=22)
    p = _split(w)
    x = torch.randn(2, 256)
    y = cpu_kernels.q4_mm(x, *p.tensors) if p.kind == "q4" else cpu_kernels.q8_mm(x, *p.tensors)
    torch.testing.assert_close(y, x @ ref.t(), rtol=1e-5, atol=1e-4)
