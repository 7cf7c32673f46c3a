"""The token-pairs K cache (kernels/cpu_native.py k_cache_shape): bf16 K blocks held as
[blocks, kv_heads, head_dim / 2, 16, 2] beside row-layout V, on AVX-512 BF16 builds.

Every op that reads or writes it must give what the row layout gives: writes land on the same
values, prefill (the pairs copied as its bf16 scores' own layout, or on AMX machines a gathered
row copy) is the row kernels' result exactly, decode (its
own score kernel, sums in another order) matches the reference within bf16's rounding. The fused
decode op on this layout is tested beside its row-layout case (test_cpu_native.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from pagebus.kernels import cpu_native as native
from pagebus.kernels.paged_attention import paged_attention_ref

from tests.kernels.paged_batch import make_batch, to_token_pairs
from tests.kernels.test_paged_attention import DECODES, MIXED

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ops"),
    pytest.mark.skipif(
        native.available() is not None or not native.native_ops().bf16_tiles_built(),
        reason="the token-pairs K cache is an AVX-512 BF16 build's",
    ),
]
BF16 = {"atol": 1.6e-2, "rtol": 1.6e-2}
PREFILLS = [(40, 0), (17, 0), (16, 16), (2, 0), (1, 7), (100, 37)]


def test_the_shape_is_pairs_only_for_bf16_16_token_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert native.k_cache_shape(10, 16, 3, 64, torch.bfloat16) == (10, 3, 32, 16, 2)
    assert native.k_cache_shape(10, 16, 3, 128, torch.bfloat16) == (10, 3, 64, 16, 2)
    assert native.k_cache_shape(10, 16, 3, 64, torch.float32) == (10, 16, 3, 64)
    assert native.k_cache_shape(10, 8, 3, 64, torch.bfloat16) == (10, 8, 3, 64)
    assert native.k_cache_shape(10, 16, 3, 32, torch.bfloat16) == (10, 16, 3, 32)
    monkeypatch.setenv("PAGEBUS_K_TOKEN_PAIRS", "0")
    assert native.k_cache_shape(10, 16, 3, 64, torch.bfloat16) == (10, 16, 3, 64)


def test_k_rows_undoes_the_layout() -> None:
    k = torch.randn(7, 16, 3, 64).to(torch.bfloat16)
    blocks = torch.tensor([4, 0, 6])
    assert torch.equal(native.k_rows(to_token_pairs(k), blocks), k[blocks])


def test_write_kv_puts_the_row_layouts_values() -> None:
    g = torch.Generator().manual_seed(0)
    k_rows = torch.randn(8, 16, 3, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(8, 16, 3, 64, generator=g).to(torch.bfloat16)
    k_pairs, v_pairs = to_token_pairs(k_rows), v.clone()
    key, value = torch.randn(5, 3, 64, generator=g).to(torch.bfloat16), torch.randn(5, 3, 64, generator=g)
    value = value.to(torch.bfloat16)
    slots = torch.tensor([3, -1, 17, 127, 64])
    native.write_kv_cache(key, value, k_rows, v, slots)
    native.write_kv_cache(key, value, k_pairs, v_pairs, slots)
    assert torch.equal(k_pairs, to_token_pairs(k_rows)) and torch.equal(v_pairs, v)
    with pytest.raises(RuntimeError, match="beyond the cache"):
        native.write_kv_cache(key[:1], value[:1], k_pairs, v_pairs, torch.tensor([128]))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (9, 3), (8, 1), (15, 5)])
@pytest.mark.parametrize("seqs", [DECODES, MIXED, PREFILLS], ids=["decodes", "mixed", "prefills"])
def test_attention(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    rest = batch.args()[3:]
    max_q = max(n for n, _ in seqs)
    k_pairs = to_token_pairs(batch.k_cache.contiguous())
    v = batch.v_cache.contiguous()
    rows = native.paged_attention(batch.q, batch.k_cache, batch.v_cache, *rest, scale, max_query_len=max_q)
    got = native.paged_attention(batch.q, k_pairs, v, *rest, scale, max_query_len=max_q)
    torch.testing.assert_close(got, paged_attention_ref(*batch.args(), scale), **BF16)
    prefill = torch.zeros(batch.q.shape[0], dtype=torch.bool)
    starts = batch.query_start_loc.tolist()
    for a, b in itertools.pairwise(starts):
        prefill[a:b] = b - a > 1
    assert torch.equal(got[prefill], rows[prefill])  # the row kernels' arithmetic exactly
    decode = ~prefill
    # Decode scores are summed in another order: within a bf16 ulp of the row kernel's.
    torch.testing.assert_close(got[decode], rows[decode], atol=8e-3, rtol=8e-3)


def test_the_torch_fallback_reads_a_gathered_copy() -> None:
    """A call the compiled attention does not take (int64 block tables) still reads the pairs."""
    batch = make_batch(MIXED, 9, 3, 64, dtype=torch.bfloat16)
    k_pairs, v = to_token_pairs(batch.k_cache.contiguous()), batch.v_cache.contiguous()
    tables = batch.block_tables.long()
    got = native.paged_attention(batch.q, k_pairs, v, tables, *batch.args()[4:], 0.125, max_query_len=129)
    torch.testing.assert_close(got, paged_attention_ref(*batch.args(), 0.125), **BF16)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_compiled_prefill_reads_the_pairs_in_place(head_dim: int) -> None:
    """Without AMX the compiled prefill takes the token-pairs cache itself, giving the row
    kernels' result exactly (results alone would not show a fall back to the gathered copy);
    on AMX machines it declines, and the gathered copy serves (test_attention)."""
    batch = make_batch(PREFILLS, 9, 3, head_dim, dtype=torch.bfloat16)
    k_pairs, v = to_token_pairs(batch.k_cache.contiguous()), batch.v_cache.contiguous()
    ops, scale = native.native_ops(), head_dim**-0.5
    got, rows = torch.zeros_like(batch.q), torch.zeros_like(batch.q)
    took = ops.prefill_attention(got, batch.q, k_pairs, v, *batch.args()[3:], scale)
    assert took is not ops.bf16_amx_in_use()
    if took:
        assert ops.prefill_attention(rows, *batch.args(), scale)
        assert torch.equal(got, rows)
