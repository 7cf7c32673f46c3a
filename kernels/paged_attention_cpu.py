"""Paged attention for CPUs: the torch backend's op, with `paged_attention_ref`'s layout and result.

The ref gathers every decode sequence's blocks into a padded [B, kv_heads, L, d] copy per layer
(and upcasts it); on a CPU that copy costs more than the attention itself. Here decodes read the
cache in place, as one sparse problem over all decode rows:
    scores = sampled_addmm(rows x cache rows)   one dot per (query head, key) pair, no K copy
    p      = softmax(scores)                    fp32, on a [B, h, L] view of the scores
    out    = embedding_bag(cache rows, p)       weighted sum of V rows, no V copy
where a "cache row" is one (slot, kv head) vector of head_dim values: the caches are viewed as
[rows, head_dim] matrices, so the column index of (query head h, key t of sequence b) is
block_table[b, t // bs] * rows_per_block + (t % bs) * kv_heads + h // group.

Both torch kernels exist on CPU for float32/float64 only; other dtypes (and cache layouts whose
head vectors are not packed rows) take the gather path: only the blocks in use, copied once,
upcast to fp32, through SDPA on strided views. Prefill chunks go one sequence at a time through
SDPA (is_causal when the chunk is the whole sequence, an offset causal mask after a prefix).

An fp8 (e4m3) cache takes the gather path too (its rows are upcast as they are copied); its
k_scale folds into the softmax scale and v_scale multiplies the output, so caches of any other
dtype pay two float comparisons for it.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from pagebus.kernels.fp8 import is_fp8, widen
from pagebus.kernels.paged_attention import paged_attention_ref

# torch warns once per process that sparse CSR tensors are "beta" (the two kernels used here are
# plain ones): spend that warning here, silenced, rather than in the first step.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.sparse_csr_tensor(
        torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(1)
    )

_SPARSE_DTYPES = (torch.float32, torch.float64)


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    seq_lens_host: list[int] | None = None,
    query_start_loc_host: list[int] | None = None,
    memo: dict[str, Any] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """`paged_attention_ref` for CPU tensors.

    max_query_len: an upper bound on the query lengths; 1 (a decode-only step) skips looking for
        prefill chunks.
    max_seq_len: an upper bound on seq_lens; without seq_lens_host it sizes the decode rows
        without reading the lengths on the host.
    seq_lens_host, query_start_loc_host: the same values as host lists, so the op need not read
        the tensors back.
    memo: the step's scratch (ForwardBatch.step_cache): what depends on the batch alone (the
        decode buckets, the sparse pattern's indices, the padding mask) is built by the first
        layer and reused by the others, which then run four kernels each.
    k_scale, v_scale: an fp8 cache's scales (kernels/fp8.py)."""
    if k_scale != 1.0 or v_scale != 1.0:
        out = paged_attention_cpu(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale * k_scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len, seq_lens_host=seq_lens_host,
            query_start_loc_host=query_start_loc_host, memo=memo,
        )  # fmt: skip
        return out.mul_(v_scale)
    if q.device.type != "cpu":  # the torch backend on an accelerator: the ref's batched SDPA
        return paged_attention_ref(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
            seq_lens_host=seq_lens_host, query_start_loc_host=query_start_loc_host,
        )  # fmt: skip
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} vs caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)}")
    starts = query_start_loc_host if query_start_loc_host is not None else query_start_loc.tolist()
    num_seqs = len(starts) - 1
    if max_query_len == 1:
        decode = [i for i in range(num_seqs) if starts[i + 1] > starts[i]]
        prefill: list[int] = []
    else:
        qlens = [b - a for a, b in itertools.pairwise(starts)]
        decode = [i for i, n in enumerate(qlens) if n == 1]
        prefill = [i for i, n in enumerate(qlens) if n > 1]
    lens = seq_lens_host
    if lens is None and (prefill or not max_seq_len):
        lens = seq_lens.tolist()
    memo = {} if memo is None else memo
    buckets = memo.get("decode_buckets")
    if buckets is None:
        buckets = memo["decode_buckets"] = _buckets(decode, lens, max_seq_len) if decode else []
    if decode and not prefill and len(decode) == num_seqs == num_tokens and len(buckets) == 1:
        # token i is sequence i's query, all in one batch: no gather, no scatter
        return _decode(q, k_cache, v_cache, block_tables, seq_lens, buckets[0][1], lens, scale, memo, "all")
    out = torch.empty_like(q)
    for b, (rows, width) in enumerate(buckets):
        key = f"bucket{b}"
        if key not in memo:
            memo[key] = (torch.tensor(rows), torch.tensor([starts[i] for i in rows]))
        idx, tok = memo[key]
        sub_lens = None if lens is None else [lens[i] for i in rows]
        o = _decode(
            q.index_select(0, tok), k_cache, v_cache, block_tables.index_select(0, idx),
            seq_lens.index_select(0, idx), width, sub_lens, scale, memo, key,
        )  # fmt: skip
        out.index_copy_(0, tok, o)
    for i in prefill:
        assert lens is not None
        a, b = starts[i], starts[i + 1]
        out[a:b] = _prefill(q[a:b], k_cache, v_cache, block_tables[i], lens[i], scale)
    return out


def _buckets(rows: list[int], lens: list[int] | None, max_seq_len: int | None) -> list[tuple[list[int], int]]:
    """Decode rows grouped so that padding each group to its longest row at most doubles its
    work: (rows, width) per group. Without host lengths, one group as wide as max_seq_len."""
    if lens is None:
        return [(rows, int(max_seq_len or 0))]
    order = sorted(rows, key=lambda i: -lens[i])
    groups: list[tuple[list[int], int]] = []
    for i in order:
        if groups and 2 * lens[i] > groups[-1][1]:
            groups[-1][0].append(i)
        else:
            groups.append(([i], lens[i]))
    if len(groups) == 1:
        return [(rows, groups[0][1])]  # keep the caller's order: it may need no gather at all
    return groups


def _rows_view(cache: torch.Tensor) -> torch.Tensor | None:
    """The cache as a [rows, head_dim] matrix over its storage (one row per slot and KV head),
    or None when its head vectors are not rows of such a matrix."""
    num_blocks, bs, kvh, d = cache.shape
    s0, s1, s2, s3 = cache.stride()
    if s3 != 1 or s2 != d or s1 % d or s0 % d:
        return None
    last = (num_blocks - 1) * s0 + (bs - 1) * s1 + (kvh - 1) * s2  # offset of the last row
    return cache.as_strided((last // d + 1, d), (d, 1))


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens_t: torch.Tensor,
    width: int,
    lens: list[int] | None,
    scale: float,
    memo: dict[str, Any],
    key: str,
) -> torch.Tensor:
    """q [B, h, d], one query per sequence at its last position, keys 0 .. len - 1 <= width - 1
    -> [B, h, d]. `memo[key]` keeps the sparse pattern of these rows for the step's next layers."""
    width = min(width, tables.shape[1] * k_cache.shape[1])  # no sequence outgrows its table
    k_rows = _rows_view(k_cache) if q.dtype in _SPARSE_DTYPES and k_cache.dtype == q.dtype else None
    v_rows = _rows_view(v_cache) if k_rows is not None and v_cache.dtype == q.dtype else None
    if k_rows is None or v_rows is None or k_cache.stride() != v_cache.stride():
        return _decode_gathered(q, k_cache, v_cache, tables, lens_t, width, scale)
    padded = lens is None or any(n != width for n in lens)
    pattern_key = (key, k_cache.shape, k_cache.stride(), q.shape[1], q.dtype)
    pattern = memo.get(f"{key}_pattern")
    if pattern is None or pattern[0] != pattern_key:  # first layer, or another cache layout
        pattern = (pattern_key, _decode_pattern(q, k_cache, k_rows, tables, lens_t, width, padded))
        memo[f"{key}_pattern"] = pattern
    return _decode_in_place(q, k_rows, v_rows, pattern[1], scale)


class _DecodePattern(NamedTuple):
    """Which cache rows each (sequence, query head) attends to: all the per-layer sparse
    attention needs besides q and the caches."""

    csr: torch.Tensor  # [B * h, cache rows] CSR, zero values: the keys' positions in k_rows
    cols: torch.Tensor  # [B * h, width] the same column indices, as bags for embedding_bag
    pad: torch.Tensor | None  # [B, 1, width] True past a row's length (scores -> -inf)
    shape: tuple[int, int, int]  # (B, h, width)


def _decode_pattern(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    k_rows: torch.Tensor,
    tables: torch.Tensor,
    lens_t: torch.Tensor,
    width: int,
    padded: bool,
) -> _DecodePattern:
    num_seqs, num_heads, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    s0, s1, s2, _ = (s // d for s in k_cache.stride())
    pos = torch.arange(width)
    # Keys past a row's length repeat its last key (a slot it has written: finite values); their
    # scores are masked to -inf, so they weigh exactly 0.
    pos_c = torch.minimum(pos, lens_t.long().unsqueeze(1) - 1) if padded else pos.expand(num_seqs, width)
    key_rows = tables.long().gather(1, pos_c.div(bs, rounding_mode="floor")).mul_(s0).add_(pos_c % bs * s1)
    head_off = torch.arange(num_heads).div_(num_heads // kvh, rounding_mode="floor").mul_(s2)
    cols = (key_rows.unsqueeze(1) + head_off.unsqueeze(1)).view(-1)  # [B, h, width]: cache rows
    num_rows = num_seqs * num_heads
    csr = torch.sparse_csr_tensor(
        torch.arange(0, num_rows * width + 1, width),
        cols,
        torch.zeros(cols.shape[0], dtype=q.dtype),
        size=(num_rows, k_rows.shape[0]),
        check_invariants=False,  # valid by construction; the check costs a pass over the indices
    )
    pad = (pos >= lens_t.unsqueeze(1)).unsqueeze(1) if padded else None
    return _DecodePattern(csr, cols.view(num_rows, width), pad, (num_seqs, num_heads, width))


def _decode_in_place(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, pattern: _DecodePattern, scale: float
) -> torch.Tensor:
    num_seqs, num_heads, width = pattern.shape
    num_rows, d = num_seqs * num_heads, q.shape[2]
    # beta=0 still reads the pattern's values (0 * x): they are zeros, never written.
    scores = torch.sparse.sampled_addmm(
        pattern.csr, q.reshape(num_rows, d), k_rows.t(), beta=0.0, alpha=scale
    )
    s = scores.values().view(num_seqs, num_heads, width)
    if pattern.pad is not None:
        s.masked_fill_(pattern.pad, float("-inf"))
    p = s.softmax(-1)
    # Bags are the [B * h] rows of `cols`: each output row is sum_t p[t] * V[cols[t]].
    o = F.embedding_bag(pattern.cols, v_rows, mode="sum", per_sample_weights=p.view(num_rows, width))
    return o.view(num_seqs, num_heads, d)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The cache's blocks `blocks`; an fp8 cache's widened to float32 on the way."""
    out = cache.index_select(0, blocks)
    return widen(out) if is_fp8(out.dtype) else out


def _decode_gathered(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens_t: torch.Tensor,
    width: int,
    scale: float,
) -> torch.Tensor:
    """The fallback: copy the blocks in use once (padded to the longest row), attend in fp32."""
    num_seqs, _, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    nb = -(-width // bs)
    idx = tables[:, :nb].reshape(-1).long()
    # [B * nb, bs, kvh, d] -> [B, kvh, L, d] strided views: SDPA reads them without a copy.
    k, v = _gather(k_cache, idx), _gather(v_cache, idx)
    k = k.view(num_seqs, nb * bs, kvh, d).transpose(1, 2).float()
    v = v.view(num_seqs, nb * bs, kvh, d).transpose(1, 2).float()
    mask = (torch.arange(nb * bs) < lens_t.unsqueeze(1))[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2).float(), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.squeeze(2).to(q.dtype)


def _prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One sequence's chunk: q [qlen, h, d] at positions seq_len - qlen .. seq_len - 1."""
    qlen, _, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    idx = table[: -(-seq_len // bs)].long()
    k = _gather(k_cache, idx).view(-1, kvh, d)[:seq_len].transpose(0, 1)  # [kvh, n, d]
    v = _gather(v_cache, idx).view(-1, kvh, d)[:seq_len].transpose(0, 1)
    qt = q.transpose(0, 1)  # [h, qlen, d]
    if q.dtype not in _SPARSE_DTYPES or k.dtype != q.dtype:  # the ref's: fp32 products, softmax
        qt, k, v = qt.float(), k.float(), v.float()
    # A batch of one: SDPA runs its fused CPU (flash) kernel only on 4-d inputs; 3-d ones take the
    # unfused math path, 3-15x slower at this model's prefill shapes (fp32, 64-512 tokens).
    qt, k, v = qt.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if qlen == seq_len:  # no prefix: plain causal
        o = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query j sees keys 0 .. seq_len - qlen + j
        mask = torch.arange(seq_len) <= torch.arange(seq_len - qlen, seq_len).unsqueeze(1)
        o = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).to(q.dtype)
