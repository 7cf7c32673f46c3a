"""Time to first token with a long shared system prompt, prefix caching on vs off.

    python -m bench.prefix [--prefix-len 1000] [--num-requests 20] [--dtype auto]

Each request is the shared prefix plus a distinct short question, sent one at a time after
one warm-up request, so TTFT is the prefill cost alone. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import random
import time

from bench.common import emit, log, percentiles, setup_logging


def ttfts(
    caching: bool, args: argparse.Namespace, prefix: list[int], suffixes: list[list[int]]
) -> list[float]:
    from pagebus import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=caching, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(
        [{"prompt_token_ids": [*prefix, 7, 8, 9]}], params, use_tqdm=False
    )  # warm-up (fills the cache)
    out = []
    for s in suffixes:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prefix + s}], params, use_tqdm=False)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--suffix-len", type=int, default=20)
    ap.add_argument("--num-requests", type=int, default=20)
    args = ap.parse_args()
    rng = random.Random(0)
    prefix = [rng.randrange(100, 20000) for _ in range(args.prefix_len)]
    suffixes = [[rng.randrange(100, 20000) for _ in range(args.suffix_len)] for _ in range(args.num_requests)]
    on = percentiles(ttfts(True, args, prefix, suffixes))
    off = percentiles(ttfts(False, args, prefix, suffixes))
    log.info("TTFT p50: caching on %.3fs, off %.3fs", on["p50"], off["p50"])
    emit({
        "bench": "prefix",
        "config": vars(args),
        "ttft_s_caching_on": on,
        "ttft_s_caching_off": off,
        "speedup_p50": round(off["p50"] / on["p50"], 2),
    })  # fmt: skip


if __name__ == "__main__":
    main()
