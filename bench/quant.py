"""Quantized weights beside llama.cpp on the same GGUF files, in one run.

    python -m bench.quant [--formats f32 bf16 int8 q8_0 q4_0 q4_1 q4_k_m] [--num-requests 32] [--output-len 64]
                          [--single-output-len 128] [--skip-llamacpp]

Per format: pagebus's in-process LLM (fp32 activations; f32 is the file dequantized, bf16 the BF16
file in bfloat16 where the CPU has native bf16, int8 the F32
file with --quantization int8 beside llama.cpp's Q8_0, the others keep their blocks with
--quantization gguf) and llama.cpp (bench/peer_runners/llamacpp_runner.py)
through the same timing protocol as bench/peers.py: single-stream and N-concurrent greedy output
tok/s. Also per format: the weight bytes pagebus holds, and greedy agreement with the f32 model
on the oracle prompts (tests/workers/oracle.py) over --quality-tokens tokens.
The files: bench/setup_peers.sh's rewrites of the default model, plus Q4_0 and Q4_K_M made with
llama.cpp's quantizer (`--make-q4-0`, from the F32 file; never downloaded). For this model's
576-wide rows llama.cpp's Q4_K_M falls back to Q5_0/Q8_0 and keeps Q4_K/Q6_K in ffn_down.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import cpu_flags, emit, log, setup_logging
from bench.peer_runners._harness import measure
from bench.peers import run_peer
from bench.serve_peers import DEFAULT_PEER_DIR, load_manifest
from bench.throughput import make_prompts

_QUANTIZE_SCRIPT = """
import ctypes, os, sys, llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype), 2
assert llama_cpp.llama_model_quantize(src.encode(), (dst + ".tmp").encode(), ctypes.byref(p)) == 0
os.replace(dst + ".tmp", dst)
"""


def model_files(manifest: dict[str, Any] | None, make_q4_0: bool) -> dict[str, str]:
    from pagebus.frontends.model_files import default_model_path

    files = dict(manifest["models"]) if manifest else {}
    files["q4_1"] = default_model_path()
    f32 = files.get("f32")
    for fmt in ("q4_0", "q4_k_m"):
        if not f32 or fmt in files:
            continue
        out = str(Path(f32).with_name(Path(f32).name.replace(".f32.", f".{fmt}.")))
        if not os.path.isfile(out) and make_q4_0 and manifest:
            log.info("making %s with llama.cpp's quantizer", out)
            subprocess.run([manifest["python"], "-c", _QUANTIZE_SCRIPT, f32, out, fmt.upper()], check=True)
        if os.path.isfile(out):
            files[fmt] = out
    return files


def weight_bytes(path: str, quantization: str, dtype: str = "float32") -> int:
    import torch
    from pagebus.workers.loader import resident_weight_bytes
    from pagebus.workers.runner import load_model

    model, _ = load_model(path, getattr(torch, dtype), torch.device("cpu"), quantization=quantization)
    n = resident_weight_bytes(model)
    del model
    gc.collect()
    return n


def run_pagebus(
    path: str, quantization: str, job: dict[str, Any], quality_tokens: int, dtype: str = "float32"
) -> dict[str, Any]:
    from pagebus import LLM, SamplingParams
    from tests.workers.oracle import PROMPTS

    t = time.perf_counter()
    llm = LLM(path, dtype=dtype, seed=0, enable_prefix_caching=False, quantization=quantization)
    load_s = round(time.perf_counter() - t, 2)

    def generate(prompts: list[list[int]], n: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    try:
        result = {
            "engine": "pagebus",
            "quantization": quantization,
            "dtype": dtype,
            "load_s": load_s,
        } | measure(job, generate)
        params = SamplingParams(temperature=0.0, max_tokens=quality_tokens, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        result["oracle_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        return result
    finally:
        if hasattr(llm, "shutdown"):
            llm.shutdown()


def dequantized_tokens(path: str, quality_tokens: int) -> list[list[int]]:
    """Greedy tokens on the oracle prompts from the same file dequantized at load (the reference
    that isolates the packed kernels from the quantization itself)."""
    from pagebus import LLM, SamplingParams
    from tests.workers.oracle import PROMPTS

    llm = LLM(path, dtype="float32", seed=0, enable_prefix_caching=False, quantization="none")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=quality_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        if hasattr(llm, "shutdown"):
            llm.shutdown()


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Greedy tokens equal position by position up to each prompt's first divergence."""
    same = total = 0
    identical = 0
    for x, y in zip(a, b, strict=True):
        k = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), len(x))
        same, total, identical = same + k, total + len(x), identical + (k == len(x))
    return {"prompts_identical": f"{identical}/{len(a)}", "tokens_before_divergence": round(same / total, 3)}


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--formats",
        nargs="+",
        default=["f32", "bf16", "int8", "q8_0", "q4_0", "q4_1", "q4_k_m"],
        help="bf16: the BF16 file in bfloat16 (skipped where the CPU has no native bf16)",
    )
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--single-input-len", type=int, default=32)
    ap.add_argument("--single-output-len", type=int, default=128)
    ap.add_argument("--quality-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--make-q4-0", action="store_true", help="write the Q4_0 and Q4_K_M files if missing")
    ap.add_argument("--peer-dir", default=DEFAULT_PEER_DIR)
    ap.add_argument("--peer-timeout", type=float, default=900)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    manifest = load_manifest(Path(args.peer_dir).expanduser(), "llamacpp")
    files = model_files(manifest, args.make_q4_0)
    work = make_prompts(args.num_requests, args.input_len, args.output_len, 0.0, args.seed)
    single = make_prompts(1, args.single_input_len, args.single_output_len, 0.0, args.seed + 1)[0][0]
    job = {
        "prompts": [ids for ids, _ in work], "output_len": args.output_len, "offline_sizes": [args.num_requests],
        "single_output_len": args.single_output_len, "single_prompt": single, "modes": ["offline", "single"],
    }  # fmt: skip
    results: dict[str, Any] = {}
    reference: list[list[int]] | None = None
    from pagebus.workers.device import cpu_has_bf16

    for fmt in args.formats:
        if fmt == "bf16" and not cpu_has_bf16():
            results[fmt] = {"skipped": "no native bf16 on this CPU (emulated: not a configuration to run)"}
            continue
        # int8: pagebus's --quantization int8 made at load from the F32 file; llama.cpp runs its
        # nearest format, Q8_0 (8-bit weights too, with a scale per 32 instead of per row)
        src = "f32" if fmt == "int8" else fmt
        peer_fmt = "q8_0" if fmt == "int8" else fmt
        if src not in files:
            results[fmt] = {"skipped": "no such file (see --make-q4-0, bench/setup_peers.sh)"}
            continue
        path = files[src]
        quantization = "int8" if fmt == "int8" else "none" if fmt in ("f32", "f16", "bf16") else "gguf"
        dtype = "bfloat16" if fmt == "bf16" else "float32"  # the packed kernels take float32 x
        log.info("%s: pagebus (%s, %s) on %s", fmt, quantization, dtype, path)
        row: dict[str, Any] = {"file": path, "weight_bytes": weight_bytes(path, quantization, dtype)}
        row["pagebus"] = {"loadavg_1m_at_start": os.getloadavg()[0]} | run_pagebus(
            path, quantization, job, args.quality_tokens, dtype
        )
        tokens = row["pagebus"].pop("oracle_tokens")
        if fmt == "f32":
            reference = tokens
        else:
            if fmt not in ("int8", "bf16"):  # int8's "dequantized" model is the f32 one
                row["greedy_vs_dequantized"] = agreement(
                    tokens, dequantized_tokens(path, args.quality_tokens)
                )
            if reference is not None:
                row["greedy_vs_f32"] = agreement(tokens, reference)
        if manifest and not args.skip_llamacpp and peer_fmt in files:
            log.info("%s: llama.cpp (%s)", fmt, peer_fmt)
            row["llamacpp_file"] = files[peer_fmt]
            cfg = {"model": files[peer_fmt], "options": {"threads": args.threads, "n_batch": 2048,
                                                         "n_ubatch": 2048, "ctx_per_seq": 512, "format": peer_fmt}}  # fmt: skip
            row["llamacpp"] = {"loadavg_1m_at_start": os.getloadavg()[0]} | run_peer(
                "llamacpp", manifest, job | cfg, args.peer_timeout
            )
            row["vs_llamacpp"] = {
                mode: _ratio(row["pagebus"], row["llamacpp"], mode) for mode in ("single", "offline")
            }
        results[fmt] = row
    emit({
        "bench": "quant", "cpu_flags": cpu_flags(), "threads": args.threads,
        "config": {k: v for k, v in vars(args).items() if k != "peer_dir"}, "results": results,
    })  # fmt: skip


def _ratio(ours: dict[str, Any], theirs: dict[str, Any], mode: str) -> float | None:
    key = "decode_tokens_per_s" if mode == "single" else "output_tokens_per_s"
    a, b = ours.get(mode, {}).get(key), theirs.get(mode, {}).get(key)
    return round(a / b, 2) if a and b else None


if __name__ == "__main__":
    main()
