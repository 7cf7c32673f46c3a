"""Builds paged-attention inputs for tests: random KV pages behind shuffled block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc


def make_batch(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    *,
    kv: torch.Tensor | None = None,
    seed: int = 0,
) -> PagedBatch:
    """seqs: (query_len, cached_context_len) per sequence; seq_len = their sum.

    Block ids are a random permutation (non-contiguous, out of order) and unused block-table
    tail entries hold valid but unrelated ids. `kv`, if given, is a [num_blocks, 2, block_size,
    num_kv_heads, head_dim] buffer whose K/V halves become the (strided) caches; only the pages
    the batch uses are filled, so it may be huge and mostly untouched (virtual) memory."""
    g = torch.Generator().manual_seed(seed)
    lens = [n + c for n, c in seqs]
    pages = [-(-n // block_size) for n in lens]
    if kv is None:
        kv = torch.empty(sum(pages) + 5, 2, block_size, num_kv_heads, head_dim, dtype=dtype)
        kv.copy_(torch.randn(kv.shape, generator=g))  # fill everything: unused pages hold noise
    num_blocks = kv.shape[0]
    # Use the highest ids first, so that a huge `kv` exercises large block offsets.
    ids = num_blocks - 1 - torch.randperm(min(num_blocks, 4 * sum(pages) + 8), generator=g)[: sum(pages)]
    tables = torch.randint(0, num_blocks, (len(seqs), max(pages, default=1)), generator=g, dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages):
        tables[i, :n] = ids[start : start + n].to(torch.int32)
        start += n
    kv[ids.to(kv.device)] = torch.randn(len(ids), *kv.shape[1:], generator=g).to(kv.device, kv.dtype)
    kv = kv.to(DEVICE)  # whole, so the K/V halves keep their interleaved strides on a GPU too
    q = torch.randn(sum(n for n, _ in seqs), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor([n for n, _ in seqs], dtype=torch.int32).cumsum(0)
    return PagedBatch(
        q.to(DEVICE),
        kv[:, 0],
        kv[:, 1],
        tables.to(DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        qsl.to(DEVICE),
    )


def to_token_pairs(k_cache: torch.Tensor) -> torch.Tensor:
    """A row-layout K cache [blocks, 16, kvh, d] in token pairs [blocks, kvh, d / 2, 16, 2]
    (kernels/cpu_native.py k_cache_shape), contiguous."""
    nb, bs, kvh, d = k_cache.shape
    return k_cache.reshape(nb, bs, kvh, d // 2, 2).permute(0, 2, 3, 1, 4).contiguous()
