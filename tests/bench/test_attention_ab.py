"""bench/attention_ab.py: shapes parse or fail clearly, and a round over two builds (the default one
twice, no compile) yields each build's timings, ratios to base and the bitwise check."""

from __future__ import annotations

import argparse

import pytest
import torch
from pagebus.kernels import cpu_native

from bench.attention_ab import Case, measure, parse_shape


def test_parse_shape() -> None:
    assert parse_shape("64x192") == (64, 192)
    for bad in ("64", "0x10", "4x", "ax3", "4x-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="BxL"):
            parse_shape(bad)


def test_measure_two_builds() -> None:
    ops = cpu_native.native_ops()
    case = Case(3, 40, torch.float32, layers=2)
    out = measure({"base": ops, "control": ops}, case, rounds=2)
    assert set(out) == {"base", "control"}
    for figures in out.values():
        assert figures["bitwise_equal_to_base"] is True
        for kind in ("dram", "cache"):
            assert figures[kind]["median_ms"] > 0
    assert out["base"]["dram"]["over_base"]["median"] == 1.0
