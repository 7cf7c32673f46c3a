"""The `cpu` backend: the torch backend's ops fused into one compiled call each (csrc/cpu_ops.cpp).

Why: on a CPU a decode step of a small model is mostly dispatch. SmolLM2-135M's step ran about
1,900 torch ops (64 a layer), at 3-5 us each on the machine this was written on, so the ops
around the matmuls cost 14-17 ms of a 60 ms single-stream step on one thread. Each function here
replaces a chain of them (RMSNorm with its residual add: 6 ops; rotary: 8; SiLU-and-mul: 3;
decode attention: 8 plus per-step index building) with one call.

What runs where: float32 and bfloat16 CPU tensors take the compiled ops (rms_norm,
add_rms_norm, silu_and_mul, rotary, write_kv, and attention for the sequences with one query
token; bf16 is computed in float32 and rounded where the refs round), over caches of their dtype
or, for float32, a float16 cache (`native_cache_dtypes`); float16 activations, an fp8 cache, or a
prefill chunk's attention takes the torch backend's function (kernels/*_cpu), which stays
the reference these are tested against (tests/kernels).

The extension is compiled once per machine with -O3 -march=native -fopenmp (torch's
cpp_extension and ninja); `make setup` builds it (`python -m pagebus.kernels.cpu_native`), and the module name
carries a digest of the CPU's flags, the source and its path, so a cache directory shared across
machine kinds or checkouts never serves a build for other instructions or another source, and
two checkouts never rebuild over each other. If it cannot be built, `select_ops` falls back to the
torch backend with a warning that says why.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from pagebus.kernels.activation import silu_and_mul_cpu
from pagebus.kernels.kv_cache_write import write_kv_cache_cpu
from pagebus.kernels.paged_attention_cpu import _prefill, paged_attention_cpu
from pagebus.kernels.rms_norm import rms_norm_cpu
from pagebus.kernels.rotary import rotary_embedding_cpu

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
_DTYPES = (torch.float32, torch.bfloat16)


def _native(*xs: torch.Tensor) -> bool:
    """CPU tensors of one dtype, float32 or bfloat16: the compiled ops' cases. (A plain loop:
    this runs several times a layer, and a generator costs more than the check.)"""
    dtype = xs[0].dtype
    if dtype not in _DTYPES:
        return False
    for x in xs:  # noqa: SIM110
        if x.dtype is not dtype or not x.is_cpu:
            return False
    return True


def native_cache_dtypes(x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Caches whose dtype the compiled ops read and write beside activations x (a dtype `_native`
    takes): x's dtype, or float16 beside float32 (--kv-cache-dtype float16: half the bytes a
    decode streams; F16C converts them) in 16-token blocks of head_dim 64 or 128 on a build with
    F16C."""
    dtype = k_cache.dtype
    if dtype is x.dtype:
        return v_cache.dtype is dtype and k_cache.is_cpu and v_cache.is_cpu
    return (
        dtype is torch.float16
        and v_cache.dtype is dtype
        and x.dtype is torch.float32
        and k_cache.is_cpu
        and v_cache.is_cpu
        and k_cache.dim() == 4
        and k_cache.shape[1] == 16
        and k_cache.shape[3] in (64, 128)
        and native_ops().f16_built()
    )


def native_attention_caches(x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Caches the compiled attention reads beside activations x: dtypes as for the cache write
    (`native_cache_dtypes`), laid out as rows of contiguous head vectors in one layout, or a
    token-pairs K cache beside a contiguous V cache (the compiled ops check the rest)."""
    if not native_cache_dtypes(x, k_cache, v_cache):
        return False
    if k_cache.dim() == 5:
        return k_cache.is_contiguous() and v_cache.is_contiguous()
    return k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()


@functools.cache
def _cpu_flags() -> str:
    """/proc/cpuinfo's flags line ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def build_digest() -> str:
    """The CPU's flags, the source and where it lies: machine kinds sharing one extension cache
    never load each other's build, and two checkouts never rebuild over each other (ninja's
    build file names the source's path, so one directory per checkout)."""
    key = _cpu_flags().encode() + _SOURCE.read_bytes() + str(_SOURCE.resolve()).encode()
    return hashlib.sha256(key).hexdigest()[:12]


@contextlib.contextmanager
def build_directory_for(name: str) -> Iterator[str]:
    """torch's extension cache directory for `name`, held for one build: a killed build leaves
    torch's `lock` file there, and torch's loader waits on one forever (an interrupted `make
    setup` hung the next one). Builds take an flock on a file beside it, which the kernel drops
    when its holder dies, so whoever holds the flock knows a `lock` inside is stale."""
    from torch.utils.cpp_extension import get_default_build_root

    d = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "pagebus-build.flock", "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's build of %s", name)
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = d / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield str(d)


def load_build(name: str, source: Path) -> Any:
    """Compile `source` (a cpu_ops.cpp) as the module `name`, or load the build already cached
    under that name; raises when the machine cannot build it (no compiler, no ninja)."""
    from torch.utils.cpp_extension import load

    with build_directory_for(name) as build_directory:
        return load(
            name=name,
            sources=[str(source)],
            build_directory=build_directory,
            # -fopenmp: at::parallel_for is inlined from ATen's headers as an OpenMP loop; without
            # the flag it compiles to a serial one.
            extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=os.environ.get("PAGEBUS_VERBOSE_BUILD") == "1",
        )


@functools.cache
def _default_build() -> Any:
    return load_build(f"pagebus_cpu_ops_{build_digest()}", _SOURCE)


# The build `using_build` put in place of the default one (bench/kernel_ab.py's side-by-side
# builds); None: the default.
_active_build: Any | None = None


def native_ops() -> Any:
    """The compiled module (built on first call if `make setup` did not); raises when the
    machine cannot build it (no compiler, no ninja)."""
    return _default_build() if _active_build is None else _active_build


@contextlib.contextmanager
def using_build(module: Any) -> Iterator[None]:
    """Every compiled op called inside runs from `module`, another build of cpu_ops.cpp, as does
    whatever takes its functions inside: a layer's matmul, a model's decode stack, both kept
    after. An A/B of builds in one process builds and runs each engine inside its own build's
    `using_build`, or the engine runs parts of two builds."""
    global _active_build
    before, _active_build = _active_build, module
    tiles_matmul_address.cache_clear()
    try:
        yield
    finally:
        _active_build = before
        tiles_matmul_address.cache_clear()


def available() -> str | None:
    """None when the compiled ops load, else why not (for the fallback's warning). Asked per
    call by ops that fall back on their own (a step's argmax, the sampler's race), so a failed
    build is remembered for the process rather than tried again at every step."""
    if os.environ.get("PAGEBUS_CPU_KERNELS", "1") == "0":
        return "PAGEBUS_CPU_KERNELS=0"
    if _active_build is not None:
        return None
    return _default_build_failure()


@functools.cache
def _default_build_failure() -> str | None:
    try:
        _default_build()
    except Exception as e:  # any build failure means: run the torch backend
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if not _native(x, weight, *(() if residual is None else (residual,))):
        return rms_norm_cpu(x, weight, eps, residual)
    if residual is None:
        return native_ops().rms_norm(x, weight, eps)
    out, new_residual = native_ops().add_rms_norm(x, residual, weight, eps)
    return out, new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not _native(x):
        return silu_and_mul_cpu(x)
    return native_ops().silu_and_mul(x)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """logits.argmax(-1) of float32 [rows, vocab] CPU logits (the first maximum; NaN the
    maximum), or None where the compiled ops do not take them."""
    if (
        logits.dtype is not torch.float32
        or logits.dim() != 2
        or logits.stride(1) != 1
        or logits.shape[1] == 0
    ):
        return None
    if not logits.is_cpu or available() is not None:
        return None
    return native_ops().argmax_rows(logits)


def race_candidate_ids(
    x: torch.Tensor,
    key_mul: torch.Tensor,
    key_add: torch.Tensor,
    cutoff: torch.Tensor,
    log_e: torch.Tensor,
    max_candidates: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids [rows, max_candidates], counts [rows]) of the ids that can win each row's exponential
    race (csrc race_candidates; a count of -1: the row races over all of it), or None where the
    compiled ops do not take x (float32 [rows, vocab] CPU logits with contiguous rows)."""
    if x.dtype is not torch.float32 or x.dim() != 2 or x.stride(1) != 1 or not x.is_cpu:
        return None
    if available() is not None:
        return None
    ids, counts = native_ops().race_candidates(x, key_mul, key_add, cutoff, log_e, max_candidates)
    return ids, counts


def top_values(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """Each row's largest values that its top_k / top_p cutoff reads, sorted descending and
    -inf padded to one width (csrc top_values), or None where the compiled ops do not take x or
    a row holds a NaN or an infinite maximum."""
    if x.dtype is not torch.float32 or x.dim() != 2 or x.stride(1) != 1 or not x.is_cpu or x.shape[1] == 0:
        return None
    if available() is not None:
        return None
    vals: torch.Tensor = native_ops().top_values(x, top_k, top_p)
    return vals if vals.numel() else None


def argmax_tiles_take(dtype: torch.dtype, tiles: torch.Tensor) -> bool:
    """Whether argmax_tiles takes activations of `dtype` with these tiles (float16 tiles widen
    to float32 activations; the others take their own dtype), the compiled ops being there."""
    want = torch.float32 if tiles.dtype is torch.float16 else tiles.dtype
    return dtype is want and tiles.is_cpu and available() is None


def argmax_tiles(x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor | None:
    """argmax_rows(linear_tiles(x, tiles).float()) for 2-D x: the same ids, without storing the
    product (csrc argmax_tiles); None where the compiled ops do not take x."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[0] == 0 or not x.is_cpu:
        return None
    if not argmax_tiles_take(x.dtype, tiles):
        return None
    return native_ops().argmax_tiles(x, tiles)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    memo: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not _native(q, k) or cos_sin_cache.dtype != torch.float32 or not _rows(q, k):
        return rotary_embedding_cpu(positions, q, k, cos_sin_cache, memo=memo)
    q_out, k_out = native_ops().rotary(positions, q, k, cos_sin_cache)
    return q_out, k_out


def k_cache_shape(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, ...]:
    """The K cache's shape for these ops. bf16 caches of 16-token blocks and head_dim 64 or 128 on
    AVX-512 BF16 builds hold each block in token pairs, [blocks, kv_heads, head_dim / 2, 16, 2]
    (csrc/cpu_ops.cpp, CacheDims): a decode's scores then come out with tokens in vector lanes,
    where the row layout [blocks, block_size, kv_heads, head_dim] needs a transposing sum per
    head and block. Everything else (and every V cache) keeps the rows. PAGEBUS_K_TOKEN_PAIRS=0
    keeps them for K too (for A/B measurement)."""
    rows = (num_blocks, block_size, kv_heads, head_dim)
    if (
        dtype is not torch.bfloat16
        or block_size != 16
        or head_dim not in (64, 128)
        or os.environ.get("PAGEBUS_K_TOKEN_PAIRS", "1") == "0"
        or available() is not None
        or not native_ops().bf16_tiles_built()
    ):
        return rows
    return (num_blocks, kv_heads, head_dim // 2, block_size, 2)


def new_kv_cache(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A zeroed K or V cache of `shape` (k_cache_shape's, or the rows shape [blocks, block_size,
    kv_heads, head_dim]). Rows-shaped float32 and float16 caches of 16-token blocks and head_dim
    64 or 128 are stored heads-major, [blocks, kv_heads, block_size, head_dim], and handed out as
    that storage viewed in the rows order (strides (kvh bs d, d, bs d, 1)): every op here reads
    and writes them through their strides, and these shapes never leave the compiled ops (the
    torch fallbacks `view` a cache, so other shapes keep the rows storage). A KV head's 16 rows of
    a block are then one 2 KiB run (float16, d 64) instead of 128 bytes every 384: decode
    attention streams each head's blocks in order. Zen 3, two threads, 30 layers of 64 sequences
    x 192 tokens from DRAM, float16: 16.0 -> 13.9 ms (min of 9; 25.2 -> 21.8 at 256 tokens, 7.1 ->
    6.1 at 32 x 160). PAGEBUS_KV_HEADS_MAJOR=0 keeps the rows storage (for A/B measurement).
    `zeros(shape, dtype)`: where a CPU cache's memory comes from (the worker's huge pages);
    None: torch.zeros."""
    heads_major = (
        len(shape) == 4
        and shape[0] > 0
        and shape[1] == 16
        and shape[3] in (64, 128)
        and dtype in (torch.float32, torch.float16)
        and device.type == "cpu"
        and os.environ.get("PAGEBUS_KV_HEADS_MAJOR", "1") != "0"
        and available() is None
        and native_ops().tiles_built()  # the SIMD build, whose prefill kernel takes these caches
        and (dtype is torch.float32 or native_ops().f16_built())
    )

    def new(s: tuple[int, ...]) -> torch.Tensor:
        if zeros is not None and device.type == "cpu":
            return zeros(s, dtype)
        return torch.zeros(s, dtype=dtype, device=device)

    if not heads_major:
        return new(shape)
    n, bs, kvh, d = shape
    return new((n, kvh, bs, d)).permute(0, 2, 1, 3)


def k_rows(k_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks of a K cache as rows [n, block_size, kv_heads, head_dim] (a gathered copy of a
    token-pairs cache; index select of a row one)."""
    k = k_cache[blocks]
    if k_cache.dim() == 4:
        return k
    n, kvh, half, bs, _ = k.shape
    return k.permute(0, 3, 1, 2, 4).reshape(n, bs, kvh, 2 * half)


def _row_caches(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, lens: list[int], rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-layout copies of the blocks that sequences `rows` use, and their block tables into
    the copies (rows in that order): what the prefill kernels and the torch backend read of a
    token-pairs K cache. A prefill step copies each chunk's context once a layer, a few hundred
    KiB against the chunk's attention FLOPs."""
    bs = v_cache.shape[1]
    counts = [-(-lens[i] // bs) for i in rows]
    width = max(counts)
    tables = torch.zeros(len(rows), width, dtype=torch.int32)
    used, at = [], 0
    for r, (i, c) in enumerate(zip(rows, counts, strict=True)):
        used.append(block_tables[i, :c])
        tables[r, :c] = torch.arange(at, at + c, dtype=torch.int32)
        at += c
    blocks = torch.cat(used).long()
    return k_rows(k_cache, blocks), v_cache[blocks], tables


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    memo: dict[str, Any] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    if k_cache.dim() == 5:  # token pairs: bf16 only, written by the compiled op alone
        native_ops().write_kv(key.contiguous(), value.contiguous(), k_cache, v_cache, slot_mapping)
        return
    if not (_native(key, value) and native_cache_dtypes(key, k_cache, v_cache)) or not _rows(key, value):
        write_kv_cache_cpu(
            key, value, k_cache, v_cache, slot_mapping, memo=memo, k_scale=k_scale, v_scale=v_scale
        )
        return
    native_ops().write_kv(key, value, k_cache, v_cache, slot_mapping)


def _rows(*xs: torch.Tensor) -> bool:
    """Each [T, heads, d] tensor's head vectors are contiguous (rows may be strided)."""
    for x in xs:
        s = x.stride()
        if s[2] != 1 or s[1] != x.shape[2]:
            return False
    return True


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
    memo: dict[str, Any] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """`paged_attention_cpu`'s contract, compiled and in place on the caches: one-token queries
    (decode_attention), then prefill chunks (prefill_attention: 16-token blocks of head_dim 64 or
    128); other prefill chunks go through SDPA one sequence at a time, as in the torch backend."""
    native = (
        _native(q)
        and native_attention_caches(q, k_cache, v_cache)
        and k_scale == 1.0
        and v_scale == 1.0
        and block_tables.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
        and _rows(q)
    )
    starts, lens = query_start_loc_host, seq_lens_host
    if not native and k_cache.dim() == 5:
        lens = lens if lens is not None else seq_lens.tolist()
        k4, v4, tables = _row_caches(k_cache, v_cache, block_tables, lens, list(range(len(lens))))
        return paged_attention(
            q, k4, v4, tables.to(block_tables.dtype), seq_lens, query_start_loc, scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len, seq_lens_host=seq_lens_host,
            query_start_loc_host=query_start_loc_host, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    if not native:
        return paged_attention_cpu(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len, seq_lens_host=seq_lens_host,
            query_start_loc_host=query_start_loc_host, memo=memo, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    out = torch.empty_like(q)
    native_ops().decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    if max_query_len == 1:
        return out
    if native_ops().prefill_attention(
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale
    ):
        return out
    starts = starts if starts is not None else query_start_loc.tolist()
    lens = lens if lens is not None else seq_lens.tolist()
    if k_cache.dim() == 5:  # AMX machines read a token-pairs K cache through a row copy
        _prefill_token_pairs(out, q, k_cache, v_cache, block_tables, lens, starts, scale)
        return out
    for i in range(len(starts) - 1):
        a, b = starts[i], starts[i + 1]
        if b - a > 1:
            out[a:b] = _prefill(q[a:b], k_cache, v_cache, block_tables[i], lens[i], scale)
    return out


def _prefill_token_pairs(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: list[int],
    starts: list[int],
    scale: float,
) -> None:
    """The prefill chunks' attention over a token-pairs K cache where the compiled kernel does
    not read the pairs (AMX machines): the chunks' blocks copied into the row layout, then
    prefill_attention over those rows as one batch."""
    rows = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] > 1]
    if not rows:
        return
    k4, v4, tables = _row_caches(k_cache, v_cache, block_tables, lens, rows)
    spans = [(starts[i], starts[i + 1]) for i in rows]
    sub_q = torch.cat([q[a:b] for a, b in spans])
    sub_starts = [0]
    for a, b in spans:
        sub_starts.append(sub_starts[-1] + b - a)
    sub_lens = [lens[i] for i in rows]
    sub_out = torch.empty_like(sub_q)
    qsl = torch.tensor(sub_starts, dtype=torch.int32)
    if not native_ops().prefill_attention(
        sub_out, sub_q, k4, v4, tables, torch.tensor(sub_lens, dtype=torch.int32), qsl, scale
    ):
        for r in range(len(rows)):
            a, b = sub_starts[r], sub_starts[r + 1]
            sub_out[a:b] = _prefill(sub_q[a:b], k4, v4, tables[r], sub_lens[r], scale)
    for r, (a, b) in enumerate(spans):
        out[a:b] = sub_out[sub_starts[r] : sub_starts[r + 1]]


def qkv_decode_attention(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """Rotary, the cache write and decode attention from the fused QKV output [T, (h + 2 kvh) d]
    in one compiled call -> [T, h d]; None (the caller runs the separate ops) where that call
    does not apply: a query of several tokens, a cache or dtype the compiled ops do not take."""
    if not (
        _native(qkv)
        and native_attention_caches(qkv, k_cache, v_cache)
        and cos_sin_cache.dtype is torch.float32
        and qkv.stride(1) == 1
        and block_tables.dtype is torch.int32
        and seq_lens.dtype is torch.int32
        and query_start_loc.dtype is torch.int32
        and query_start_loc.shape[0] == qkv.shape[0] + 1
    ):
        return None
    return native_ops().qkv_decode_attention(
        qkv, num_heads, num_kv_heads, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        block_tables, seq_lens, query_start_loc, scale,
    )  # fmt: skip


# Weights on CPUs held as column tiles (see csrc/cpu_ops.cpp, linear_tiles). float32, measured
# on the default model's layer shapes, one thread, cold weights, against F.linear on the
# [in, out] layout: 5-160 rows, the tile kernel 1.3-1.7x (32 rows: 84 vs 112 ms for 30 layers;
# 128 rows: 209 vs 357 ms); 1-4 rows, two tiles streamed at once, 0.9-1.15x per shape (the LM
# head 9.5 vs 9.1 ms); above 160 rows, torch.bmm over the tiles (MKL's batched GEMM) matched
# F.linear (512 rows: 1015 vs 1064 ms) where the tile kernel fell behind, on Intel CPUs; elsewhere
# MKL takes a generic path and the tile kernel serves every row count (csrc max_tile_rows).
# bfloat16 (AVX-512 BF16 machines, vdpbf16ps) takes the tile kernel at every row count: against
# F.linear (oneDNN) it was 3-20x faster at 1-32 rows and no slower at 512-2048. On AMX machines
# (Intel Xeon since Sapphire Rapids) the same tiles go through AMX from 2 rows: the default
# model's decode matmuls at 32 rows 7-10x faster than vdpbf16ps, 2-2.5x F.linear's oneDNN.
# AVX2 machines (no AVX-512) hold float32 tiles of 16 columns in row blocks of 6: on a Zen 3 (two
# threads, cold weights, 30 layers) qkv + o + gate_up + down at 32 rows 89.3 -> 48.0 ms against
# F.linear, at 1 row 25.8 -> 14.4; the LM head 37.3 -> 17.5 and 4.5 -> 3.3 ms. MKL's sgemm
# matched or beat it only at 128+ rows on the narrow qkv and o (39.9 vs 32.8 ms at 128).


@functools.cache
def _tile_rows() -> range:
    """float32 row counts the tile kernel takes (above them, MKL's batched GEMM)."""
    return range(1, min(native_ops().max_tile_rows(), 1 << 62) + 1)


def pack_linear(w: torch.Tensor, half: bool = False) -> torch.Tensor | None:
    """A CPU weight [N, K] as column tiles: float32 [N / TILE, K, TILE], bfloat16 [N / TILE,
    K / 2, TILE, 2]; None when this machine or shape cannot use them (no AVX-512 or AVX2 + FMA
    build, or no AVX-512 BF16 one for bfloat16; N not a multiple of TILE; an odd K in bfloat16;
    another dtype). half: a float32 weight rounded to float16 tiles [N / TILE, K, TILE], which
    multiply float32 x (--quantization fp16; a build with F16C or AVX-512)."""
    if w.dtype not in _DTYPES or not w.is_cpu or w.dim() != 2 or available() is not None:
        return None
    ops = native_ops()
    if w.shape[0] % ops.TILE or not ops.tiles_built():
        return None
    if w.dtype is torch.bfloat16 and (half or w.shape[1] % 2 or not ops.bf16_tiles_built()):
        return None
    if half:
        return ops.pack_tiles(w.to(torch.float16)) if ops.f16_built() else None
    return ops.pack_tiles(w)


def _tiles_n_k(tiles: torch.Tensor) -> tuple[int, int]:
    """(N, K) of the matrix a `pack_linear` weight holds."""
    if tiles.dim() == 4:  # bfloat16: pairs of k
        return tiles.shape[0] * tiles.shape[2], 2 * tiles.shape[1]
    return tiles.shape[0] * tiles.shape[2], tiles.shape[1]


def linear_tiles(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times a `pack_linear` weight (+ bias) -> [..., N]."""
    n, k = _tiles_n_k(tiles)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        y = x2.new_empty(0, n)
    elif m in _tile_rows() or tiles.dtype is not torch.float32:
        y = native_ops().linear_tiles(x2 if x2.stride(1) == 1 else x2.contiguous(), tiles)
    else:  # [T, M, K] @ [T, K, TILE] -> [T, M, TILE] -> [M, T * TILE]
        y = torch.bmm(x2.unsqueeze(0).expand(tiles.shape[0], m, k), tiles).transpose(0, 1).reshape(m, n)
    if bias is not None:
        y = y.add_(bias)
    return y.view(*x.shape[:-1], n)


def direct_linear_tiles(
    tiles: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear_tiles(x, tiles, bias)` for 2-D x, with the common case (rows in _tile_rows(),
    contiguous, no bias) one compiled call."""
    if bias is not None:
        return lambda x: linear_tiles(x, tiles, bias)
    kernel = native_ops().linear_tiles
    rows = range(1, 1 << 62) if tiles.dtype is not torch.float32 else _tile_rows()

    def call(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] in rows and x.is_contiguous():
            return kernel(x, tiles)
        return linear_tiles(x, tiles)

    return call


@functools.cache
def tiles_matmul_address() -> int:
    """The address of the C++ tile matmul taking (x, [tiles]), for the decode stack."""
    return int(native_ops().tiles_matmul_address())


def gate_up_silu(x: torch.Tensor, native_mm: tuple[int, list[torch.Tensor]]) -> torch.Tensor | None:
    """silu(x . gate) * (x . up) straight from a gate_up weight held as tiles (`native_mm`: its
    Linear's), without storing the [T, 2d] matmul output for a second pass to read: bitwise what
    the matmul then silu_and_mul give. None where that path does not apply (another kernel or
    dtype, MKL's GEMM rows): the caller runs the two calls."""
    fn, weights = native_mm
    if fn != tiles_matmul_address() or len(weights) != 1 or x.dtype is not torch.float32 or x.dim() != 2:
        return None
    return native_ops().gate_up_silu(x if x.stride(1) == 1 else x.contiguous(), weights[0])


def decode_stack(heads: int, kv_heads: int, scale: float, eps: float) -> Any:
    """An empty csrc/cpu_ops.cpp DecodeStack: every layer of a Llama-family decoder for
    decode-only steps in one call (workers/models/llama.py fills and runs it)."""
    return native_ops().DecodeStack(heads, kv_heads, scale, eps)


def embed_tiles(tiles: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the [N, K] matrix held as tiles (a tied embedding's lookup; float16 tiles'
    rows widened to the float32 they multiply)."""
    return native_ops().embed_rows(tiles, ids)


def main() -> int:
    """`python -m pagebus.kernels.cpu_native`: build the extension now (make setup runs it)."""
    why = available()
    if why is None:
        print(f"pagebus CPU kernels: built ({native_ops().__name__})")
        return 0
    print(f"pagebus CPU kernels: not built ({why}); the engine will use the torch backend", file=sys.stderr)
    return 0  # not fatal: the torch backend serves without them


if __name__ == "__main__":
    sys.exit(main())
