"""GGUF blocks kept packed: each format unpacks to exactly what the gguf package's dequantizer
gives, and the quantized matmul (CPU kernels: GEMV up to 64 rows, dequantize + BLAS above)
matches dequantize-then-matmul to float32 rounding. Blocks come from gguf's quantizer where it
has one, else (K-quants, which it only reads) they are random bytes with valid fp16 scales."""

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
from pagebus.workers.layers.quant.gguf_blocks import BLOCKS

from tests.workers.quant.packed_reference import packed_matmul

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
_QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")  # gguf.quants.quantize has these
_FP16_AT = {"Q4_K": (0, 2), "Q6_K": (208,)}  # byte offsets of a K-quant block's fp16 scales


def _random_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random quants and 6-bit/int8 sub-scales; the fp16 super-block scales small and finite."""
    per_block, nbytes = BLOCKS[qtype]
    b = rng.integers(0, 256, (rows, cols // per_block, nbytes), dtype=np.uint8)
    for at in _FP16_AT[qtype]:
        d = (rng.standard_normal((rows, cols // per_block, 1)) * 2e-3).astype(np.float16)
        b[..., at : at + 2] = d.view(np.uint8)
    return b.reshape(rows, -1)


def _quantized(rows: int, cols: int, qtype: str, seed: int) -> tuple[GGUFWeight, torch.Tensor]:
    """A random matrix in `qtype` blocks, and the gguf package's dequantization of them."""
    rng = np.random.default_rng(seed)
    if qtype in _QUANTIZABLE:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        blocks = gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype])
    else:
        blocks = _random_blocks(rows, cols, qtype, rng)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]).astype(np.float32)
    return GGUFWeight(qtype, torch.from_numpy(blocks), cols, f"test.{qtype}"), torch.from_numpy(ref)


@pytest.mark.parametrize("qtype", FORMATS)
def test_unpacks_to_gguf_dequantizer(qtype: str) -> None:
    w, ref = _quantized(48, 512, qtype, seed=1)
    assert torch.equal(_dense(_split(w)), ref)
    assert torch.equal(w.dequantize(), ref)


def test_q4_0_holds_no_offsets() -> None:
    """Symmetric Q4_0 keeps quants and d only (w = d (q - 8)): 20 bytes a group of 32, not 24."""
    w, ref = _quantized(64, 256, "Q4_0", seed=4)
    p = _split(w)
    assert p.kind == "q4" and len(p.tensors) == 2
    assert sum(t.numel() * t.element_size() for t in p.tensors) == 64 * (256 // 32) * 20
    assert torch.equal(_dense(p), ref)


def _linear(shards: dict[str | int, int], k: int) -> Linear:
    return Linear(k, shards, quant_method=GGUFLinearMethod())


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64, 65, 70])
def test_matmul_matches_dequantized(qtype: str, rows: int) -> None:
    """Every kernel path (int8 x at 1-2 rows on VNNI machines, float GEMV up to 64 rows,
    dequantize + BLAS above) against its torch reference; tolerance: float32 rounding of
    768-long dot products, relative to the largest weight."""
    n, k = 160, 768
    w, ref = _quantized(n, k, qtype, seed=2)
    layer = _linear({0: n}, k)
    layer.load_weight(layer.weight, w, None)
    layer.process_after_loading()
    method = layer.quant_method
    assert isinstance(method, GGUFLinearMethod)
    (part,) = method.parts
    assert torch.equal(_dense(part), ref)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = packed_matmul(x, part.kind, part.tensors)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4 * float(ref.abs().max()))


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


def test_fused_k_quant_mix() -> None:
    """A Q4_K_M-style gate+up+extra: Q4_K merges with Q4_0 (both q4, groups of 32); Q6_K (q8 in
    groups of 16) stays apart from Q8_0 (groups of 32)."""
    k = 512
    shards = {"a": _quantized(32, k, "Q4_K", 9), "b": _quantized(16, k, "Q4_0", 10)}
    shards |= {"c": _quantized(16, k, "Q6_K", 11), "d": _quantized(32, k, "Q8_0", 12)}
    layer = Linear(k, {s: w.shape[0] for s, (w, _) in shards.items()}, quant_method=GGUFLinearMethod())
    for s, (w, _) in shards.items():
        layer.load_weight(layer.weight, w, s)
    layer.process_after_loading()
    method = layer.quant_method
    assert isinstance(method, GGUFLinearMethod)
    assert [(p.kind, p.rows) for p in method.parts] == [("q4", 48), ("q8", 16), ("q8", 32)]
    ref = torch.cat([r for _, r in shards.values()])
    x = torch.randn(5, k)
    torch.testing.assert_close(layer(x), x @ ref.t(), rtol=1e-5, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.parametrize("qtype", FORMATS)
def test_tied_embedding_reads_head_rows(qtype: str) -> None:
    w, ref = _quantized(64, 256, qtype, seed=6)
    head = _linear({0: 64}, 256)
    emb = Embedding(64, 256)
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
    with pytest.raises(ValueError, match="whole groups of 32"):
        w.narrow(1, 16, 32)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_narrow_k_quant_columns_by_super_block(qtype: str) -> None:
    """Tensor-parallel column cuts of K-quants fall on 256-wide super-blocks."""
    w, ref = _quantized(8, 768, qtype, seed=13)
    assert torch.equal(w.narrow(1, 256, 512).dequantize(), ref[:, 256:])
    assert torch.equal(_dense(_split(w.narrow(0, 2, 4).narrow(1, 0, 256))), ref[2:6, :256])
    with pytest.raises(ValueError, match="whole groups of 256"):
        w.narrow(1, 128, 256)


def test_unsupported_type_is_named() -> None:
    blocks = torch.zeros(4, 84, dtype=torch.uint8)  # Q2_K: 256-wide super-blocks of 84 bytes
    layer = _linear({0: 4}, 256)
    with pytest.raises(UnsupportedQuantType, match="Q2_K"):
        layer.load_weight(layer.weight, GGUFWeight("Q2_K", blocks, 256, "blk.0.ffn_up.weight"), None)


def test_shape_mismatch_is_refused() -> None:
    w, _ = _quantized(8, 64, "Q8_0", seed=8)
    layer = _linear({0: 16}, 64)
    with pytest.raises(ValueError, match="expected shape"):
        layer.load_weight(layer.weight, w, None)
