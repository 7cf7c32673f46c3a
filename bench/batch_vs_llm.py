"""Output tokens/s of `pagebus run-batch` vs `LLM.generate` on the same 500 short requests: a preset
of bench.throughput (both paths), kept for the batch issue's acceptance figure.

    python -m bench.batch_vs_llm [--num-requests 500] [--input-len 32] [--output-len 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

from bench.common import emit, setup_logging
from bench.throughput import make_prompts, run_batch, run_llm


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
    batch = run_batch(args, work)  # first: its engine is gone before LLM loads
    llm = run_llm(args, work)
    emit({
        "bench": "batch_vs_llm",
        "config": {k: getattr(args, k) for k in vars(args)},
        "run_batch": batch,
        "llm_generate": llm,
        "ratio_output_tokens_per_s": round(batch["output_tokens_per_s"] / llm["output_tokens_per_s"], 3),
    })  # fmt: skip


if __name__ == "__main__":
    main()
