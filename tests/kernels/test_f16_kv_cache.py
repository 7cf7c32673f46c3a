"""A float16 KV cache beside float32 activations (--kv-cache-dtype float16) in the compiled CPU
ops: the writes round as torch's cast does, and attention over the float16 values equals the
ref's float32 attention over the same values (summation order only). The fused decode call's
float16 case is test_cpu_native's test_fused_decode_attention_is_the_separate_ops."""

from __future__ import annotations

import pytest
import torch
from pagebus.kernels import cpu_native as native
from pagebus.kernels.kv_cache_write import write_kv_cache_ref
from pagebus.kernels.paged_attention import paged_attention_ref

from tests.kernels.paged_batch import make_batch
from tests.kernels.test_cpu_native import _NO_F16, _f16_built
from tests.kernels.test_paged_attention import DECODES, MIXED

TOL = {"atol": 2e-5, "rtol": 2e-5}


pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ops"),
    pytest.mark.skipif(not _f16_built(), reason=_NO_F16),
]


def _f16_batch(seqs: list[tuple[int, int]], head_dim: int, heads: tuple[int, int] = (9, 3)):  # type: ignore[no-untyped-def]
    batch = make_batch(seqs, *heads, head_dim)
    batch.k_cache, batch.v_cache = batch.k_cache.half(), batch.v_cache.half()
    return batch


def test_write_kv_rounds_as_torch_and_skips_slot_minus_one() -> None:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(8, 2, 16, 3, 64, generator=g).half()  # interleaved K/V pages: strided caches
    k, v = torch.randn(5, 3, 64, generator=g) * 300, torch.randn(5, 3, 64, generator=g) * 1e-5
    k[0, 0, :3] = torch.tensor([7e4, -7e4, 65519.0])  # past float16's range: inf, as torch's cast
    slots = torch.tensor([3, -1, 17, 127, 64])
    want_k, want_v = kv[:, 0].clone(), kv[:, 1].clone()
    write_kv_cache_ref(k, v, want_k, want_v, slots)
    assert native.native_cache_dtypes(k, kv[:, 0], kv[:, 1])
    native.write_kv_cache(k, v, kv[:, 0], kv[:, 1], slots)
    assert torch.equal(kv[:, 0], want_k) and torch.equal(kv[:, 1], want_v)


PREFILLS = [(40, 0), (17, 0), (16, 16), (2, 0), (100, 37), (3, 140)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqs", [DECODES, MIXED, PREFILLS], ids=["decodes", "mixed", "prefills"])
def test_attention_reads_the_float16_cache_in_place(seqs: list[tuple[int, int]], head_dim: int) -> None:
    batch = _f16_batch(seqs, head_dim)
    ref = paged_attention_ref(*batch.args(), head_dim**-0.5)  # float32 over the widened cache
    got = native.paged_attention(*batch.args(), head_dim**-0.5, max_query_len=max(n for n, _ in seqs))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, **TOL)
    # the compiled kernels take both kinds of rows themselves (no torch fallback behind the result)
    out = torch.zeros_like(batch.q)
    ops = native.native_ops()
    ops.decode_attention(out, *batch.args(), head_dim**-0.5)
    assert ops.prefill_attention(out, *batch.args(), head_dim**-0.5)
    torch.testing.assert_close(out, ref, **TOL)


def test_other_float16_pairings_run_the_torch_backend() -> None:
    """Only float32 activations over 16-token blocks of head_dim 64 or 128 take the compiled
    float16 path; the rest (bf16 activations, other head sizes) get the torch backend's result."""
    batch = _f16_batch(DECODES + MIXED, 32, (8, 2))
    assert not native.native_cache_dtypes(batch.q, batch.k_cache, batch.v_cache)
    ref = paged_attention_ref(*batch.args(), 0.125)
    torch.testing.assert_close(native.paged_attention(*batch.args(), 0.125, max_query_len=129), ref, **TOL)
    bf16 = _f16_batch(DECODES, 64)
    bf16.q = bf16.q.bfloat16()
    assert not native.native_cache_dtypes(bf16.q, bf16.k_cache, bf16.v_cache)
    got = native.paged_attention(*bf16.args(), 0.125, max_query_len=1)
    torch.testing.assert_close(got, paged_attention_ref(*bf16.args(), 0.125), atol=1.6e-2, rtol=1.6e-2)
