"""bench/kernel_ab.py and kernels.cpu_native.using_build: an engine made and run inside its build's
`using_build` runs that build alone, another engine's runs never reach it, and the default build is
back after. The builds here are the default one seen through counting proxies (no compile)."""

from __future__ import annotations

import argparse
import collections
from typing import Any

import pytest
from pagebus.kernels import cpu_native

from bench.kernel_ab import (
    SOURCE,
    BuildEngine,
    add_build_options,
    build_sources,
    paired_ratios,
    parse_variant,
)


class CountingBuild:
    """The default build's functions, each call through this object counted by name."""

    def __init__(self) -> None:
        self._real = cpu_native.native_ops()
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def test_using_build_puts_the_default_back() -> None:
    default = cpu_native.native_ops()
    proxy = CountingBuild()
    with cpu_native.using_build(proxy):
        assert cpu_native.native_ops() is proxy
        assert cpu_native.tiles_matmul_address() == default.tiles_matmul_address()
        assert proxy.calls["tiles_matmul_address"] == 1  # resolved anew inside, not the cached one
    assert cpu_native.native_ops() is default


def test_each_engine_runs_its_own_build() -> None:
    from bench.peers import pagebus_generate

    a, b = CountingBuild(), CountingBuild()
    ea = BuildEngine(a, lambda: pagebus_generate("float32", "float16", "fp16"))
    eb = BuildEngine(b, lambda: pagebus_generate("float32", "float16", "fp16"))
    assert cpu_native.native_ops() is a._real  # construction left the default in place
    prompts = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(3)]
    for engine, mine, other in ((ea, a, b), (eb, b, a), (ea, a, b)):
        before_mine, before_other = sum(mine.calls.values()), dict(other.calls)
        assert engine.generate(prompts, 6) == [6, 6, 6]
        assert sum(mine.calls.values()) > before_mine
        assert dict(other.calls) == before_other, "a run reached another engine's build"
    # prefill and decode both ran on each engine's own build: its norms, its decode stack
    for build in (a, b):
        assert build.calls["rms_norm"] > 0 and build.calls["DecodeStack"] >= 1
    assert ea.tokens(prompts, 8) == eb.tokens(prompts, 8)


def test_paired_ratios_per_size_and_single() -> None:
    def res(times: list[float], rates: list[float]) -> dict[str, Any]:
        off = {"output_tokens": 100, "elapsed_runs_s": times}
        return {"offline_by_size": {"4": off}, "single": {"decode_runs_tokens_per_s": rates}}

    out = paired_ratios(
        res([2.0, 1.0, 4.0], [10.0, 20.0, 30.0]), res([1.0, 1.0, 1.0], [10.0, 10.0, 10.0]), [4], True
    )
    assert out["offline_4"] == {"median": 0.5, "min": 0.25, "max": 1.0}
    assert out["single_decode"] == {"median": 2.0, "min": 1.0, "max": 3.0}


def test_parse_variant_rejects_bad_specs(tmp_path: Any) -> None:
    src = tmp_path / "v.cpp"
    src.write_text("// a copy")
    assert parse_variant(f"wide={src}") == ("wide", src)
    for bad in (
        str(src),
        f"base={src}",
        f"control={src}",
        f"no-dash={src}",
        f"wide={tmp_path / 'missing.cpp'}",
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant(bad)


def test_build_sources_base_control_then_variants(tmp_path: Any) -> None:
    src = tmp_path / "wide.cpp"
    src.write_text("// edited")
    ap = argparse.ArgumentParser()
    add_build_options(ap)
    assert build_sources(ap.parse_args([])) == [("base", SOURCE)]
    args = ap.parse_args(["--variant", f"wide={src}", "--control"])
    assert build_sources(args) == [("base", SOURCE), ("control", SOURCE), ("wide", src)]
