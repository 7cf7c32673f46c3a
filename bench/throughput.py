"""Offline throughput, vLLM-style, through `LLM.generate` (in-process) and `pagebus run-batch`
(JSONL through the processes) on the same requests.

    python -m bench.throughput [--num-requests 64] [--input-len 128] [--output-len 128]
        [--dtype auto] [--kv-cache-dtype auto] [--max-num-batched-tokens 2048] [--random-range-ratio 0]
        [--paths llm run-batch]

Prompts are random token ids (fixed seed) so the input length is exact; greedy, ignore_eos.
A short warm-up generate is excluded. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time

from bench.common import emit, log, setup_logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SUMMARY = re.compile(r"(\d+) ok, (\d+) failed.*?(\d+) prompt \+ (\d+) output tokens in ([\d.]+)s")


def make_prompts(
    n: int, input_len: int, output_len: int, ratio: float, seed: int
) -> list[tuple[list[int], int]]:
    """(prompt ids, output len) pairs; lengths drawn in [len*(1-ratio), len*(1+ratio)]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        il = max(1, round(input_len * rng.uniform(1 - ratio, 1 + ratio)))
        ol = max(1, round(output_len * rng.uniform(1 - ratio, 1 + ratio)))
        out.append(([rng.randrange(100, 20000) for _ in range(il)], ol))
    return out


def run_llm(args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict[str, float]:
    from pagebus import LLM, SamplingParams

    llm = LLM(
        args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
        kv_cache_dtype=args.kv_cache_dtype, quantization=getattr(args, "quantization", None),
    )  # fmt: skip
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids} for ids, _ in work[:2]], warm, use_tqdm=False)
    prompts = [{"prompt_token_ids": ids} for ids, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=ol, ignore_eos=True) for _, ol in work]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(ids) for ids, _ in work)
    return {
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(work) / elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "total_tokens_per_s": round((in_tokens + out_tokens) / elapsed, 2),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "steps": llm.engine.stats().num_steps,
    }


def run_batch(args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict[str, float]:
    """The same work through `pagebus run-batch` (JSONL, multi-process engine), as a subprocess; its
    time is the wall time of run-batch's own summary line, so engine start-up is left out."""
    with tempfile.TemporaryDirectory() as d:
        inp, out = os.path.join(d, "in.jsonl"), os.path.join(d, "out.jsonl")
        with open(inp, "w") as f:
            for ids, ol in work:
                line = {"prompt": ids, "max_tokens": ol, "temperature": 0, "ignore_eos": True}
                f.write(json.dumps(line) + "\n")
        cmd = [
            sys.executable,
            "-m",
            "pagebus.frontends.cli",
            "run-batch",
            "-i",
            inp,
            "-o",
            out,
            "--dtype",
            args.dtype,
        ]
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        cmd += ["--kv-cache-dtype", getattr(args, "kv_cache_dtype", "auto")]
        if getattr(args, "quantization", None):
            cmd += ["--quantization", args.quantization]
        if not getattr(args, "enable_prefix_caching", True):
            cmd += ["--no-enable-prefix-caching"]
        cmd += ["--max-inflight", str(args.max_inflight)] + (["--model", args.model] if args.model else [])
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        total = time.perf_counter() - t
        m = _SUMMARY.search(proc.stderr)
        if proc.returncode != 0 or m is None:
            raise RuntimeError(f"run-batch exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    ok, failed, in_tok, out_tok, wall = int(m[1]), int(m[2]), int(m[3]), int(m[4]), float(m[5])
    return {
        "elapsed_s": wall,
        "process_s": round(total, 3),  # with engine startup and shutdown
        "ok": ok,
        "failed": failed,
        "output_tokens_per_s": round(out_tok / wall, 2),
        "total_tokens_per_s": round((in_tok + out_tok) / wall, 2),
        "input_tokens": in_tok,
        "output_tokens": out_tok,
    }


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto", help="pagebus's --kv-cache-dtype")
    ap.add_argument("--quantization", default=None, help="pagebus's --quantization (e.g. fp16)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--paths", nargs="+", choices=["llm", "run-batch"], default=["llm", "run-batch"])
    ap.add_argument("--max-inflight", type=int, default=256, help="run-batch's --max-inflight")
    args = ap.parse_args()
    work = make_prompts(
        args.num_requests, args.input_len, args.output_len, args.random_range_ratio, args.seed
    )
    out: dict[str, object] = {"bench": "throughput", "config": {k: getattr(args, k) for k in vars(args)}}
    if "run-batch" in args.paths:  # first: its engine is gone before LLM loads
        batch = out["run_batch"] = run_batch(args, work)
        log.info("run-batch: %.1f output tok/s", batch["output_tokens_per_s"])
    if "llm" in args.paths:
        llm = out["llm_generate"] = run_llm(args, work)
        out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        log.info("LLM.generate: %.1f output tok/s", llm["output_tokens_per_s"])
    if "run-batch" in args.paths and "llm" in args.paths:
        out["ratio_run_batch_to_llm"] = round(batch["output_tokens_per_s"] / llm["output_tokens_per_s"], 3)
    emit(out)


if __name__ == "__main__":
    main()
