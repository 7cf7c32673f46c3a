"""GPU check of kernels/: every Triton launcher against its torch ref at Llama-3-8B layer sizes.

    python -m bench.kernels_gpu [--seed 0] [--num-seqs 256] [--max-context 8192]

For each op it reports the max abs error against the `*_ref`, whether that is within tolerance,
(paged attention: for both tensor-core operand modes, native fp16/bf16 and fp32-upcast, with the
relative error norm of each) and the median time of the Triton kernel and of a torch baseline (paged attention: torch SDPA on
KV already gathered into padded contiguous tensors, the favourable case for torch). Prints one
JSON object on stdout, logs on stderr, and exits 1 if any check fails. Without CUDA it prints
{"skipped": "no CUDA device"} and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger("bench.kernels_gpu")


@dataclass(frozen=True)
class BenchConfig:
    num_seqs: int = 256
    max_context: int = 8192  # tokens per sequence, this step's included
    prefill_seqs: int = 16  # of num_seqs, in the mixed batch; the others decode
    prefill_len: int = 256  # query tokens per prefill chunk
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    hidden: int = 4096
    intermediate: int = 14336
    num_tokens: int = 4096  # tokens per step for the element-wise ops
    dtype: str = "bfloat16"
    seed: int = 0


# (atol, rtol) against the ref: the ops compute in fp32 and round once, so outputs may differ by
# about an ulp of bf16 (rtol 2**-6); attention sums thousands of products in another order.
TOL = {"paged_attention": (1.6e-2, 1.6e-2), "elementwise": (1e-5, 1.6e-2), "silu_and_mul": (8e-3, 1.6e-2)}


def _compare(
    outs: tuple[torch.Tensor, ...], refs: tuple[torch.Tensor, ...], tol: tuple[float, float]
) -> dict:
    """max abs error over all outputs, and whether every element is within atol + rtol * |ref|."""
    atol, rtol = tol
    err, ok = 0.0, True
    for o, r in zip(outs, refs, strict=True):
        diff = (o.float() - r.float()).abs()
        err = max(err, diff.max().item() if diff.numel() else 0.0)
        ok = ok and bool((diff <= atol + rtol * r.float().abs()).all())
    return {"max_abs_err": err, "ok": ok}


def _time_ms(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # CPU (interpreter) dry runs only: one timed call is enough
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _paged_batch(cfg: BenchConfig, qlens: list[int], seq_lens: list[int], device: torch.device) -> dict:
    """Random KV pages behind shuffled block tables; q, caches in cfg.dtype."""
    dtype = getattr(torch, cfg.dtype)
    pages = [-(-n // cfg.block_size) for n in seq_lens]
    num_blocks = sum(pages) + 1
    shape = (num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    ids = torch.randperm(num_blocks, device=device)[: sum(pages)].to(torch.int32)
    tables = torch.zeros(len(pages), max(pages), dtype=torch.int32, device=device)
    col = torch.arange(max(pages), device=device)
    counts = torch.tensor(pages, device=device)
    tables[col[None, :] < counts[:, None]] = ids  # row-major fill: each sequence's pages in order
    q = torch.randn(sum(qlens), cfg.num_heads, cfg.head_dim, device=device, dtype=dtype)
    qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32, device=device)
    qsl[1:] = torch.tensor(qlens, device=device).cumsum(0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return {"q": q, "k": k_cache, "v": v_cache, "tables": tables, "lens": lens, "qsl": qsl, "qlens": qlens}


def _ref_chunked(b: dict, scale: float, chunk: int = 32) -> torch.Tensor:
    """paged_attention_ref over groups of sequences, to bound its padded-batch memory."""
    from pagebus.kernels.paged_attention import paged_attention_ref

    out = torch.empty_like(b["q"])
    starts = b["qsl"].tolist()
    for s in range(0, len(b["qlens"]), chunk):
        e = min(s + chunk, len(b["qlens"]))
        a, z = starts[s], starts[e]
        qsl = b["qsl"][s : e + 1] - a
        out[a:z] = paged_attention_ref(
            b["q"][a:z], b["k"], b["v"], b["tables"][s:e], b["lens"][s:e], qsl, scale
        )
    return out


def _sdpa_gathered(cfg: BenchConfig, b: dict, scale: float) -> tuple[Callable[[], torch.Tensor], Callable]:
    """Torch baseline: KV gathered to [B, kvh, L, d]; the GQA group folded into the query rows
    ([B, kvh, group * Qmax, d]) so the memory-efficient kernel needs no KV head expansion.
    Returns (the timed call, a function mapping its output back to [num_tokens, h, d])."""
    nb, qmax = b["tables"].shape[0], max(b["qlens"])
    group, dev = cfg.num_heads // cfg.num_kv_heads, b["q"].device
    length = b["tables"].shape[1] * cfg.block_size
    tables = b["tables"].long()
    k = b["k"][tables].flatten(1, 2).transpose(1, 2).contiguous()  # [B, kvh, L, d]
    v = b["v"][tables].flatten(1, 2).transpose(1, 2).contiguous()
    qlens = torch.tensor(b["qlens"], device=dev)
    valid = torch.arange(qmax, device=dev)[None, :] < qlens[:, None]  # [B, Qmax]
    q_pad = torch.zeros(nb, qmax, cfg.num_heads, cfg.head_dim, dtype=b["q"].dtype, device=dev)
    q_pad[valid] = b["q"]
    # [B, Qmax, kvh, group, d] -> [B, kvh, group * Qmax, d], rows ordered (group, query)
    q_rows = q_pad.view(nb, qmax, cfg.num_kv_heads, group, cfg.head_dim).permute(0, 2, 3, 1, 4)
    q_rows = q_rows.reshape(nb, cfg.num_kv_heads, group * qmax, cfg.head_dim)
    pos = (b["lens"] - qlens)[:, None] + torch.arange(qmax, device=dev)[None, :]  # [B, Qmax]
    keys = torch.arange(length, device=dev)
    mask = (keys[None, None, :] <= pos[:, :, None]) & (keys[None, None, :] < b["lens"][:, None, None])
    mask |= ~valid[:, :, None] & (keys == 0)  # padded query rows: one key, so no NaN
    mask = mask[:, None, None].expand(nb, 1, group, qmax, length).reshape(nb, 1, group * qmax, length)

    # On CUDA, never the math backend: it would materialise [B, kvh, rows, L] fp32 scores (tens of GB).
    backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION] if dev.type == "cuda" else []
    backends = backends or [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]

    def call() -> torch.Tensor:
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q_rows, k, v, attn_mask=mask, scale=scale)

    def unpad(o: torch.Tensor) -> torch.Tensor:
        o = o.view(nb, cfg.num_kv_heads, group, qmax, cfg.head_dim).permute(0, 3, 1, 2, 4)
        return o.reshape(nb, qmax, cfg.num_heads, cfg.head_dim)[valid]

    return call, unpad


def _check_attention(
    cfg: BenchConfig, name: str, qlens: list[int], lens: list[int], dev: torch.device
) -> dict:
    from pagebus.kernels.paged_attention import PagedAttentionOptions, paged_attention

    b = _paged_batch(cfg, qlens, lens, dev)
    scale = cfg.head_dim**-0.5
    args = (b["q"], b["k"], b["v"], b["tables"], b["lens"], b["qsl"], scale)
    max_q = max(qlens)
    out = paged_attention(*args, max_query_len=max_q)
    ref = _ref_chunked(b, scale)
    res: dict[str, Any] = {"num_tokens": sum(qlens), "max_query_len": max_q, "max_seq_len": max(lens)}
    res |= _compare((out,), (ref,), TOL["paged_attention"])
    res["triton_ms"] = _time_ms(lambda: paged_attention(*args, max_query_len=max_q), dev)
    kv_bytes = 2 * sum(lens) * cfg.num_kv_heads * cfg.head_dim * b["k"].element_size()
    res["triton_kv_gb_per_s"] = kv_bytes / res["triton_ms"] / 1e6
    res["rel_err"] = float((out.float() - ref.float()).norm() / ref.float().norm())
    # The other operand mode: K/V upcast to fp32 and tf32 dots, against the native default.
    opts = PagedAttentionOptions(dot_operands="fp32")
    out32 = paged_attention(*args, max_query_len=max_q, options=opts)
    res["fp32dot"] = _compare((out32,), (ref,), TOL["paged_attention"])
    res["fp32dot"]["rel_err"] = float((out32.float() - ref.float()).norm() / ref.float().norm())
    res["fp32dot"]["triton_ms"] = _time_ms(
        lambda: paged_attention(*args, max_query_len=max_q, options=opts), dev
    )
    res["ok"] = res["ok"] and res["fp32dot"]["ok"]
    del out, ref, out32
    try:
        call, unpad = _sdpa_gathered(cfg, b, scale)
        res["sdpa_max_abs_err"] = (unpad(call()).float() - paged_attention(*args).float()).abs().max().item()
        res["sdpa_gathered_ms"] = _time_ms(call, dev)
    except (RuntimeError, torch.OutOfMemoryError) as e:  # a baseline failure must not hide the checks
        res["sdpa_error"] = str(e)[:300]
    log.info("%s: %s", name, res)
    return res


def _check_elementwise(cfg: BenchConfig, dev: torch.device) -> dict[str, dict]:
    from pagebus.kernels.activation import silu_and_mul, silu_and_mul_ref
    from pagebus.kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref
    from pagebus.kernels.rms_norm import rms_norm, rms_norm_ref
    from pagebus.kernels.rotary import rotary_embedding, rotary_embedding_ref

    dtype, t = getattr(torch, cfg.dtype), cfg.num_tokens
    results: dict[str, dict] = {}

    def record(name: str, check: dict, fn: Callable, ref_fn: Callable) -> None:
        r = check | {"triton_ms": _time_ms(fn, dev), "torch_ref_ms": _time_ms(ref_fn, dev)}
        results[name] = r
        log.info("%s: %s", name, r)

    x = torch.randn(t, cfg.hidden, device=dev, dtype=dtype)
    res = torch.randn_like(x)
    w = 1 + 0.1 * torch.randn(cfg.hidden, device=dev, dtype=dtype)
    check = _compare((rms_norm(x, w, 1e-5),), (rms_norm_ref(x, w, 1e-5),), TOL["elementwise"])
    record("rms_norm", check, lambda: rms_norm(x, w, 1e-5), lambda: rms_norm_ref(x, w, 1e-5))
    check = _compare(rms_norm(x, w, 1e-5, res), rms_norm_ref(x, w, 1e-5, res), TOL["elementwise"])
    record(
        "rms_norm_residual", check, lambda: rms_norm(x, w, 1e-5, res), lambda: rms_norm_ref(x, w, 1e-5, res)
    )

    max_pos = max(cfg.max_context, 2)
    inv_freq = 500000.0 ** -(torch.arange(0, cfg.head_dim, 2, device=dev, dtype=torch.float32) / cfg.head_dim)
    freqs = torch.outer(torch.arange(max_pos, device=dev, dtype=torch.float32), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, head_dim]
    pos = torch.randint(0, max_pos, (t,), device=dev)
    q = torch.randn(t, cfg.num_heads, cfg.head_dim, device=dev, dtype=dtype)
    k = torch.randn(t, cfg.num_kv_heads, cfg.head_dim, device=dev, dtype=dtype)
    refs = rotary_embedding_ref(pos, q, k, cache)
    check = _compare(rotary_embedding(pos, q.clone(), k.clone(), cache), refs, TOL["elementwise"])  # in place
    record(
        "rotary",
        check,
        lambda: rotary_embedding(pos, q, k, cache),
        lambda: rotary_embedding_ref(pos, q, k, cache),
    )

    g = torch.randn(t, 2 * cfg.intermediate, device=dev, dtype=dtype)
    check = _compare((silu_and_mul(g),), (silu_and_mul_ref(g),), TOL["silu_and_mul"])
    record("silu_and_mul", check, lambda: silu_and_mul(g), lambda: silu_and_mul_ref(g))

    num_blocks = 2 * t // cfg.block_size + 1
    shape = (num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    kc, vc = torch.zeros(shape, device=dev, dtype=dtype), torch.zeros(shape, device=dev, dtype=dtype)
    kr, vr = kc.clone(), vc.clone()
    slots = torch.randperm(num_blocks * cfg.block_size, device=dev)[:t]
    slots[::7] = -1
    v = torch.randn_like(k)
    write_kv_cache(k, v, kc, vc, slots)
    write_kv_cache_ref(k, v, kr, vr, slots)
    check = _compare((kc, vc), (kr, vr), (0.0, 0.0))  # a copy: exact
    record(
        "kv_write",
        check,
        lambda: write_kv_cache(k, v, kc, vc, slots),
        lambda: write_kv_cache_ref(k, v, kr, vr, slots),
    )
    return results


def run(cfg: BenchConfig, dev: torch.device) -> dict[str, Any]:
    """Every check at cfg's sizes on dev; the JSON-ready result (without the run metadata)."""
    torch.manual_seed(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    ctx = torch.randint(1, cfg.max_context + 1, (cfg.num_seqs,), generator=g).tolist()
    results = {"paged_attention_decode": _check_attention(cfg, "decode", [1] * cfg.num_seqs, ctx, dev)}
    n_pre = min(cfg.prefill_seqs, cfg.num_seqs)
    qlens = [cfg.prefill_len] * n_pre + [1] * (cfg.num_seqs - n_pre)
    lens = [max(c, n) for c, n in zip(ctx, qlens, strict=True)]  # a chunk may be a prompt's first
    results["paged_attention_mixed"] = _check_attention(cfg, "mixed", qlens, lens, dev)
    few = min(8, cfg.num_seqs)  # few long decodes: the case split-K exists for
    long_ctx = [cfg.max_context] * few
    results["paged_attention_decode_few_long"] = _check_attention(cfg, "few_long", [1] * few, long_ctx, dev)
    results |= _check_elementwise(cfg, dev)
    return {"results": results, "all_ok": all(r["ok"] for r in results.values())}


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-seqs", type=int, default=BenchConfig.num_seqs)
    p.add_argument("--max-context", type=int, default=BenchConfig.max_context)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "kernels_gpu", "skipped": "no CUDA device"}))
        return 0
    import triton

    cfg = BenchConfig(num_seqs=a.num_seqs, max_context=a.max_context, seed=a.seed)
    dev = torch.device("cuda")
    out = {
        "bench": "kernels_gpu",
        "git_sha": _git_sha(),
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "config": dataclasses.asdict(cfg),
    }
    out |= run(cfg, dev)
    print(json.dumps(out))
    return 0 if out["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
