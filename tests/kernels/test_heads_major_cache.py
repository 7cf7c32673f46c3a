"""KV caches stored heads-major (kernels/cpu_native.py new_kv_cache): [blocks, kv_heads,
block_size, head_dim] storage seen in the rows order. Every compiled op that writes or reads a
cache must give, on such a cache, bit for bit what it gives on the rows storage of the same
values: cache writes, decode and prefill attention, and the fused decode call."""

from __future__ import annotations

import pytest
import torch
from pagebus.kernels import cpu_native as native
from pagebus.workers.layers.rotary import build_cos_sin_cache

from tests.kernels.paged_batch import make_batch
from tests.kernels.test_paged_attention import DECODES, MIXED

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or native.available() is not None or not native.native_ops().tiles_built(),
    reason="the compiled CPU ops' vector build (AVX-512, or AVX2 with FMA)",
)
_F16 = native.available() is None and native.native_ops().f16_built()
CACHES = pytest.mark.parametrize(
    "cache_dtype",
    [torch.float32, pytest.param(torch.float16, marks=pytest.mark.skipif(not _F16, reason="needs F16C"))],
)
PREFILLS = [(40, 0), (17, 0), (16, 16), (2, 0), (1, 7)]


def _heads_major(rows: torch.Tensor) -> torch.Tensor:
    cache = native.new_kv_cache(tuple(rows.shape), rows.dtype, rows.device)
    _, bs, kvh, d = rows.shape
    assert cache.stride() == (kvh * bs * d, d, bs * d, 1)  # heads-major storage, rows order
    return cache.copy_(rows)


def test_new_kv_cache_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    for d in (64, 128):
        cache = native.new_kv_cache((5, 16, 3, d), torch.float32, cpu)
        assert cache.shape == (5, 16, 3, d) and cache.stride() == (48 * d, d, 16 * d, 1)
        assert not cache.any()
    # shapes and dtypes the torch fallbacks would read (they `view` a cache): rows storage
    for shape, dtype in [
        ((5, 16, 3, 32), torch.float32),
        ((5, 8, 3, 64), torch.float32),
        ((5, 16, 3, 64), torch.bfloat16),
        ((5, 3, 32, 16, 2), torch.bfloat16),
        ((0,), torch.float32),
    ]:
        assert native.new_kv_cache(shape, dtype, cpu).is_contiguous()
    monkeypatch.setenv("PAGEBUS_KV_HEADS_MAJOR", "0")
    assert native.new_kv_cache((5, 16, 3, 64), torch.float32, cpu).is_contiguous()


@CACHES
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("seqs", [DECODES, MIXED, PREFILLS], ids=["decodes", "mixed", "prefills"])
def test_write_and_attention_as_on_rows(
    seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype
) -> None:
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim)
    rows = [c.to(cache_dtype) for c in (batch.k_cache, batch.v_cache)]
    hm = [_heads_major(c) for c in rows]
    t = batch.q.shape[0]
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(t, num_kv_heads, head_dim, generator=g) for _ in range(2))
    # this step's tokens into slots of their sequences (a few refused: slot -1)
    slots = torch.randperm(rows[0].shape[0] * 16, generator=g)[:t]
    slots[::5] = -1
    for caches in (rows, hm):
        native.write_kv_cache(k, v, *caches, slots)
    assert torch.equal(hm[0], rows[0]) and torch.equal(hm[1], rows[1])
    tables = batch.args()[3:]
    max_q = max(n for n, _ in seqs)
    want = native.paged_attention(batch.q, *rows, *tables, 0.125, max_query_len=max_q)
    got = native.paged_attention(batch.q, *hm, *tables, 0.125, max_query_len=max_q)
    assert torch.equal(got, want)


@CACHES
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (8, 1)])
def test_fused_decode_attention_as_on_rows(
    num_heads: int, num_kv_heads: int, cache_dtype: torch.dtype
) -> None:
    d, bs = 64, 16
    batch = make_batch(DECODES, num_heads, num_kv_heads, d)
    rows = [c.to(cache_dtype) for c in (batch.k_cache, batch.v_cache)]
    hm = [_heads_major(c) for c in rows]
    t = len(DECODES)
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * d, generator=torch.Generator().manual_seed(2))
    positions = batch.seq_lens.long() - 1
    slots = batch.block_tables[torch.arange(t), positions // bs].long() * bs + positions % bs
    cos_sin = build_cos_sin_cache(d, 2048, 10000.0, None)
    tables = batch.args()[3:]
    outs = [
        native.qkv_decode_attention(
            qkv, num_heads, num_kv_heads, positions, cos_sin, *c, slots, *tables, 0.125
        )
        for c in (rows, hm)
    ]
    assert outs[0] is not None and outs[1] is not None
    assert torch.equal(outs[1], outs[0])
    assert torch.equal(hm[0], rows[0]) and torch.equal(hm[1], rows[1])
