"""paged_attention_cpu (the torch backend's attention) against paged_attention_ref."""

from __future__ import annotations

import pytest
import torch
from pagebus.kernels.paged_attention import paged_attention_ref
from pagebus.kernels.paged_attention_cpu import paged_attention_cpu

from tests.kernels.paged_batch import PagedBatch, make_batch
from tests.kernels.test_paged_attention import DECODES, MIXED, TOL

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU op (it defers to the ref elsewhere)"
)


def _host(batch: PagedBatch) -> dict:
    return {"seq_lens_host": batch.seq_lens.tolist(), "query_start_loc_host": batch.query_start_loc.tolist()}


def _next_layer(batch: PagedBatch) -> PagedBatch:
    """The same step's next layer: its own q and caches (same shapes), the same metadata."""
    g = torch.Generator().manual_seed(99)
    fresh = [torch.randn(t.shape, generator=g).to(t.dtype) for t in (batch.q, batch.k_cache, batch.v_cache)]
    return PagedBatch(*fresh, batch.block_tables, batch.seq_lens, batch.query_start_loc)


def _check(batch: PagedBatch, scale: float = 0.125, **kwargs) -> None:
    ref = paged_attention_ref(*batch.args(), scale)
    for extra in ({}, _host(batch)):  # tensors read back, or the step's host lists
        got = paged_attention_cpu(*batch.args(), scale, **kwargs, **extra)
        torch.testing.assert_close(got, ref, **TOL[batch.q.dtype])
    # One memo for two layers of a step: the second reuses the first's pattern, not its values.
    memo: dict = {}
    layer2 = _next_layer(batch)
    for b in (batch, layer2, batch):
        got = paged_attention_cpu(*b.args(), scale, **kwargs, **_host(b), memo=memo)
        torch.testing.assert_close(got, paged_attention_ref(*b.args(), scale), **TOL[b.q.dtype])


def _contiguous(batch: PagedBatch) -> PagedBatch:
    """Separate contiguous K and V caches, as the runner allocates them (make_batch interleaves)."""
    batch.k_cache, batch.v_cache = batch.k_cache.contiguous(), batch.v_cache.contiguous()
    return batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 1), (9, 3)])
def test_mixed_batch(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    """A decode, a short chunk after a prefix and a long one: decodes in place, chunks one by one."""
    _check(make_batch(MIXED, num_heads, num_kv_heads, 64, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [False, True])
def test_decode_only(dtype: torch.dtype, contiguous: bool) -> None:
    """Lengths 1 .. 334 (exact block multiples and not): several length buckets, padded rows."""
    batch = make_batch(DECODES, 9, 3, 64, dtype=dtype, seed=1)
    batch = _contiguous(batch) if contiguous else batch
    _check(batch, max_query_len=1)


def test_decode_equal_lengths() -> None:
    """Every row as long as the longest: the scores need no padding mask."""
    _check(_contiguous(make_batch([(1, 40)] * 5, 9, 3, 64, seed=2)), max_query_len=1)


def test_decode_without_host_lengths() -> None:
    """max_seq_len (an upper bound, as under a CUDA graph) sizes the rows; no lengths on the host."""
    batch = make_batch([(1, 3), (1, 70), (1, 33)], 4, 2, 64, seed=3)
    ref = paged_attention_ref(*batch.args(), 0.2)
    for bound in (71, 96, 10_000):
        got = paged_attention_cpu(*batch.args(), 0.2, max_query_len=1, max_seq_len=bound)
        torch.testing.assert_close(got, ref, **TOL[torch.float32])


def test_decodes_among_chunks_and_empty_queries() -> None:
    """Decode rows gathered from between prefill chunks; a sequence with no query this step."""
    batch = make_batch([(37, 0), (1, 300), (0, 20), (16, 16), (1, 5), (1, 0)], 6, 2, 64, seed=4)
    _check(batch)


def test_prefill_without_context() -> None:
    """First chunks (the whole sequence so far): plain causal attention."""
    _check(_contiguous(make_batch([(37, 0), (16, 0), (100, 0)], 9, 3, 64, seed=5)))


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(block_size: int) -> None:
    _check(make_batch([(1, 150), (33, 100), (1, 7)], 4, 2, 64, block_size, seed=6))


def test_cache_rows_not_packed_take_the_gather_path() -> None:
    """A cache whose head vectors are padded (stride > head_dim) is no [rows, head_dim] matrix."""
    batch = make_batch([(1, 50), (1, 20), (5, 9)], 4, 2, 48, seed=7)
    wide = torch.zeros(*batch.k_cache.shape[:3], 64)
    wide_v = torch.zeros_like(wide)
    wide[..., :48], wide_v[..., :48] = batch.k_cache, batch.v_cache
    batch.k_cache, batch.v_cache = wide[..., :48], wide_v[..., :48]
    _check(batch)


def test_int64_metadata() -> None:
    batch = make_batch([(1, 20), (7, 9), (1, 1)], 4, 2, 64, seed=8)
    meta = (batch.block_tables.long(), batch.seq_lens.long(), batch.query_start_loc.long())
    args = (batch.q, batch.k_cache, batch.v_cache, *meta, 0.1)
    torch.testing.assert_close(paged_attention_cpu(*args), paged_attention_ref(*args), **TOL[torch.float32])


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(seed: int) -> None:
    """Random mixes: query lengths (0, 1, chunks), contexts, GQA ratio, page size, head_dim, dtype."""
    g = torch.Generator().manual_seed(200 + seed)

    def pick(options: list):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    seqs = []
    for _ in range(int(torch.randint(1, 9, (1,), generator=g))):
        qlen = pick([0, 1, 1, 1, int(torch.randint(2, 40, (1,), generator=g))])
        seqs.append((qlen, int(torch.randint(0 if qlen else 1, 300, (1,), generator=g))))
    if not any(n for n, _ in seqs):
        seqs.append((1, 7))
    num_kv_heads, group = pick([1, 2, 3]), pick([1, 2, 3, 4])
    dtype = pick([torch.float32, torch.float32, torch.float16, torch.bfloat16])
    batch = make_batch(
        seqs, num_kv_heads * group, num_kv_heads, pick([32, 64, 96]), pick([8, 16, 32]), dtype, seed=seed
    )
    _check(pick([batch, _contiguous(batch)]), scale=0.2)
