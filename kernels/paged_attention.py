"""Paged attention over a block-table KV cache, for batches mixing decodes and prefill chunks.

Layout shared by every attention op:
    q:               [num_tokens, num_heads, head_dim]   sequences concatenated
    k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables:    [num_seqs, max_blocks_per_seq] int32 (unused tail entries: any valid id)
    seq_lens:        [num_seqs] int32, context length per sequence *including* this step's tokens
    query_start_loc: [num_seqs + 1] int32, prefix sums of the per-sequence query lengths
Query token i of a sequence with query length n sits at absolute position seq_len - n + i and
attends causally to keys 0..that position. GQA: head h reads KV head h // (num_heads // num_kv_heads).
An fp8 (e4m3) cache holds K / k_scale and V / v_scale (kernels/fp8.py): every op takes the two
per-tensor floats, folds k_scale into the softmax scale and multiplies the output by v_scale.

The Triton path is one kernel for decodes and prefill chunks alike. A program owns a tile of
BLOCK_M rows = BLOCK_Q query tokens x the (padded) query-head group of one KV head, so each K/V
tile is loaded once per group, and walks its KV range with an online softmax (FlashAttention-2).
With num_splits > 1 the KV range is also split across programs (flash-decoding) and a second
kernel merges the partial results by their log-sum-exp; that pays off when there are too few
tiles to fill the GPU, i.e. small decode batches with long contexts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from pagebus.kernels._cast import cast_rtne
from pagebus.kernels.fp8 import is_fp8

_LOG2E = 1.4426950408889634


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
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    seq_lens_host: list[int] | None = None,
    query_start_loc_host: list[int] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The spec, and the CPU path: decodes go through one padded batched SDPA, prefill chunks
    one by one (they are few and large, so the loop costs nothing). Softmax runs in fp32.

    seq_lens_host / query_start_loc_host: host copies of the two tensors; when given, neither
    tensor is read back. max_query_len / max_seq_len complete the launchers' common signature;
    this path derives both from the per-sequence lengths it needs anyway. k_scale / v_scale: an
    fp8 cache's scales, applied to the values read (dequantize, then attend)."""
    if k_scale != 1.0 or v_scale != 1.0:
        k_cache, v_cache = k_cache.float() * k_scale, v_cache.float() * v_scale
    out = torch.empty_like(q)
    starts = query_start_loc.tolist() if query_start_loc_host is None else query_start_loc_host
    lens = seq_lens.tolist() if seq_lens_host is None else seq_lens_host
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
        pos_q = torch.arange(n - qlen, n, device=q.device).unsqueeze(1)
        mask = torch.arange(n, device=q.device).unsqueeze(0) <= pos_q  # [qlen, n]
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
    dev = q.device  # the mask must live with q/k/v, or SDPA refuses CUDA inputs
    idx = torch.tensor(rows, device=dev)
    ctx = torch.tensor([lens[i] for i in rows], device=dev)
    max_len = max(lens[i] for i in rows)
    nblocks = (max_len + block_size - 1) // block_size
    tables = block_tables[idx, :nblocks].long()  # [B, nblocks]
    # [B, nblocks, bs, kvh, d] -> [B, kvh, L, d]
    k = k_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    v = v_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    tok = torch.tensor([starts[i] for i in rows], device=dev)
    qb = q[tok].unsqueeze(2)  # [B, h, 1, d]
    mask = (torch.arange(max_len, device=dev).unsqueeze(0) < ctx.unsqueeze(1))[:, None, None, :]
    o = F.scaled_dot_product_attention(
        qb.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=True
    )
    out[tok] = o.squeeze(2).to(q.dtype)


@dataclass(frozen=True)
class PagedAttentionOptions:
    """Tiling knobs of the Triton path; None picks a heuristic. For tests and tuning, not models."""

    num_splits: int | None = None  # KV splits per tile (flash-decoding); 1 skips the merge kernel
    block_m: int | None = None  # rows per tile (query tokens x padded GQA group), power of two >= 16
    block_n: int | None = None  # keys per inner step, power of two >= 16 (may span several pages)
    num_warps: int | None = None
    # "fp32": K/V upcast after the load, dots in tf32 (ieee for fp32 caches). "native": fp16/bf16
    # operands straight into the tensor cores, fp32 accumulation, P rounded to the cache dtype
    # (FlashAttention's choice). None: native on CUDA for fp16/bf16 caches. The interpreter's bf16
    # arithmetic is wrong, so off a GPU it is always fp32.
    dot_operands: str | None = None

    def __post_init__(self) -> None:
        if self.dot_operands not in (None, "fp32", "native"):
            raise ValueError(f"dot_operands={self.dot_operands!r} must be 'fp32' or 'native'")
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v is not None and (v < 16 or v & (v - 1)):
                raise ValueError(f"{name}={v} must be a power of two >= 16 (tl.dot's minimum)")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits={self.num_splits} must be >= 1")


@dataclass(frozen=True)
class _Tiling:
    block_m: int
    block_n: int
    num_warps: int
    group_pad: int
    head_pad: int


def _tiling(
    opts: PagedAttentionOptions,
    group: int,
    head_dim: int,
    max_query_len: int,
    on_gpu: bool,
    fp32: bool,
    native: bool = False,
) -> _Tiling:
    group_pad = triton.next_power_of_2(group)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    # tl.dot needs >= 16 rows on a GPU: pad the head group with more query tokens, or dead rows.
    block_m = opts.block_m or (16 if max_query_len * group_pad <= 16 else 64)
    block_m = max(block_m, group_pad, 16)
    # Wider KV steps amortise the interpreter's per-op cost; on a GPU the fp32 tiles cost
    # registers: these are the widest that ptxas compiles for sm_90 without spills at head_dim
    # 128 (tests/kernels/aot_sm90.py); full-precision fp32 dots need the most.
    block_n = opts.block_n or (64 if not on_gpu or head_pad < 128 else 16 if fp32 else 32)
    num_warps = opts.num_warps or (8 if block_m >= 64 and on_gpu else 4)
    return _Tiling(block_m, block_n, num_warps, group_pad, head_pad)


@triton.jit
def _paged_attn_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    cu_qtiles_ptr,  # [num_seqs + 1] prefix sums of query tiles per sequence
    out_ptr,  # [num_tokens, num_heads, head_dim], written when NUM_SPLITS == 1
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] fp32, when NUM_SPLITS > 1
    part_ml_ptr,  # [num_tokens, num_heads, NUM_SPLITS, 2] fp32 (running max, sum of exp)
    num_seqs,
    scale_log2,  # softmax scale * log2(e) (* k_scale for an fp8 cache): the kernel uses exp2
    v_scale,  # fp8 caches: the output's factor
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NATIVE_DOT: tl.constexpr,  # fp16/bf16 operands into tl.dot (GPU only), else fp32
    KV_FP8: tl.constexpr,  # e4m3 caches: K/V widened to q's dtype (exact) right after the load
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # The grid over-provisions tiles (it is sized without reading seq lengths back to the host).
    if tile >= tl.load(cu_qtiles_ptr + num_seqs):
        return
    # Binary search: the last sequence whose first tile is <= this one (empty ones are skipped).
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(cu_qtiles_ptr + mid) <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_before = seq_len - q_len  # keys cached before this step's queries
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    q_lo = (tile - tl.load(cu_qtiles_ptr + seq)) * BLOCK_Q

    rows = tl.arange(0, BLOCK_M)
    qi = q_lo + rows // GROUP_PAD  # query index within the sequence
    head = kvh * GROUP + rows % GROUP_PAD
    row_ok = (qi < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = ctx_before + qi  # absolute position: the last key this row may see
    tok = (q_start + qi).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    q_off = tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    # [BLOCK_M, HEAD_PAD]; upcast right after the load: bf16 arithmetic is wrong under the interpreter.
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if NATIVE_DOT and not KV_FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)
    elif not NATIVE_DOT:
        q = q.to(tl.float32)

    # This split's KV range, in whole BLOCK_N steps, cut at the tile's causal horizon.
    steps_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    kv_lo = split * steps_per_split * BLOCK_N
    kv_hi = tl.minimum(kv_lo + steps_per_split * BLOCK_N, seq_len)
    kv_hi = tl.minimum(kv_hi, ctx_before + tl.minimum(q_lo + BLOCK_Q, q_len))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt  # type: ignore[attr-defined]  # a Triton scalar, not the int `lo = 0` suggests
    for start in range(kv_lo, kv_hi, BLOCK_N):
        kv = start + tl.arange(0, BLOCK_N)
        kv_ok = kv < kv_hi  # also keeps the block-table read inside this sequence's row
        # int64: page * stride_kb overflows int32 once the cache has > 2**31 / stride_kb blocks.
        page = tl.load(bt_row + kv // PAGE_SIZE, mask=kv_ok, other=0).to(tl.int64)
        in_page = kv % PAGE_SIZE
        k_off = page[None, :] * stride_kb + in_page[None, :] * stride_kt + kvh * stride_kh + d[:, None]
        k = tl.load(k_cache_ptr + k_off, mask=d_ok[:, None] & kv_ok[None, :], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        if not NATIVE_DOT:
            k = k.to(tl.float32)
        # Scale after the dot, not into q: fp16/bf16 q stays exact in tf32.
        if NATIVE_DOT:
            s = tl.dot(q, k) * scale_log2  # [BLOCK_M, BLOCK_N], log2 units, fp32 accumulation
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        s = tl.where((kv[None, :] <= q_pos[:, None]) & kv_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps max -inf; exp2(-inf - -inf) would be NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = page[:, None] * stride_vb + in_page[:, None] * stride_vt + kvh * stride_vh + d[None, :]
        v = tl.load(v_cache_ptr + v_off, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        if NATIVE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
        m_i = m_new

    if KV_FP8:
        acc = acc * v_scale  # linear: partials may carry it into the merge
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_off = tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(
            out_ptr + o_off, cast_rtne(o, out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :]
        )
    else:
        # Unnormalised partials; an empty split stores (m=-inf, l=0, acc=0) and weighs nothing.
        part = (tok * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS + split  # [BLOCK_M] int64
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] fp32
    part_ml_ptr,  # [num_tokens, num_heads, NUM_SPLITS, 2] fp32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_start_loc_ptr,
    num_seqs,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    # Padding tokens past the last sequence have no partials; leave their output alone.
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        return
    h = tl.arange(0, HEADS_PAD)
    h_ok = h < num_heads
    d = tl.arange(0, HEAD_PAD)
    base = (tok * num_heads + h) * NUM_SPLITS  # [HEADS_PAD] int64
    m = tl.full([HEADS_PAD], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(part_ml_ptr + (base + s) * 2, mask=h_ok, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.zeros([HEADS_PAD], tl.float32)
    acc = tl.zeros([HEADS_PAD, HEAD_PAD], tl.float32)
    for s in range(NUM_SPLITS):
        w = tl.exp2(tl.load(part_ml_ptr + (base + s) * 2, mask=h_ok, other=float("-inf")) - m)
        l_sum += w * tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=h_ok, other=0.0)
        a_off = (base + s)[:, None] * HEAD_PAD + d[None, :]
        acc += w[:, None] * tl.load(part_acc_ptr + a_off, mask=h_ok[:, None], other=0.0)
    o = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    o_off = tok * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(
        out_ptr + o_off, cast_rtne(o, out_ptr.dtype.element_ty), mask=h_ok[:, None] & (d < HEAD_DIM)[None, :]
    )


def _pick_num_splits(programs: int, part_bytes_per_split: int, device: torch.device) -> int:
    """Split the KV range only while the tiles alone leave SMs idle (and the partials stay small)."""
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one: splitting only adds the merge pass
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    splits = 1
    while splits < 16 and programs * splits < target and part_bytes_per_split * splits * 2 <= 256 << 20:
        splits *= 2
    return splits


def paged_attention(
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
    out: torch.Tensor | None = None,
    options: PagedAttentionOptions | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Triton version of `paged_attention_ref` (same layout and result).

    max_query_len: an upper bound on the query lengths (the tighter, the smaller the tiles) avoids a
        device-to-host read, so the call can be captured in a CUDA graph. An underestimate
        leaves query tiles out, silently. Without it, query_start_loc_host gives it, else it
        is read back from the device.
    max_seq_len: an upper bound on seq_lens (e.g. max_model_len under a CUDA graph); it caps the
        KV splits so short contexts do not launch empty ones. seq_lens_host gives it when absent.
    seq_lens_host / query_start_loc_host: host copies of those tensors (the kernel itself only
        reads the device tensors).
    out: [num_tokens, num_heads, head_dim] buffer to write into; rows past the last sequence
        (padding tokens) are left untouched.
    k_scale / v_scale: an fp8 cache's scales (ignored for other cache dtypes)."""
    opts = options or PagedAttentionOptions()
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, kv_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or kv_dim != head_dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} vs q {tuple(q.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache need a contiguous head_dim")
    out = torch.empty_like(q) if out is None else out
    if out.stride(-1) != 1:
        raise ValueError("out needs a contiguous head_dim")
    num_seqs = seq_lens.shape[0]
    if max_query_len is None and query_start_loc_host is not None:
        max_query_len = max((b - a for a, b in itertools.pairwise(query_start_loc_host)), default=0)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    if max_seq_len is None and seq_lens_host is not None:
        max_seq_len = max(seq_lens_host, default=0)
    if num_tokens == 0 or max_query_len == 0:
        return out
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()

    group = num_heads // num_kv_heads
    # An fp32 operand on either side needs full-precision products: tf32 (and a native 16-bit
    # dot) would round an fp32 q to 10 mantissa bits.
    fp32 = k_cache.dtype == torch.float32 or q.dtype == torch.float32
    kv_fp8 = is_fp8(k_cache.dtype)
    if not kv_fp8:
        k_scale = v_scale = 1.0
    on_gpu = q.device.type == "cuda"
    native = on_gpu and not fp32 and (opts.dot_operands or "native") == "native"
    t = _tiling(opts, group, head_dim, max_query_len, on_gpu, fp32, native)
    block_q = t.block_m // t.group_pad

    # Tiles per sequence, as prefix sums on the device (no host sync): [num_seqs + 1] int32.
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    cu_qtiles = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(torch.div(q_lens + block_q - 1, block_q, rounding_mode="floor"), 0, out=cu_qtiles[1:])
    # Upper bound on the tile count: partial tiles add at most one per sequence.
    num_qtiles = min(
        triton.cdiv(num_tokens, block_q) + num_seqs, num_seqs * triton.cdiv(max_query_len, block_q)
    )

    part_bytes = num_tokens * num_heads * (t.head_pad + 2) * 4
    splits = opts.num_splits or _pick_num_splits(num_qtiles * num_kv_heads, part_bytes, q.device)
    if opts.num_splits is None and max_seq_len is not None:
        # A split owns whole BLOCK_N steps: more splits than steps would only run empty.
        splits = min(splits, triton.next_power_of_2(max(1, triton.cdiv(max_seq_len, t.block_n))))
    if splits > 1:
        part_acc = torch.empty(
            num_tokens, num_heads, splits, t.head_pad, dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(num_tokens, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused by the kernel
    _paged_attn_kernel[(num_qtiles, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, cu_qtiles, out, part_acc, part_ml,
        num_seqs, scale * k_scale * _LOG2E, float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_PAD=t.head_pad, GROUP=group, GROUP_PAD=t.group_pad,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, PAGE_SIZE=page_size, NUM_SPLITS=splits,
        # fp16/bf16 values are exact in tf32; an fp32 q or cache needs full-precision products.
        DOT_PRECISION="ieee" if fp32 else "tf32",
        NATIVE_DOT=native, KV_FP8=kv_fp8,
        num_warps=t.num_warps,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(num_tokens,)](
            part_acc, part_ml, out, query_start_loc, num_seqs, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=t.head_pad, HEADS_PAD=triton.next_power_of_2(num_heads),
            NUM_SPLITS=splits,
        )  # fmt: skip
    return out
