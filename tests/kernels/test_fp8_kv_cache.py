"""An fp8 (e4m3) KV cache: the writers store the bytes torch's cast gives, and every attention op
(Triton, the CPU path) reads it like the reference, which dequantizes and then attends."""

from __future__ import annotations

import pytest
import torch
from pagebus.kernels.fp8 import FP8_DTYPE, FP8_MAX, kv_cache_dtype, to_fp8, widen
from pagebus.kernels.kv_cache_write import write_kv_cache, write_kv_cache_cpu, write_kv_cache_ref
from pagebus.kernels.paged_attention import PagedAttentionOptions, paged_attention, paged_attention_ref
from pagebus.kernels.paged_attention_cpu import paged_attention_cpu

from tests.kernels.paged_batch import DEVICE, PagedBatch, make_batch
from tests.kernels.test_paged_attention import MIXED, TOL

SCALES = [(1.0, 1.0), (0.37, 2.5)]


def _values(n: int, kvh: int, d: int, g: torch.Generator) -> torch.Tensor:
    """Magnitudes from e4m3's subnormals (< 2**-6) to past its largest value (448): every rounding
    case, saturation included; plus exact midpoints between two e4m3 values (ties to even)."""
    x = torch.randn(n, kvh, d, generator=g) * torch.logspace(-4, 3, n * kvh * d).view(n, kvh, d)
    codes = torch.arange(120, dtype=torch.uint8).view(FP8_DTYPE).float()  # positives, increasing
    mids = (codes[1:] + codes[:-1]) / 2
    flat = x.view(-1)
    flat[: mids.numel()] = mids
    flat[mids.numel() : 2 * mids.numel()] = -mids
    return x


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
def test_writers_store_torchs_e4m3_bytes(k_scale: float, v_scale: float) -> None:
    g = torch.Generator().manual_seed(0)
    n, kvh, d, bs, nb = 48, 2, 32, 16, 5
    key, value = _values(n, kvh, d, g), _values(n, kvh, d, g).flip(0)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[[3, 40]] = -1
    shape = (nb, bs, kvh, d)
    ref_k, ref_v = torch.zeros(shape, dtype=FP8_DTYPE), torch.zeros(shape, dtype=FP8_DTYPE)
    write_kv_cache_ref(key, value, ref_k, ref_v, slots, k_scale, v_scale)
    keep = slots >= 0
    flat = ref_k.view(-1, kvh, d)[slots[keep]]
    assert torch.equal(flat.view(torch.uint8), to_fp8(key[keep], k_scale).view(torch.uint8))
    assert float(flat.float().abs().max()) == FP8_MAX  # saturated, never NaN
    cpu_k, cpu_v = torch.zeros_like(ref_k), torch.zeros_like(ref_v)
    write_kv_cache_cpu(key, value, cpu_k, cpu_v, slots, memo={}, k_scale=k_scale, v_scale=v_scale)
    tri_k = torch.zeros(shape, dtype=FP8_DTYPE, device=DEVICE)
    tri_v = torch.zeros_like(tri_k)
    write_kv_cache(key.to(DEVICE), value.to(DEVICE), tri_k, tri_v, slots.to(DEVICE), k_scale, v_scale)
    for got, ref in ((cpu_k, ref_k), (cpu_v, ref_v), (tri_k.cpu(), ref_k), (tri_v.cpu(), ref_v)):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def _fp8_batch(
    dtype: torch.dtype, k_scale: float, v_scale: float, seed: int
) -> tuple[PagedBatch, PagedBatch]:
    """MIXED as an fp32/fp16 batch and the same with its caches stored as e4m3 at these scales."""
    batch = make_batch(MIXED, 6, 2, 64, dtype=dtype, seed=seed)
    k8, v8 = to_fp8(batch.k_cache, k_scale), to_fp8(batch.v_cache, v_scale)
    return batch, PagedBatch(batch.q, k8, v8, batch.block_tables, batch.seq_lens, batch.query_start_loc)


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_reads_fp8_like_the_reference(dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    _, b8 = _fp8_batch(dtype, k_scale, v_scale, seed=1)
    ref = paged_attention_ref(*b8.args(), 0.125, k_scale=k_scale, v_scale=v_scale)
    for splits in (1, 2):  # with and without the flash-decoding merge (v_scale rides on the partials)
        got = paged_attention(
            *b8.args(), 0.125, k_scale=k_scale, v_scale=v_scale,
            options=PagedAttentionOptions(num_splits=splits),
        )  # fmt: skip
        torch.testing.assert_close(got, ref, **TOL[dtype])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU op (it defers to the ref elsewhere)")
@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
def test_cpu_op_reads_fp8_like_the_reference(k_scale: float, v_scale: float) -> None:
    _, b8 = _fp8_batch(torch.float32, k_scale, v_scale, seed=2)
    ref = paged_attention_ref(*b8.args(), 0.125, k_scale=k_scale, v_scale=v_scale)
    host = {"seq_lens_host": b8.seq_lens.tolist(), "query_start_loc_host": b8.query_start_loc.tolist()}
    for extra in ({}, host):
        got = paged_attention_cpu(*b8.args(), 0.125, k_scale=k_scale, v_scale=v_scale, memo={}, **extra)
        torch.testing.assert_close(got, ref, **TOL[torch.float32])
    decode = make_batch([(1, 40), (1, 7), (1, 90)], 6, 2, 64, seed=3)
    d8 = PagedBatch(decode.q, to_fp8(decode.k_cache), to_fp8(decode.v_cache), *decode.args()[3:])
    got = paged_attention_cpu(*d8.args(), 0.125, max_query_len=1, memo={}, seq_lens_host=[41, 8, 91])
    torch.testing.assert_close(got, paged_attention_ref(*d8.args(), 0.125), **TOL[torch.float32])


def test_fp8_cache_stays_close_to_the_float_cache() -> None:
    """What storing K/V in e4m3 costs: 3 mantissa bits round each value by up to 2**-4 of itself
    (2.7% RMS over unit-normal K/V), and the attention output moves by about 1.4x that (3.7%
    relative RMS, seeds 0-3). Bound: 5%."""
    batch, b8 = _fp8_batch(torch.float32, 1.0, 1.0, seed=4)
    exact = paged_attention_ref(*batch.args(), 0.125)
    approx = paged_attention_ref(*b8.args(), 0.125)
    rel = float((approx - exact).norm() / exact.norm())
    assert 0.0 < rel < 0.05, rel


def test_cache_dtype_names() -> None:
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.float32) == kv_cache_dtype("fp8_e4m3", torch.float32) == FP8_DTYPE
    with pytest.raises(ValueError, match=r"fp8_e5m2.*not supported"):
        kv_cache_dtype("fp8_e5m2", torch.float32)


def test_widen_gives_torchs_values_for_every_byte() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).reshape(4, 64)  # NaNs too: compare bits
    assert torch.equal(widen(codes).view(torch.int32), codes.float().view(torch.int32))
    strided = codes.t()  # not contiguous
    assert torch.equal(widen(strided).view(torch.int32), strided.float().view(torch.int32))
