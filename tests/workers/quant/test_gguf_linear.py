"""GGUF blocks kept packed: each format unpacks to exactly what the gguf package's dequantizer
gives, and the quantized matmul (CPU kernels: GEMV for <= 4 rows, BLAS tiles above) matches
dequantize-then-matmul to float32 rounding."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from pagebus.workers.layers.linear import Embedding, Linear
from pagebus.workers.layers.quant.gguf import (
    GGUFLinearMethod,
    GGUFWeight,
    UnsupportedQuantType,
    _dense,
    _split,
)

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


def _quantized(rows: int, cols: int, qtype: str, seed: int) -> tuple[GGUFWeight, torch.Tensor]:
    """A random matrix in `qtype` blocks, and the gguf package's dequantization of them."""
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype])
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]).astype(np.float32)
    return GGUFWeight(qtype, torch.from_numpy(blocks), cols, f"test.{qtype}"), torch.from_numpy(ref)


@pytest.mark.parametrize("qtype", FORMATS)
def test_unpacks_to_gguf_dequantizer(qtype: str) -> None:
    w, ref = _quantized(48, 256, qtype, seed=1)
    assert torch.equal(_dense(_split(w)), ref)
    assert torch.equal(w.dequantize(), ref)


def _linear(shards: dict[str | int, int], k: int) -> Linear:
    return Linear(k, shards, quant_method=GGUFLinearMethod())


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 40])
def test_matmul_matches_dequantized(qtype: str, rows: int) -> None:
    """Whole-matrix and fused loads; tolerance: float32 rounding of 576-long dot products."""
    n, k = 160, 576
    w, ref = _quantized(n, k, qtype, seed=2)
    layer = _linear({0: n}, k)
    layer.load_weight(layer.weight, w, None)
    layer.process_after_loading()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(layer(x), x @ ref.t(), rtol=1e-5, atol=1e-4)


def test_fused_shards_of_mixed_types_and_bias() -> None:
    """llama.cpp's mixes fuse e.g. Q4 q/k with a Q8_0 v: each run of one type is one matmul."""
    k = 256
    q, rq = _quantized(64, k, "Q4_1", seed=3)
    kk, rk = _quantized(32, k, "Q4_0", seed=4)
    v, rv = _quantized(32, k, "Q8_0", seed=5)
    layer = Linear(k, {"q": 64, "k": 32, "v": 32}, bias=True, quant_method=GGUFLinearMethod())
    for shard, w in (("v", v), ("q", q), ("k", kk)):  # any order
        layer.load_weight(layer.weight, w, shard)
    bias = torch.randn(128)
    layer.bias.data.copy_(bias)  # type: ignore[union-attr]
    layer.process_after_loading()
    method = layer.quant_method
    assert isinstance(method, GGUFLinearMethod)
    assert [p.kind for p in method.parts] == ["q4", "q8"]  # Q4_1 and Q4_0 share the q4 kernel
    x = torch.randn(2, 3, k)
    torch.testing.assert_close(layer(x), x @ torch.cat([rq, rk, rv]).t() + bias, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", FORMATS)
def test_tied_embedding_reads_head_rows(qtype: str) -> None:
    w, ref = _quantized(64, 128, qtype, seed=6)
    head = _linear({0: 64}, 128)
    emb = Embedding(64, 128)
    emb.tie_to(head)
    head.load_weight(head.weight, w, None)
    head.process_after_loading()
    ids = torch.tensor([0, 63, 7, 7])
    assert torch.equal(emb(ids), ref[ids])
    assert emb.weight is head.weight  # one parameter, held packed


def test_narrow_takes_rows_and_whole_groups() -> None:
    w, ref = _quantized(16, 128, "Q4_1", seed=7)
    assert torch.equal(w.narrow(0, 4, 8).dequantize(), ref[4:12])
    assert torch.equal(w.narrow(1, 32, 64).dequantize(), ref[:, 32:96])
    with pytest.raises(ValueError, match="whole groups"):
        w.narrow(1, 16, 32)


def test_unsupported_type_is_named() -> None:
    blocks = torch.zeros(4, 144, dtype=torch.uint8)  # Q4_K: 256-wide super-blocks of 144 bytes
    layer = _linear({0: 4}, 256)
    with pytest.raises(UnsupportedQuantType, match="Q4_K"):
        layer.load_weight(layer.weight, GGUFWeight("Q4_K", blocks, 256, "blk.0.ffn_up.weight"), None)


def test_shape_mismatch_is_refused() -> None:
    w, _ = _quantized(8, 64, "Q8_0", seed=8)
    layer = _linear({0: 16}, 64)
    with pytest.raises(ValueError, match="expected shape"):
        layer.load_weight(layer.weight, w, None)
