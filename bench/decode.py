"""Decode speed of the in-process engine: single stream and N concurrent streams, per dtype.

    python -m bench.decode [--dtypes float32 bfloat16] [--concurrency 32] [--output-len 128]

Greedy, ignore_eos, fixed prompts; one warm-up generate per engine is excluded.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import time

from bench.common import emit, log, setup_logging


def _prompts(n: int, words: int) -> list[str]:
    vocab = [
        "river",
        "stone",
        "cloud",
        "lamp",
        "orange",
        "quiet",
        "seven",
        "garden",
        "music",
        "paper",
        "winter",
        "north",
    ]
    return [" ".join(vocab[(i * 5 + j) % len(vocab)] for j in range(words)) for i in range(n)]


def measure(
    dtype: str, concurrency: int, output_len: int, input_words: int, model: str | None
) -> dict[str, float]:
    from pagebus import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, seed=0)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(_prompts(2, input_words), SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    t = time.perf_counter()
    out = llm.generate(_prompts(1, input_words), params, use_tqdm=False)
    single_s = time.perf_counter() - t
    t = time.perf_counter()
    outs = llm.generate(_prompts(concurrency, input_words), params, use_tqdm=False)
    batch_s = time.perf_counter() - t
    n_single = len(out[0].outputs[0].token_ids)
    n_batch = sum(len(o.outputs[0].token_ids) for o in outs)
    log.info(
        "%s: single %.1f tok/s, %d concurrent %.1f tok/s",
        dtype,
        n_single / single_s,
        concurrency,
        n_batch / batch_s,
    )
    return {
        "load_s": round(load_s, 2),
        "single_stream_tok_s": round(n_single / single_s, 2),
        "concurrent_tok_s": round(n_batch / batch_s, 2),
        "single_stream_s": round(single_s, 3),
        "concurrent_s": round(batch_s, 3),
    }


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--input-words", type=int, default=64)
    args = ap.parse_args()
    results = {
        d: measure(d, args.concurrency, args.output_len, args.input_words, args.model) for d in args.dtypes
    }
    emit({
        "bench": "decode",
        "config": {"concurrency": args.concurrency, "output_len": args.output_len, "input_words": args.input_words, "model": args.model or "default"},
        "results": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()
