"""The weight cache (workers/weight_cache.py): a second start reads the weights as held back, bit
for bit and without the checkpoint; whatever changes what would be held misses; a damaged or
unwritable cache costs the cache only; old entries are pruned."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from pagebus.workers import runner as runner_mod
from pagebus.workers.distributed.layout import Layout
from pagebus.workers.distributed.state import Parallel, building
from pagebus.workers.layers.linear import Linear
from pagebus.workers.runner import load_model
from pagebus.workers.weight_cache import cache_key, prune

from tests.workers.test_architectures import _save

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "model"
    _save("llama3-scaled-tied", str(path), shard=False)  # tied: the head and embedding share a matrix
    return str(path)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEBUS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "weights"


def _held(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict([*model.named_parameters(), *model.named_buffers()])


def _assert_same_held(a: torch.nn.Module, b: torch.nn.Module) -> None:
    ha, hb = _held(a), _held(b)
    assert ha.keys() == hb.keys()
    for name, t in ha.items():
        u = hb[name]
        assert (t.dtype, t.shape, t.stride()) == (u.dtype, u.shape, u.stride()), name
        assert torch.equal(t, u), name


def _load(path: str, quantization: str | None = None, cache: bool = True) -> torch.nn.Module:
    return load_model(path, torch.float32, CPU, quantization=quantization, weight_cache=cache)[0]


def _no_checkpoint_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("the checkpoint was read although the cache holds the weights")

    monkeypatch.setattr(runner_mod, "iter_safetensors", refuse)
    monkeypatch.setattr(runner_mod, "iter_gguf", refuse)


@pytest.mark.parametrize("quantization", [None, "fp16"])
def test_second_load_reads_the_held_weights_back(
    tiny: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, quantization: str | None
) -> None:
    reference = _load(tiny, quantization, cache=False)
    assert not cache_dir.exists()
    first = _load(tiny, quantization)
    assert len(list(cache_dir.glob("*.safetensors"))) == 1
    _no_checkpoint_reads(monkeypatch)
    second = _load(tiny, quantization)
    _assert_same_held(reference, first)
    _assert_same_held(reference, second)
    # the calls bound from the held weights work on the restored ones: same outputs
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    for (name, la), lb in zip(
        ((n, m) for n, m in reference.named_modules() if isinstance(m, Linear)),
        (m for m in second.modules() if isinstance(m, Linear)),
        strict=True,
    ):
        if la.in_features == 64:
            assert torch.equal(la(x), lb(x)), name
            assert (la.native_mm is None) == (lb.native_mm is None), name
    emb = second.model.embed_tokens
    assert emb.weight is second.lm_head.weight  # the tie survives the restore


def test_what_changes_the_held_weights_misses(tiny: str, cache_dir: Path) -> None:
    _load(tiny)
    _load(tiny, "fp16")
    assert len(list(cache_dir.glob("*.safetensors"))) == 2
    held = {"none": cache_key(tiny, "none", torch.float32)}
    assert cache_key(tiny, "none", torch.bfloat16) != held["none"]
    with building(Parallel(Layout(tp_size=2, rank=1))):
        assert cache_key(tiny, "none", torch.float32) != held["none"]
    weights = Path(tiny) / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert cache_key(tiny, "none", torch.float32) != held["none"]


def test_damaged_entry_falls_back_and_is_rewritten(
    tiny: str, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reference = _load(tiny, cache=False)
    _load(tiny)
    (entry,) = cache_dir.glob("*.safetensors")
    entry.write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING, logger="pagebus.workers.weight_cache"):
        model = _load(tiny)
    assert "not used" in caplog.text
    _assert_same_held(reference, model)
    assert entry.stat().st_size > 1000  # the load wrote a whole entry again


def test_formats_with_state_outside_tensors_are_not_cached(tiny: str, cache_dir: Path) -> None:
    _load(tiny, "int8")  # its packed parts live on the quant method
    assert not cache_dir.exists()
    _load(tiny, cache=False)
    assert not cache_dir.exists()


def test_unwritable_cache_still_loads(
    tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PAGEBUS_CACHE_DIR", str(blocker))  # weights/ cannot be made under a file
    with caplog.at_level(logging.WARNING, logger="pagebus.workers.weight_cache"):
        model = _load(tiny)
    assert "could not write" in caplog.text
    _assert_same_held(_load(tiny, cache=False), model)


def test_prune_drops_the_least_recently_used_beyond_the_budget(tmp_path: Path) -> None:
    files = []
    for i in range(5):
        f = tmp_path / f"{i}.safetensors"
        f.write_bytes(b"x" * 100)
        os.utime(f, (1000 + i, 1000 + i))  # 0 oldest
        files.append(f)
    prune(tmp_path, keep=files[0], max_bytes=250)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["0.safetensors", "4.safetensors"]


def test_engine_option_turns_it_off(tiny: str, cache_dir: Path) -> None:
    from pagebus.bus.config import make_engine_config
    from pagebus.workers.runner import ModelRunner

    ModelRunner(make_engine_config(dtype="float32", num_kv_blocks=16, weight_cache=False), tiny)
    assert not cache_dir.exists()
    ModelRunner(make_engine_config(dtype="float32", num_kv_blocks=16), tiny)  # on by default
    assert len(list(cache_dir.glob("*.safetensors"))) == 1
