"""Compiles every kernel for sm_90 (H100/H200) without a GPU, and reports ptxas resource use.

Run in a process without TRITON_INTERPRET (the interpreter replaces @triton.jit functions):
    python -m tests.kernels.aot_sm90      -> one JSON object: {variant: {"regs": n, "spill_bytes": n}}
This catches what the interpreter lets through: tl.dot shape rules, unsupported constructs,
type errors in constexpr branches, and register spills of the default tilings.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import triton
from pagebus.kernels.activation import _silu_and_mul_kernel
from pagebus.kernels.kv_cache_write import _write_kv_cache_kernel
from pagebus.kernels.paged_attention import (
    PagedAttentionOptions,
    _merge_splits_kernel,
    _paged_attn_kernel,
    _tiling,
)
from pagebus.kernels.rms_norm import _rms_norm_kernel
from pagebus.kernels.rotary import _rotary_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _compile(fn: Any, ptrs: dict[str, str], consts: dict[str, Any], num_warps: int = 4) -> dict[str, int]:
    """ptrs: type of each pointer/float argument; every other non-constexpr argument is i32."""
    sig = {a: "constexpr" if a in consts else ptrs.get(a, "i32") for a in fn.arg_names}
    kernel = triton.compile(
        ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True)
    regs = int(re.search(r"REG:(\d+)", usage.stdout).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage.stdout).group(1))
    return {"regs": regs, "spill_bytes": stack}


def _attention_variants() -> dict[str, dict[str, int]]:
    out = {}
    # (name, dtype, num_heads, num_kv_heads, head_dim, max_query_len, splits, num_seqs == 1)
    cases = [
        ("decode_int64_metadata_bf16", "bf16", 32, 8, 128, 1, 2, False),
        ("decode_llama8b_bf16", "bf16", 32, 8, 128, 1, 1, False),
        ("decode_split_bf16_one_seq", "bf16", 32, 8, 128, 1, 8, True),
        ("prefill_llama8b_bf16", "bf16", 32, 8, 128, 512, 1, False),
        ("prefill_fp16_mha_hd64", "fp16", 16, 16, 64, 300, 1, False),
        ("mixed_fp32_gqa8_hd80", "fp32", 8, 1, 80, 7, 2, False),
        ("decode_fp32_hd128", "fp32", 32, 8, 128, 1, 4, False),
        # e4m3 caches (--kv-cache-dtype fp8) behind a bf16 q
        ("decode_llama8b_bf16_fp8kv", "bf16", 32, 8, 128, 1, 2, False),
        ("prefill_llama8b_bf16_fp8kv", "bf16", 32, 8, 128, 512, 1, False),
    ]
    # Every 16-bit case twice: native operands (the GPU default) and upcast to fp32.
    cases += [(f"{c[0]}_fp32dot", *c[1:]) for c in cases if c[1] != "fp32"]
    for name, dt, h, kvh, hd, max_q, splits, one_seq in cases:
        native = dt != "fp32" and not name.endswith("_fp32dot")
        t = _tiling(
            PagedAttentionOptions(), h // kvh, hd, max_q, on_gpu=True, fp32=dt == "fp32", native=native
        )
        fp8kv = "_fp8kv" in name
        ptrs = {a: f"*{dt}" for a in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        if fp8kv:
            ptrs |= {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
        meta = "*i64" if "int64" in name else "*i32"  # block tables, seq lens, query starts: either
        ptrs |= {a: meta for a in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
        ptrs |= {"cu_qtiles_ptr": "*i32"}
        ptrs |= {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "scale_log2": "fp32", "v_scale": "fp32"}
        consts: dict[str, Any] = dict(
            HEAD_DIM=hd, HEAD_PAD=t.head_pad, GROUP=h // kvh, GROUP_PAD=t.group_pad, BLOCK_M=t.block_m,
            BLOCK_N=t.block_n, PAGE_SIZE=16, NUM_SPLITS=splits, DOT_PRECISION="ieee" if dt == "fp32" else "tf32",
            NATIVE_DOT=native, KV_FP8=fp8kv,
        )  # fmt: skip
        if one_seq:  # Triton specialises an int argument equal to 1 into a constant
            consts["num_seqs"] = 1
        out[name] = _compile(_paged_attn_kernel, ptrs, consts, t.num_warps)
    merge_ptrs = {
        "part_acc_ptr": "*fp32",
        "part_ml_ptr": "*fp32",
        "out_ptr": "*bf16",
        "query_start_loc_ptr": "*i32",
    }
    merge_consts = dict(HEAD_DIM=128, HEAD_PAD=128, HEADS_PAD=32, NUM_SPLITS=8)
    out["merge_splits_bf16"] = _compile(_merge_splits_kernel, merge_ptrs, merge_consts)
    return out


def _elementwise_variants() -> dict[str, dict[str, int]]:
    out = {}
    kv = {"key_ptr": "*fp32", "value_ptr": "*fp32", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16"}
    kv |= {"k_scale": "fp32", "v_scale": "fp32"}
    kv_consts = dict(HEAD_DIM=128, HEADS_PAD=8, HEAD_PAD=128, PAGE_SIZE=16, FP8=False)
    out["kv_write_fp32_to_bf16"] = _compile(
        _write_kv_cache_kernel, kv | {"slot_mapping_ptr": "*i64"}, kv_consts
    )
    kv16 = {a: "*fp16" for a in kv if a.endswith("_ptr")} | {"slot_mapping_ptr": "*i64"}
    out["kv_write_fp16"] = _compile(_write_kv_cache_kernel, kv | kv16, kv_consts)
    # an e4m3 cache: the launcher passes its bytes
    kv8 = kv | {"key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": "*u8", "v_cache_ptr": "*u8"}
    out["kv_write_bf16_to_fp8"] = _compile(
        _write_kv_cache_kernel, kv8 | {"slot_mapping_ptr": "*i64"}, kv_consts | {"FP8": True}
    )
    rms = {a: "*bf16" for a in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "new_residual_ptr")}
    rms["eps"] = "fp32"
    for res in (False, True):
        out[f"rms_norm_bf16_residual_{res}"] = _compile(
            _rms_norm_kernel, rms, dict(BLOCK=4096, HAS_RESIDUAL=res), num_warps=8
        )
    rot = {"positions_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "cos_sin_ptr": "*fp32"}
    out["rotary_bf16"] = _compile(_rotary_kernel, rot, dict(HEADS_PAD=32, KV_HEADS_PAD=8, HALF_PAD=64))
    out["silu_and_mul_bf16"] = _compile(
        _silu_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16"}, dict(BLOCK=1024)
    )
    return out


def main() -> None:
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the kernels this compiles")
    print(json.dumps(_attention_variants() | _elementwise_variants()))


if __name__ == "__main__":
    main()
