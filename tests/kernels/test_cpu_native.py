"""The compiled CPU ops (kernels/cpu_native.py) against the refs, and their fallbacks.

fp32 results differ from the refs' by summation order only (a few ulp); bf16 ones by at most
an ulp of bf16 where a float32 difference of that kind crosses a rounding boundary. fp16 and
fp8 caches must give the torch backend's result exactly (they run it).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from pagebus.kernels import cpu_native as native
from pagebus.kernels.activation import silu_and_mul_ref
from pagebus.kernels.kv_cache_write import write_kv_cache_ref
from pagebus.kernels.paged_attention import paged_attention_ref
from pagebus.kernels.rms_norm import rms_norm_cpu, rms_norm_ref
from pagebus.kernels.rotary import rotary_embedding_ref
from pagebus.workers.ops import select_ops

from tests.kernels.paged_batch import make_batch, to_token_pairs
from tests.kernels.test_paged_attention import DECODES, MIXED

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ops")
TOLS = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2}}
TOL = TOLS[torch.float32]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
_NO_BF16 = "bfloat16 tiles and token-pairs K caches need an AVX-512 BF16 CPU"


def _bf16_built() -> bool:
    return native.available() is None and native.native_ops().bf16_tiles_built()


def _f16_built() -> bool:
    return native.available() is None and native.native_ops().f16_built()


_NO_F16 = "float16 caches and weight tiles need the compiled ops with F16C or AVX-512"
F16_TILES = pytest.mark.skipif(not _f16_built(), reason=_NO_F16)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    why = native.available()
    assert why is None, f"the compiled CPU ops did not build: {why}"


@DTYPES
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("hidden", [576, 70])  # a multiple of the vector width, and not
def test_rms_norm(rows: int, hidden: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    x, res, w = (
        torch.randn(*shape, generator=g).to(dtype) for shape in ((rows, hidden), (rows, hidden), (hidden,))
    )
    torch.testing.assert_close(native.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **TOLS[dtype])
    out, new_res = native.rms_norm(x, w, 1e-6, res)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-6, res)
    torch.testing.assert_close(out, ref_out, **TOLS[dtype])
    assert out.dtype == ref_out.dtype == new_res.dtype
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    assert x.shape == out.shape and not torch.equal(res, new_res)  # inputs untouched: new tensors


def test_rms_norm_of_a_strided_view() -> None:
    """q/k norms of Qwen3 pass head vectors of a fused output: rows with a gap between them."""
    x = torch.randn(6, 3, 64)[:, 1]
    w = torch.randn(64)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **TOL)


@DTYPES
@pytest.mark.parametrize("rows", [1, 33])
def test_silu_and_mul(rows: int, dtype: torch.dtype) -> None:
    x = torch.randn(rows, 2 * 1536) * 8  # wide enough to reach exp's saturated tails
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    x = x.to(dtype)
    torch.testing.assert_close(native.silu_and_mul(x), silu_and_mul_ref(x), **TOLS[dtype])


def _bf16_with_specials(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 values over a wide range, with NaNs, infinities and denormals sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, cols, generator=g) * 4)
    flat = x.view(-1)
    for start, value in ((0, float("nan")), (5, float("inf")), (7, -float("inf")), (9, 1e-39), (11, -3e-39)):
        flat[start::23] = value
    return x.to(torch.bfloat16)


def test_bf16_rounding_of_the_vector_loops() -> None:
    """The bf16 norms, residual adds and SiLU product run 16 lanes at a time on AVX-512 builds and
    round as c10 does, infinities and denormals included: the residual sum equals torch's float32
    sum rounded to bf16 bit for bit (NaN where torch's is), and each SiLU lane equals the scalar
    loop's, NaNs too (a row of one column is all scalar)."""
    x, r = _bf16_with_specials(5, 70, 1), _bf16_with_specials(5, 70, 2)
    w = torch.randn(70).to(torch.bfloat16)
    _, res = native.rms_norm(x, w, 1e-6, r)
    want = (x.float() + r.float()).to(torch.bfloat16)
    nan = want.isnan()  # torch writes its NaN as 0xFFFF, c10's constructor as 0x7FC0
    assert bool(nan.any()) and torch.equal(res.isnan(), nan)
    assert torch.equal(res.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    gu = _bf16_with_specials(3, 2 * 37, 3)
    got = native.silu_and_mul(gu)
    for c in range(37):  # column c alone: the scalar loop
        one = native.silu_and_mul(torch.stack([gu[:, c], gu[:, 37 + c]], 1))
        assert torch.equal(got[:, c : c + 1].view(torch.int16), one.view(torch.int16)), c


@DTYPES
@pytest.mark.parametrize(("head_dim", "rot"), [(64, 64), (64, 32)])  # whole and partial rotary
@pytest.mark.parametrize("tokens", [1, 9])
def test_rotary_on_views_of_the_fused_qkv(tokens: int, head_dim: int, rot: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(tokens)
    h, kvh = 9, 3
    qkv = torch.randn(tokens, (h + 2 * kvh) * head_dim, generator=g).to(dtype)
    q, k, _ = qkv.split([h * head_dim, kvh * head_dim, kvh * head_dim], -1)
    q, k = q.reshape(tokens, h, head_dim), k.reshape(tokens, kvh, head_dim)
    cache = torch.randn(4096, rot, generator=g)
    pos = torch.randint(0, 4096, (tokens,), generator=g)
    before = qkv.clone()
    got_q, got_k = native.rotary_embedding(pos, q, k, cache)
    ref_q, ref_k = rotary_embedding_ref(pos, q, k, cache)
    torch.testing.assert_close(got_q, ref_q, **TOLS[dtype])
    torch.testing.assert_close(got_k, ref_k, **TOLS[dtype])
    assert torch.equal(qkv, before)


@DTYPES
def test_write_kv_skips_slot_minus_one(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(8, 2, 16, 3, 64, generator=g).to(dtype)  # interleaved K/V pages: strided caches
    k, v = torch.randn(5, 3, 64, generator=g).to(dtype), torch.randn(5, 3, 64, generator=g).to(dtype)
    slots = torch.tensor([3, -1, 17, 127, 64])
    want_k, want_v = kv[:, 0].clone(), kv[:, 1].clone()  # the ref needs contiguous caches
    write_kv_cache_ref(k, v, want_k, want_v, slots)
    native.write_kv_cache(k, v, kv[:, 0], kv[:, 1], slots)
    assert torch.equal(kv[:, 0], want_k) and torch.equal(kv[:, 1], want_v)


def test_write_kv_refuses_a_slot_past_the_cache() -> None:
    cache = torch.zeros(2, 16, 1, 8)
    with pytest.raises(RuntimeError, match="beyond the cache"):
        native.write_kv_cache(
            torch.ones(1, 1, 8), torch.ones(1, 1, 8), cache, cache.clone(), torch.tensor([32])
        )


# whole prompts (partial 16-query and 16-key blocks), a chunk on a block boundary, two tokens
PREFILLS = [(40, 0), (17, 0), (16, 16), (2, 0), (1, 7)]


@DTYPES
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("seqs", [DECODES, MIXED, PREFILLS], ids=["decodes", "mixed", "prefills"])
def test_attention(
    seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    batch = make_batch(seqs, num_heads, num_kv_heads, 64, dtype=dtype)
    ref = paged_attention_ref(*batch.args(), 0.125)
    max_q = max(n for n, _ in seqs)
    for host in (True, False):  # the step's host lists, or the tensors read back
        extra = {
            "seq_lens_host": batch.seq_lens.tolist(),
            "query_start_loc_host": batch.query_start_loc.tolist(),
        }
        got = native.paged_attention(*batch.args(), 0.125, max_query_len=max_q, **(extra if host else {}))
        torch.testing.assert_close(got, ref, **TOLS[dtype])


@pytest.mark.skipif(not _f16_built(), reason=_NO_F16)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (9, 3), (8, 1), (8, 2)])
@pytest.mark.parametrize("seqs", [DECODES, MIXED], ids=["decodes", "mixed"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_on_float16_caches(
    seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """--kv-cache-dtype float16 beside float32 activations: the reference on the same (widened)
    values, for groups of 1, 3, 8 (3 + 3 + 2) and 4 (3 + 1) query heads a KV head, which AVX2
    builds score in threes (group_block_scores; at head_dim 128 a K row in two halves)."""
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim)
    batch.k_cache, batch.v_cache = batch.k_cache.half(), batch.v_cache.half()
    ref = paged_attention_ref(*batch.args(), 0.125)
    got = native.paged_attention(*batch.args(), 0.125, max_query_len=max(n for n, _ in seqs))
    torch.testing.assert_close(got, ref, **TOL)


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128])
def test_long_prefill_attention(head_dim: int, dtype: torch.dtype) -> None:
    """Prefill chunks over many key blocks (AMX machines take 32 keys a step: an odd block count,
    a chunk after cached context that starts mid-block, a prompt that fills its last block)."""
    seqs = [(100, 37), (33, 0), (64, 64), (3, 140)]
    batch = make_batch(seqs, 9, 3, head_dim, dtype=dtype)
    ref = paged_attention_ref(*batch.args(), head_dim**-0.5)
    got = native.paged_attention(*batch.args(), head_dim**-0.5, max_query_len=100)
    torch.testing.assert_close(got, ref, **TOLS[dtype])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_float32_prefill_runs_the_compiled_kernel(head_dim: int) -> None:
    """Every vector build (AVX-512 and AVX2) takes float32 prefill chunks itself: the call must
    not decline them to torch's SDPA, which the results alone would not show. Lengths cross the
    32-key steps: a step of one block, chunks after context that start mid-step."""
    if not native.native_ops().tiles_built():
        pytest.skip("no AVX-512 or AVX2 + FMA: the compiled ops have no vector kernels here")
    seqs = [(100, 37), (33, 0), (47, 17), (1, 40), (17, 15)]
    batch = make_batch(seqs, 9, 3, head_dim)
    out = torch.zeros_like(batch.q)
    assert native.native_ops().prefill_attention(out, *batch.args(), head_dim**-0.5)
    ref = paged_attention_ref(*batch.args(), head_dim**-0.5)
    starts = batch.query_start_loc.tolist()
    for i, (n, _) in enumerate(seqs):
        a, b = starts[i], starts[i + 1]
        if n > 1:  # decode rows are decode_attention's, left untouched here
            torch.testing.assert_close(out[a:b], ref[a:b], **TOL)


@pytest.mark.parametrize(
    ("dtype", "k_layout"),
    [
        (torch.float32, "rows"),
        (torch.bfloat16, "rows"),
        pytest.param(
            torch.bfloat16, "token_pairs", marks=pytest.mark.skipif(not _bf16_built(), reason=_NO_BF16)
        ),
        pytest.param(  # --kv-cache-dtype float16 beside float32
            torch.float32, "float16", marks=pytest.mark.skipif(not _f16_built(), reason=_NO_F16)
        ),
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "rot"), [(9, 3, 64), (8, 1, 32)])
@pytest.mark.parametrize("seqs", [DECODES, DECODES * 5], ids=["few", "threads"])
def test_fused_decode_attention_is_the_separate_ops(
    num_heads: int,
    num_kv_heads: int,
    rot: int,
    dtype: torch.dtype,
    k_layout: str,
    seqs: list[tuple[int, int]],
) -> None:
    """qkv_decode_attention = rotary, then write_kv, then paged_attention, caches included (also
    on a token-pairs K cache, kernels/cpu_native.py k_cache_shape, and float16 caches). 30
    sequences: the rotation and cache writes split over the threads (kRotateGrain 8 tokens)."""
    from pagebus.workers.layers.rotary import build_cos_sin_cache

    d, bs = 64, 16
    batch = make_batch(seqs, num_heads, num_kv_heads, d, dtype=dtype)
    if k_layout == "token_pairs":
        batch.k_cache, batch.v_cache = to_token_pairs(batch.k_cache), batch.v_cache.contiguous()
    elif k_layout == "float16":
        batch.k_cache, batch.v_cache = batch.k_cache.half(), batch.v_cache.half()
    t = len(seqs)
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * d).to(dtype)
    positions = batch.seq_lens.long() - 1
    slots = batch.block_tables[torch.arange(t), positions // bs].long() * bs + positions % bs
    cos_sin = build_cos_sin_cache(rot, 2048, 10000.0, None)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    caches = [c.clone() for c in (batch.k_cache, batch.v_cache)]
    q, k = native.rotary_embedding(positions, q.view(t, -1, d), k.view(t, -1, d), cos_sin)
    native.write_kv_cache(k, v.reshape(t, -1, d), *caches, slots)
    want = native.paged_attention(q, *caches, *batch.args()[3:], 0.125, max_query_len=1)
    tables = batch.args()[3:]
    before = torch.get_num_threads()
    torch.set_num_threads(1 if seqs is DECODES else 2)
    try:
        got = native.qkv_decode_attention(
            qkv,
            num_heads,
            num_kv_heads,
            positions,
            cos_sin,
            batch.k_cache,
            batch.v_cache,
            slots,
            *tables,
            0.125,
        )
    finally:
        torch.set_num_threads(before)
    assert got is not None
    torch.testing.assert_close(got, want.reshape(t, -1), **TOLS[dtype])
    assert torch.equal(batch.k_cache, caches[0]) and torch.equal(batch.v_cache, caches[1])


@pytest.mark.parametrize(
    "cache",
    [
        "float32",
        pytest.param("float16", marks=pytest.mark.skipif(not _f16_built(), reason=_NO_F16)),
        pytest.param("bf16_token_pairs", marks=pytest.mark.skipif(not _bf16_built(), reason=_NO_BF16)),
    ],
)
@pytest.mark.parametrize(
    ("threads", "seqs"),
    [
        (2, [(1, 999)]),  # one stream: its keys in two runs of blocks, one a thread
        (2, [(1, 30)]),  # too few blocks to split
        (3, [(1, 200), (1, 40)]),  # two runs each, the short one's runs unequal
        (8, [(1, 1000), (1, 20)]),  # four runs each: the short sequence's last two are empty
        (2, [(1, 300), (40, 0)]),  # beside a prefill chunk, which stays prefill_attention's
    ],
)
def test_decode_split_across_threads(threads: int, seqs: list[tuple[int, int]], cache: str) -> None:
    """Fewer decodes than threads: each sequence's keys split into runs of blocks, one a claim,
    merged by their softmax max and sum, equal to the unsplit attention within float32 rounding
    (bf16's: a bf16 cache with K in token pairs, decode_rows_pairs, splits from 8 blocks on)."""
    dtype = torch.bfloat16 if cache == "bf16_token_pairs" else torch.float32
    batch = make_batch(seqs, 9, 3, 64, dtype=dtype)
    if cache == "float16":
        batch.k_cache, batch.v_cache = batch.k_cache.half(), batch.v_cache.half()
    ref = paged_attention_ref(*batch.args(), 0.125)
    if cache == "bf16_token_pairs":
        batch.k_cache, batch.v_cache = to_token_pairs(batch.k_cache), batch.v_cache.contiguous()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.paged_attention(*batch.args(), 0.125, max_query_len=max(n for n, _ in seqs))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, ref, **TOLS[dtype])


def test_fused_decode_attention_declines_prefill_tokens() -> None:
    batch = make_batch(MIXED, 2, 2, 64)
    t = batch.q.shape[0]
    qkv, positions, cos_sin = torch.randn(t, 6 * 64), torch.zeros(t, dtype=torch.long), torch.zeros(2048, 64)
    caches, slots = (batch.k_cache, batch.v_cache), torch.full((t,), -1, dtype=torch.long)
    tables, lens, starts = batch.block_tables, batch.seq_lens, batch.query_start_loc
    got = native.qkv_decode_attention(
        qkv, 2, 2, positions, cos_sin, *caches, slots, tables, lens, starts, 0.125
    )
    assert got is None  # more tokens than sequences: the separate ops run
    # three sequences, three tokens, but not one each: the compiled op refuses it too
    starts = torch.tensor([0, 2, 3, 3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="other than one query token"):
        native.native_ops().qkv_decode_attention(
            qkv[:3], 2, 2, positions[:3], cos_sin, *caches, slots[:3], tables, lens, starts, 0.125
        )


@DTYPES
@pytest.mark.parametrize("head_dim", [128, 32])  # the 16-wide fast path's other size, and the general loop
def test_attention_other_head_dims(head_dim: int, dtype: torch.dtype) -> None:
    batch = make_batch(DECODES + MIXED, 8, 2, head_dim, dtype=dtype)
    ref = paged_attention_ref(*batch.args(), 0.125)
    got = native.paged_attention(*batch.args(), 0.125, max_query_len=129)
    torch.testing.assert_close(got, ref, **TOLS[dtype])


def test_other_dtypes_run_the_torch_backend() -> None:
    x, w = torch.randn(3, 64, dtype=torch.float16), torch.randn(64, dtype=torch.float16)
    assert torch.equal(native.rms_norm(x, w, 1e-5), rms_norm_cpu(x, w, 1e-5))
    mixed = torch.randn(3, 64, dtype=torch.bfloat16)  # dtypes that differ: torch promotes them
    assert torch.equal(native.rms_norm(mixed, w.float(), 1e-5), rms_norm_cpu(mixed, w.float(), 1e-5))


def test_backend_falls_back_to_torch_when_not_built(monkeypatch, caplog) -> None:
    monkeypatch.setenv("PAGEBUS_CPU_KERNELS", "0")
    with caplog.at_level(logging.WARNING):
        ops = select_ops("auto", torch.device("cpu"))
    assert ops.name == "torch"
    assert "PAGEBUS_CPU_KERNELS=0" in caplog.text
    monkeypatch.delenv("PAGEBUS_CPU_KERNELS")
    assert select_ops("auto", torch.device("cpu")).name == "cpu"


def test_a_failed_build_is_tried_once_not_at_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # the argmax and the sampler ask available() per call and fall back on their own: a machine
    # whose build fails must not rebuild at every step
    tries: list[int] = []

    def failing() -> None:
        tries.append(1)
        raise RuntimeError("Error building extension 'pagebus_cpu_ops'")

    native._default_build_failure.cache_clear()
    monkeypatch.setattr(native, "_default_build", failing)
    try:
        for _ in range(3):
            assert native.available() == "RuntimeError: Error building extension 'pagebus_cpu_ops'"
        assert native.argmax_rows(torch.zeros(2, 8)) is None
        assert len(tries) == 1
    finally:
        native._default_build_failure.cache_clear()


def test_a_killed_builds_lock_is_cleared_and_a_live_build_waited_for(monkeypatch, tmp_path, caplog) -> None:
    """torch's loader waits forever on a lock file: one a killed build left must not hang the
    next start (even at once), and a build another process runs must be waited for, its lock kept."""
    import threading

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "ext" / "lock"
    lock.parent.mkdir()
    lock.touch()  # what a build killed a moment ago leaves
    with caplog.at_level(logging.INFO), native.build_directory_for("ext") as d:
        assert d == str(lock.parent)
        assert not lock.exists()
    assert "did not finish" in caplog.text

    lock.touch()  # now a live build's: another process holds the build's flock
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); sys.stdin.readline()", str(lock.parent / "pagebus-build.flock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "held"
        waiting, entered = threading.Event(), threading.Event()

        class Seen(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "waiting for another process's build" in record.getMessage():
                    waiting.set()

        def build() -> None:
            with native.build_directory_for("ext"):
                entered.set()

        seen = Seen(logging.INFO)
        native.log.addHandler(seen)
        t = threading.Thread(target=build)
        try:
            with caplog.at_level(logging.INFO):
                t.start()
                assert waiting.wait(60), "the second build did not wait for the first"
                assert lock.exists() and not entered.is_set()
                holder.stdin.write("\n")
                holder.stdin.flush()
                t.join(60)
        finally:
            native.log.removeHandler(seen)
        assert entered.is_set() and not lock.exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("half", [False, pytest.param(True, marks=F16_TILES)])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 33, 160, 161, 300])
@pytest.mark.parametrize(("n", "k"), [(96, 576), (48, 70), (144, 1536)])
def test_linear_on_column_tiles(rows: int, n: int, k: int, half: bool) -> None:
    """Every path: a few rows (one tile at a time, one stream a thread; odd and even tile counts:
    up to 4 rows on AVX-512, 2 on AVX2), row blocks (8 rows on AVX-512, 6 on AVX2) with the next tile
    prefetched and the batched GEMM above 160 on Intel CPUs (float32 tiles); K not a multiple of
    the vector width; a bias; rows of x that are a strided view. half: float16 tiles of the
    float32 weight (--quantization fp16), which multiply exactly the float32 matmul of the
    weight rounded to float16 (each value widened exactly; float32 sums)."""
    g = torch.Generator().manual_seed(rows * n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(rows, 2 * k, generator=g)[:, :k]
    tiles, tile = native.pack_linear(w, half=half), native.native_ops().TILE
    assert tiles is not None and tiles.shape == (n // tile, k, tile)
    assert tiles.dtype is (torch.float16 if half else torch.float32)
    wv = w.half().double() if half else w.double()
    want = torch.nn.functional.linear(x.double(), wv, b.double())
    # float32 sums in another order than float64's: a few ulps of the magnitudes summed
    bound = 1e-5 + 4e-7 * (x.double().abs() @ wv.abs().t() + b.double().abs())
    assert bool(((native.linear_tiles(x, tiles, b).double() - want).abs() <= bound).all())
    assert bool(
        ((native.linear_tiles(x.unsqueeze(0), tiles)[0].double() - (want - b.double())).abs() <= bound).all()
    )


@contextlib.contextmanager
def _two_threads_beside_a_spinner() -> Iterator[None]:
    """Two threads for the calls inside, with a process spinning on one core beside them: the
    threads' shares of a region then finish unevenly, and differently from one call to the next."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        yield
    finally:
        torch.set_num_threads(before)
        spinner.kill()
        spinner.wait()


@pytest.mark.parametrize("half", [False, pytest.param(True, marks=F16_TILES)])
def test_few_rows_cover_every_tile_whichever_thread_takes_it(half: bool) -> None:
    """One and two rows: each thread runs a contiguous share of the tile pairs and then takes the
    other's last pairs from the back. With a process spinning on one core beside the call, the
    shares finish unevenly from one call to the next; every call still writes every column (the
    output is torch.empty: a pair run twice or never would show) with the same values."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(16 * 1023, 96, generator=g)  # an odd count of tiles on AVX2 and AVX-512
    tiles = native.pack_linear(w, half=half)
    assert tiles is not None
    wv = w.half().double() if half else w.double()
    with _two_threads_beside_a_spinner():
        for rows in (1, 2):
            x = torch.randn(rows, 96, generator=g)
            want = x.double() @ wv.t()
            bound = 1e-5 + 4e-7 * (x.double().abs() @ wv.abs().t())
            first = native.linear_tiles(x, tiles)
            assert bool(((first.double() - want).abs() <= bound).all())
            for _ in range(30):
                assert torch.equal(native.linear_tiles(x, tiles), first)


@pytest.mark.parametrize("half", [False, pytest.param(True, marks=F16_TILES)])
def test_many_rows_cover_every_tile_whichever_thread_takes_it(half: bool) -> None:
    """Beyond kFewRows rows the threads take spans of tiles that shrink as the work runs out and
    never cross a row chunk (64 rows of x at K = 1536). With a process spinning on one core beside
    the call, the spans fall differently from one call to the next; every call still writes every
    column of every row (the output is torch.empty) with the same values, and the fused gate_up
    SiLU product, which shares the spans, too."""
    g = torch.Generator().manual_seed(12)
    # gate_up: an odd count of tile pairs on either build (39 tiles of 16, 13 of 48)
    w = torch.randn(48 * 26, 1536, generator=g) * 0.1
    tiles = native.pack_linear(w, half=half)
    assert tiles is not None
    wv = w.half().double() if half else w.double()
    mm = (native.tiles_matmul_address(), [tiles])
    with _two_threads_beside_a_spinner():
        for rows in (7, 64, 150):  # a span per thread; one row chunk; two and a bit (<= Intel's 160)
            x = torch.randn(rows, 1536, generator=g)
            want = x.double() @ wv.t()
            bound = 1e-5 + 4e-7 * (x.double().abs() @ wv.abs().t())
            first = native.linear_tiles(x, tiles)
            assert bool(((first.double() - want).abs() <= bound).all()), rows
            fused = native.gate_up_silu(x, mm)
            assert fused is not None
            assert torch.equal(fused, native.silu_and_mul(first)), rows
            for _ in range(10):
                assert torch.equal(native.linear_tiles(x, tiles), first), rows
                assert torch.equal(native.gate_up_silu(x, mm), fused), rows


@pytest.mark.parametrize("half", [False, pytest.param(True, marks=F16_TILES)])
def test_tile_rows_do_not_depend_on_the_rows_beside_them(half: bool) -> None:
    """Row blocks are sized evenly (32 rows on AVX2: 6 6 5 5 5 5): a row's sums are the same
    bitwise whatever block it falls in, so a sequence's logits do not depend on its batch."""
    g = torch.Generator().manual_seed(7)
    tiles = native.pack_linear(torch.randn(96, 576, generator=g), half=half)
    assert tiles is not None
    x = torch.randn(70, 576, generator=g)
    every = native.linear_tiles(x, tiles)
    for rows in (1, 2, 3, 5, 7, 13, 20, 31, 32, 33, 63, 64):
        assert torch.equal(native.linear_tiles(x[:rows], tiles), every[:rows]), rows
        assert torch.equal(native.linear_tiles(x[-rows:], tiles), every[-rows:]), rows


@pytest.mark.parametrize("half", [False, pytest.param(True, marks=F16_TILES)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 33, 64, 170, 300, 2048])
@pytest.mark.parametrize(("d", "k"), [(1536, 576), (48, 70), (96, 1536)])
def test_gate_up_silu_is_the_matmul_then_silu_and_mul(rows: int, d: int, k: int, half: bool) -> None:
    """The fused gate_up + SiLU product: bitwise the tile matmul followed by silu_and_mul, on the
    few-rows path (the tile matmul, then the products), row blocks over several row chunks (2048 rows) and K not a
    multiple of the vector width; strided rows of x too."""
    g = torch.Generator().manual_seed(rows * d + k)
    tiles = native.pack_linear(torch.randn(2 * d, k, generator=g) * 0.1, half=half)
    assert tiles is not None
    x = torch.randn(rows, 2 * k, generator=g)[:, :k]
    mm = (native.tiles_matmul_address(), [tiles])
    got = native.gate_up_silu(x, mm)
    if not half and rows > native.native_ops().max_tile_rows():  # Intel: MKL's GEMM runs these rows
        assert got is None
        return
    assert got is not None
    assert torch.equal(got, native.silu_and_mul(native.linear_tiles(x, tiles)))


def test_gate_up_silu_declines_what_it_does_not_run() -> None:
    tiles = native.pack_linear(torch.randn(96, 64))
    assert tiles is not None
    mm = (native.tiles_matmul_address(), [tiles])
    assert native.gate_up_silu(torch.randn(3, 64, dtype=torch.bfloat16), mm) is None  # not float32 x
    assert native.gate_up_silu(torch.randn(3, 64), (mm[0] + 1, [tiles])) is None  # another kernel
    assert native.gate_up_silu(torch.randn(0, 64), mm) is None  # no rows
    odd = native.pack_linear(torch.randn(48, 64))  # 3 tiles: not a gate and an up of one size
    assert odd is not None and native.gate_up_silu(torch.randn(3, 64), (mm[0], [odd])) is None


BF16_TILES = pytest.mark.skipif(not _bf16_built(), reason=_NO_BF16)


@BF16_TILES
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 8, 9, 33, 160, 161, 300])
@pytest.mark.parametrize(("n", "k"), [(96, 576), (48, 70), (144, 1536)])
def test_bf16_linear_on_column_tiles(rows: int, n: int, k: int) -> None:
    """bfloat16 tiles at every row count (no batched-GEMM hand-off): float32 sums of exact
    products, rounded once, so the result is the float32 matmul of the same values rounded to
    bf16, off by one bf16 ulp where summation order crosses a rounding boundary."""
    g = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(rows, 2 * k, generator=g).bfloat16()[:, :k]
    tiles = native.pack_linear(w)
    assert tiles is not None and tiles.shape == (n // 48, k // 2, 48, 2)
    got = native.linear_tiles(x, tiles)
    want = torch.nn.functional.linear(x.float(), w.float())
    # rounding (half an ulp), one ulp more across a boundary, and float32 summation order
    bound = 1.5 * torch.finfo(torch.bfloat16).eps * want.abs() + 1e-5 * (
        x.float().abs() @ w.float().abs().t()
    )
    assert got.dtype is torch.bfloat16 and got.shape == (rows, n)
    assert bool(((got.float() - want).abs() <= bound).all())
    assert int((got != want.bfloat16()).sum()) <= 0.01 * got.numel()
    with_bias = native.linear_tiles(x.unsqueeze(0), tiles, b)[0]
    assert torch.equal(with_bias, got.add(b))


def test_amx_multiplies_bf16_tiles_on_amx_cpus() -> None:
    """Where the CPU has AMX, the build uses it (the rows and shapes of the test above then ran
    on it: 2+ rows with K a multiple of 32, partial 16-row groups, an odd column-group count);
    elsewhere it reports that it does not."""
    flags = native._cpu_flags().split()
    assert native.native_ops().bf16_amx_in_use() == ("amx_bf16" in flags and "amx_tile" in flags)


def test_tiles_are_refused_where_they_do_not_fit() -> None:
    assert native.pack_linear(torch.randn(50, 64)) is None  # N not a multiple of the tile
    assert native.pack_linear(torch.randn(48, 63, dtype=torch.bfloat16)) is None  # odd K: no k pairs
    assert native.pack_linear(torch.randn(48, 64, dtype=torch.float16)) is None
    assert native.pack_linear(torch.randn(48, 64, dtype=torch.bfloat16), half=True) is None
    with pytest.raises(RuntimeError, match="float16 tiles need float32 x"):
        native.native_ops().linear_tiles(
            torch.randn(2, 64).bfloat16(), native.pack_linear(torch.randn(48, 64)).half()
        )
    if not native.native_ops().bf16_tiles_built():
        assert native.pack_linear(torch.randn(48, 64, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(torch.bfloat16, marks=BF16_TILES),
        pytest.param(torch.float16, marks=F16_TILES),
    ],
)
def test_embedding_rows_from_tiles(dtype: torch.dtype) -> None:
    """float16: float16 tiles of a float32 matrix give its rounded rows, widened back to float32."""
    w = torch.randn(96, 40)
    tiles = native.pack_linear(w, half=True) if dtype is torch.float16 else native.pack_linear(w.to(dtype))
    assert tiles is not None
    ids = torch.tensor([[0, 47, 48], [95, 3, 3]])
    want = torch.nn.functional.embedding(ids, w.to(dtype))
    assert torch.equal(native.embed_tiles(tiles, ids), want.float() if dtype is torch.float16 else want)
    assert torch.equal(native.embed_tiles(tiles, ids.int()), native.embed_tiles(tiles, ids))
    with pytest.raises(RuntimeError, match=r"id 96 not in \[0, 96\)"):
        native.embed_tiles(tiles, torch.tensor([3, 96]))


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_argmax_rows_is_torch_argmax(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 49152, generator=g)
    assert torch.equal(native.argmax_rows(x), x.argmax(-1))
    wide = torch.randn(rows, 50000, generator=g)[:, :49999]  # rows apart by more than their width
    assert torch.equal(native.argmax_rows(wide), wide.argmax(-1))
    inf, nan = float("inf"), float("nan")
    edge = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0],  # ties: the first
            [nan, 5.0, nan, 1.0],  # NaN is the maximum: its first
            [2.0, 9.0, 1.0, nan],
            [-inf, -inf, -inf, -inf],
            [0.0, -0.0, 7.0, inf],
            [-0.0, 0.0, -1.0, -2.0],  # signed zeros are equal
        ]
    )
    assert native.argmax_rows(edge).tolist() == edge.argmax(-1).tolist() == [1, 0, 3, 0, 3, 0]
    # the same cases across the vector runs and the tail of a 1,000-wide row (15 runs of 64 on
    # AVX-512, 31 of 32 on AVX2, then the rest)
    wide = torch.randn(7, 1000, generator=g)
    wide[0, 500] = nan
    wide[1, 999] = nan  # in the tail
    wide[2, 10] = inf
    wide[3] = -inf
    wide[4, 100] = wide[4, 990] = 50.0  # a tie between a run and the tail: the run's
    wide[5, 300] = wide[5, 301] = wide[5, 700] = 50.0  # ties within a run and across runs
    wide[6, :] = 0.0
    assert native.argmax_rows(wide).tolist() == wide.argmax(-1).tolist() == [500, 999, 10, 0, 100, 300, 0]


TILE_DTYPES = pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(torch.bfloat16, marks=BF16_TILES),
        pytest.param(torch.float16, marks=F16_TILES),  # float16 tiles beside float32 x
    ],
)


def _tiles_of(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tiles = native.pack_linear(w, half=True) if dtype is torch.float16 else native.pack_linear(w.to(dtype))
    assert tiles is not None
    return tiles


@TILE_DTYPES
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 9, 70, 300])
@pytest.mark.parametrize(("n", "k"), [(4800, 576), (96, 1536)])
def test_argmax_tiles_is_the_argmax_of_the_product(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    """The fused argmax (a greedy step's LM head) picks what the argmax of linear_tiles's product
    picks, in every path: one stream of tiles (up to 4 rows), row blocks, several row chunks
    (300 rows at K = 1,536)."""
    g = torch.Generator().manual_seed(rows * n + k)
    tiles = _tiles_of(torch.randn(n, k, generator=g), dtype)
    x = torch.randn(rows, k, generator=g).to(torch.float32 if dtype is torch.float16 else dtype)
    want = native.linear_tiles(x, tiles).float().argmax(-1)
    got = native.argmax_tiles(x, tiles)
    assert got is not None and got.dtype is torch.int64
    assert torch.equal(got, want)


@TILE_DTYPES
def test_argmax_tiles_edges(dtype: torch.dtype) -> None:
    """Ties go to the first column, across tiles and threads too; a NaN is the maximum (its
    first); a row of -inf gives 0, as torch.argmax does. x = [1, 0] against W's [:, 0] = the
    row's values (exact products): each case is one row of logits set by hand."""
    inf, nan = float("inf"), float("nan")
    n = 4800
    cases: list[tuple[dict[int, float], float]] = [  # (columns set, every other column's value)
        ({100: 5.0, 4000: 5.0, 4799: 5.0}, 0.0),  # a tie between tiles far apart: the first
        ({2399: 7.0, 2400: 7.0}, 1.0),  # across neighbouring tiles (two threads' split: 50 tiles each)
        ({2402: 7.0, 2403: 7.0}, 1.0),  # within a tile
        ({10: nan, 3000: nan, 20: 9.0}, 0.0),  # the first NaN
        ({4799: nan}, 3.0),  # NaN in the last column
        ({}, -inf),  # every value -inf
        ({4000: inf}, -1.0),
        ({50: -0.0, 49: 0.0}, -2.0),  # signed zeros are equal: the first
    ]
    for columns, other in cases:
        values = torch.full((n,), other)
        for j, v in columns.items():
            values[j] = v
        w = torch.zeros(n, 2)
        w[:, 0] = values
        x = torch.tensor([[1.0, 0.0]]).to(torch.float32 if dtype is torch.float16 else dtype)
        got = native.argmax_tiles(x, _tiles_of(w, dtype))
        assert got is not None and got.tolist() == values.view(1, -1).argmax(-1).tolist(), columns


def test_argmax_tiles_declines_what_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    tiles = native.pack_linear(torch.randn(96, 64))
    assert tiles is not None
    assert native.argmax_tiles(torch.randn(2, 64).double(), tiles) is None  # not the tiles' dtype
    assert native.argmax_tiles(torch.randn(64, 2).t(), tiles) is None  # columns are not contiguous
    assert native.argmax_tiles(torch.randn(0, 64), tiles) is None
    monkeypatch.setenv("PAGEBUS_CPU_KERNELS", "0")
    assert native.argmax_tiles(torch.randn(2, 64), tiles) is None


def test_argmax_rows_declines_what_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 1000)
    assert native.argmax_rows(x.bfloat16()) is None
    assert native.argmax_rows(x.t()) is None  # columns are not contiguous
    monkeypatch.setenv("PAGEBUS_CPU_KERNELS", "0")
    assert native.argmax_rows(x) is None
