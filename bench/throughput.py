"""Offline throughput of the in-process engine (LLM.generate), vLLM-style.

    python -m bench.throughput [--num-requests 64] [--input-len 128] [--output-len 128]
        [--dtype auto] [--max-num-batched-tokens 2048] [--random-range-ratio 0]

Prompts are random token ids (fixed seed) so the input length is exact; greedy, ignore_eos.
A short warm-up generate is excluded. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import random
import resource
import time

from bench.common import emit, log, setup_logging


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
    from frontends import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens, seed=0)
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


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    work = make_prompts(
        args.num_requests, args.input_len, args.output_len, args.random_range_ratio, args.seed
    )
    result = run_llm(args, work)
    log.info("LLM.generate: %.1f output tok/s", result["output_tokens_per_s"])
    emit({
        "bench": "throughput",
        "config": {k: getattr(args, k) for k in vars(args)},
        "llm_generate": result,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    })  # fmt: skip


if __name__ == "__main__":
    main()
