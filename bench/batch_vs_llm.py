"""Output tokens/s of `pagebus run-batch` (JSONL through the multi-process engine) vs `LLM.generate`.

    python -m bench.batch_vs_llm [--num-requests 500] [--input-len 32] [--output-len 32] [--dtype bfloat16]

The same requests both ways: random token-id prompts (fixed seed), greedy, ignore_eos. run-batch
runs first, as a subprocess (its engine is gone before LLM loads); its time is the wall time of its
own summary line, so engine startup is left out on both sides. LLM.generate gets a short warm-up.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from bench.common import emit, log, setup_logging
from bench.throughput import make_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SUMMARY = re.compile(r"(\d+) ok, (\d+) failed.*?(\d+) prompt \+ (\d+) output tokens in ([\d.]+)s")


def run_batch(args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        inp, out = os.path.join(d, "in.jsonl"), os.path.join(d, "out.jsonl")
        with open(inp, "w") as f:
            for ids, ol in work:
                line = {"prompt": ids, "max_tokens": ol, "temperature": 0, "ignore_eos": True}
                f.write(json.dumps(line) + "\n")
        cmd = [
            sys.executable,
            "-m",
            "frontends.cli",
            "run-batch",
            "-i",
            inp,
            "-o",
            out,
            "--dtype",
            args.dtype,
        ]
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
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


def run_llm(args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict[str, float]:
    from frontends import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens, seed=0)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids} for ids, _ in work[:2]], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=ol, ignore_eos=True) for _, ol in work]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in work], params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    out_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tok = sum(len(ids) for ids, _ in work)
    return {
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(out_tok / elapsed, 2),
        "total_tokens_per_s": round((in_tok + out_tok) / elapsed, 2),
        "input_tokens": in_tok,
        "output_tokens": out_tok,
    }


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=500)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-inflight", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    work = make_prompts(args.num_requests, args.input_len, args.output_len, 0.0, args.seed)
    batch = run_batch(args, work)
    log.info("run-batch: %.1f output tok/s", batch["output_tokens_per_s"])
    llm = run_llm(args, work)
    log.info("LLM.generate: %.1f output tok/s", llm["output_tokens_per_s"])
    emit({
        "bench": "batch_vs_llm",
        "config": {k: getattr(args, k) for k in vars(args)},
        "run_batch": batch,
        "llm_generate": llm,
        "ratio_output_tokens_per_s": round(batch["output_tokens_per_s"] / llm["output_tokens_per_s"], 3),
    })  # fmt: skip


if __name__ == "__main__":
    main()
