"""Paged attention over a block-table KV cache, for batches mixing decodes and prefill chunks.

Layout shared by every attention op:
    q:               [num_tokens, num_heads, head_dim]   sequences concatenated
    k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables:    [num_seqs, max_blocks_per_seq] int32 (unused tail entries: any valid id)
    seq_lens:        [num_seqs] int32, context length per sequence *including* this step's tokens
    query_start_loc: [num_seqs + 1] int32, prefix sums of the per-sequence query lengths
Query token i of a sequence with query length n sits at absolute position seq_len - n + i and
attends causally to keys 0..that position. GQA: head h reads KV head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, num_kv_heads, head_dim] of one sequence, read through its block table."""
    block_size = cache.shape[1]
    nblocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:nblocks].long()]  # [nblocks, block_size, kvh, d]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The spec, and the CPU path: decodes go through one padded batched SDPA, prefill chunks
    one by one (they are few and large, so the loop costs nothing). Softmax runs in fp32."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    qlens = [b - a for a, b in itertools.pairwise(starts)]
    decode = [i for i, n in enumerate(qlens) if n == 1]
    prefill = [i for i, n in enumerate(qlens) if n > 1]
    if decode:
        _decode_batch(q, k_cache, v_cache, block_tables, lens, starts, decode, scale, out)
    for i in prefill:
        a, b, n = starts[i], starts[i + 1], lens[i]
        k = _gather_kv(k_cache, block_tables[i], n).transpose(0, 1)  # [kvh, n, d]
        v = _gather_kv(v_cache, block_tables[i], n).transpose(0, 1)
        qi = q[a:b].transpose(0, 1)  # [h, qlen, d]
        qlen = b - a
        # causal with an offset: query j sees keys 0 .. n - qlen + j
        pos_q = torch.arange(n - qlen, n).unsqueeze(1)
        mask = torch.arange(n).unsqueeze(0) <= pos_q  # [qlen, n]
        o = F.scaled_dot_product_attention(
            qi.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[a:b] = o.transpose(0, 1).to(q.dtype)
    return out


def _decode_batch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: list[int],
    starts: list[int],
    rows: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    block_size = k_cache.shape[1]
    idx = torch.tensor(rows)
    ctx = torch.tensor([lens[i] for i in rows])
    max_len = int(ctx.max())
    nblocks = (max_len + block_size - 1) // block_size
    tables = block_tables[idx, :nblocks].long()  # [B, nblocks]
    # [B, nblocks, bs, kvh, d] -> [B, kvh, L, d]
    k = k_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    v = v_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    tok = torch.tensor([starts[i] for i in rows])
    qb = q[tok].unsqueeze(2)  # [B, h, 1, d]
    mask = (torch.arange(max_len).unsqueeze(0) < ctx.unsqueeze(1))[:, None, None, :]
    o = F.scaled_dot_product_attention(
        qb.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=True
    )
    out[tok] = o.squeeze(2).to(q.dtype)
