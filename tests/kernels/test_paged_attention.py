"""paged_attention (Triton) against paged_attention_ref, on the interpreter or a GPU."""

from __future__ import annotations

import pytest
import torch
from pagebus.kernels.paged_attention import PagedAttentionOptions, paged_attention, paged_attention_ref

from tests.kernels.paged_batch import DEVICE, make_batch

MIXED = [(1, 1328), (5, 18), (129, 463)]  # (query_len, cached context): decode + prefill chunks
DECODES = [(1, 0), (1, 15), (1, 16), (1, 17), (1, 64), (1, 333)]  # lengths 1, 16, 17, 65, ...
# bf16 results differ by an ulp of bf16 after the fp32 math; fp16 by an ulp of fp16.
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


def _check(batch, scale: float = 0.125, **kwargs) -> None:
    out = paged_attention(*batch.args(), scale, **kwargs)
    ref = paged_attention_ref(*batch.args(), scale)
    torch.testing.assert_close(out, ref, **TOL[batch.q.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 1)])  # GQA 1, 3, 8
def test_mixed_batch(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    _check(make_batch(MIXED, num_heads, num_kv_heads, 64, dtype=dtype))


@pytest.mark.parametrize("num_splits", [1, 4, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_only(num_splits: int, dtype: torch.dtype) -> None:
    """Lengths 1, exact block multiples and not; split-K with a merge pass, also uneven splits."""
    batch = make_batch(DECODES, 8, 2, 64, dtype=dtype, seed=1)
    _check(batch, max_query_len=1, options=PagedAttentionOptions(num_splits=num_splits))


def test_mixed_batch_split_kv() -> None:
    """Split-K over prefill tiles too: splits past a tile's causal horizon are empty."""
    batch = make_batch([(1, 200), (40, 0), (17, 47), (1, 1)], 4, 1, 64, seed=2)
    _check(batch, options=PagedAttentionOptions(num_splits=4))


@pytest.mark.parametrize(("block_size", "block_n"), [(8, 16), (16, 64), (128, 32)])
def test_block_sizes(block_size: int, block_n: int) -> None:
    """A KV step spanning several pages, and a page spanning several KV steps."""
    batch = make_batch([(1, 150), (33, 100)], 4, 2, 64, block_size, seed=3)
    _check(batch, options=PagedAttentionOptions(block_n=block_n))


def test_prefill_without_context_and_small_tiles() -> None:
    """First chunks (no cached context), a sequence with no query this step, 16-row tiles."""
    batch = make_batch([(37, 0), (0, 20), (16, 16), (1, 5)], 3, 3, 64, seed=4)
    _check(batch, options=PagedAttentionOptions(block_m=16))


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(seed: int) -> None:
    """Random mixes of every knob: query lengths (0, 1, chunks), contexts, GQA ratio, page size,
    head_dim, dtype, tiling and splits."""
    g = torch.Generator().manual_seed(100 + seed)

    def pick(options: list):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    seqs = []
    for _ in range(int(torch.randint(1, 7, (1,), generator=g))):
        qlen = pick([0, 1, 1, int(torch.randint(2, 40, (1,), generator=g))])
        seqs.append((qlen, int(torch.randint(0 if qlen else 1, 300, (1,), generator=g))))
    if not any(n for n, _ in seqs):
        seqs.append((1, 7))
    num_kv_heads, group = pick([1, 2]), pick([1, 2, 3, 4, 8])
    dtype = pick([torch.float32, torch.float16, torch.bfloat16])
    batch = make_batch(
        seqs, num_kv_heads * group, num_kv_heads, pick([32, 64, 96]), pick([8, 16, 32]), dtype, seed=seed
    )
    opts = PagedAttentionOptions(
        num_splits=pick([1, 2, 5]), block_m=pick([None, 16, 32]), block_n=pick([16, 32, 64])
    )
    _check(batch, scale=0.2, options=opts)


def test_int64_metadata() -> None:
    batch = make_batch([(1, 20), (7, 9)], 4, 2, 64, seed=10)
    meta = (batch.block_tables.long(), batch.seq_lens.long(), batch.query_start_loc.long())
    args = (batch.q, batch.k_cache, batch.v_cache, *meta, 0.1)
    torch.testing.assert_close(paged_attention(*args), paged_attention_ref(*args), **TOL[torch.float32])


def test_head_dim_padding_and_out_buffer() -> None:
    """head_dim 80 pads to 128 lanes; padding tokens past the last sequence are left alone."""
    batch = make_batch([(3, 30), (1, 9)], 4, 2, 80, seed=5)
    out = torch.full((6, 4, 80), 7.0, device=DEVICE)  # 4 real tokens + 2 padding rows
    got = paged_attention(*batch.args(), 0.1, max_query_len=3, out=out)
    assert got is out
    torch.testing.assert_close(out[:4], paged_attention_ref(*batch.args(), 0.1), **TOL[torch.float32])
    assert bool((out[4:] == 7.0).all())


@pytest.mark.parametrize("num_splits", [1, 2])
def test_block_offsets_past_int32(num_splits: int) -> None:
    """block_id * stride_kb > 2**31 elements: catches int32 index overflow. The 4 GiB fp16
    buffer is allocated where the kernel runs; only the pages in use are touched (virtual
    memory on CPU)."""
    block_size, kvh, hd = 16, 2, 16
    per_block = 2 * block_size * kvh * hd  # K and V pages interleaved: stride_kb = 1024
    num_blocks = 2**31 // per_block + 64
    kv = torch.empty(num_blocks, 2, block_size, kvh, hd, dtype=torch.float16, device=DEVICE)
    batch = make_batch([(1, 40), (9, 23)], 4, kvh, hd, block_size, kv=kv, seed=6)
    assert int(batch.block_tables[:, 0].min()) * batch.k_cache.stride(0) > 2**31
    _check(batch, options=PagedAttentionOptions(num_splits=num_splits))


def test_bad_shapes_raise() -> None:
    batch = make_batch([(1, 3)], 6, 4, 64)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(*batch.args(), 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dot_operands", ["native", "fp32"])
def test_llama_shape_on_gpu(dtype: torch.dtype, dot_operands: str) -> None:
    """Llama-3-8B layer shape (32 heads, 8 KV heads, head_dim 128), heuristic tiling and splits,
    with 16-bit tensor-core operands and with K/V upcast to fp32."""
    g = torch.Generator().manual_seed(7)
    ctx = torch.randint(1, 4096, (64,), generator=g).tolist()
    seqs = [(1, c) for c in ctx[:60]] + [(n, c) for n, c in zip([512, 77, 300, 2], ctx[60:], strict=True)]
    opts = PagedAttentionOptions(dot_operands=dot_operands)
    for batch in (
        make_batch(seqs, 32, 8, 128, dtype=dtype, seed=8),
        make_batch([(1, c) for c in ctx[:8]], 32, 8, 128, dtype=dtype, seed=9),
    ):
        out = paged_attention(*batch.args(), 128**-0.5, options=opts)
        ref = paged_attention_ref(*batch.args(), 128**-0.5)
        torch.testing.assert_close(out, ref, **TOL[dtype])
        rel = float((out.float() - ref.float()).norm() / ref.float().norm())
        assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3), rel


def test_dot_operands_option_is_checked() -> None:
    with pytest.raises(ValueError, match="dot_operands"):
        PagedAttentionOptions(dot_operands="tf32")
