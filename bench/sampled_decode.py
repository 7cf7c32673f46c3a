"""What sampling costs a decode step: the engine's step time under each sampling mix against
greedy, in interleaved rounds on one loaded engine (LLM.generate, the default model).

    python -m bench.sampled_decode [--batch 1 32] [--prompt-len 128] [--new-tokens 64] [--rounds 3]

A round runs each mix twice, one new token and `--new-tokens`, so the difference is decode steps
alone (prefill and start cancel). Prompts are distinct token runs, so no prefix is shared.
The benchmark's other runs are greedy; a served request without `temperature` samples at
OpenAI's default of 1.0, so this is the step most users' requests take. Prints one JSON object:
ms per decode step for each mix, and its ratio to greedy's in the same round (median).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from pagebus.bus.messages import SamplingParams

from bench.common import cpu_flags, device_name, emit, git_sha, log, setup_logging

MIXES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature_1": {"temperature": 1.0},
    "temperature_0.8_top_p_0.95": {"temperature": 0.8, "top_p": 0.95},
    "temperature_0.8_top_k_40_top_p_0.95_min_p_0.05": {
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
    },
    "temperature_0.7_repetition_1.1": {"temperature": 0.7, "repetition_penalty": 1.1},
}


def step_ms(llm: Any, prompts: list[dict[str, list[int]]], mix: dict[str, Any], new_tokens: int) -> float:
    """Milliseconds per decode step: (time for new_tokens - time for 1) / (new_tokens - 1)."""
    times = []
    for n in (1, new_tokens):
        params = SamplingParams(max_tokens=n, ignore_eos=True, seed=0, **mix)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    return (times[1] - times[0]) / (new_tokens - 1) * 1e3


def main() -> int:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    args = ap.parse_args()
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (one step beyond the first token)")
    from pagebus.frontends.llm import LLM

    llm = LLM(dtype=args.dtype)
    results = []
    for batch in args.batch:
        prompts = [
            {"prompt_token_ids": [1000 + 7 * i + j for j in range(args.prompt_len)]} for i in range(batch)
        ]  # fmt: skip
        for mix in args.mixes:  # warm-up: every path built and touched once
            step_ms(llm, prompts, MIXES[mix], 3)
        ms: dict[str, list[float]] = {m: [] for m in args.mixes}
        for rnd in range(args.rounds):
            order = args.mixes if rnd % 2 == 0 else args.mixes[::-1]  # neither end always first
            for mix in order:
                ms[mix].append(step_ms(llm, prompts, MIXES[mix], args.new_tokens))
            log.info("batch %d round %d: %s", batch, rnd, {m: round(v[-1], 2) for m, v in ms.items()})
        row: dict[str, Any] = {
            "batch": batch,
            "ms_per_step": {m: round(statistics.median(v), 2) for m, v in ms.items()},
        }
        if "greedy" in ms:
            row["over_greedy"] = {
                m: round(statistics.median(a / g for a, g in zip(v, ms["greedy"], strict=True)), 3)
                for m, v in ms.items()
                if m != "greedy"
            }
        results.append(row)
    emit({
        "bench": "sampled_decode",
        "git_sha": git_sha(),
        "device": device_name(),
        "cpu_flags": cpu_flags(),
        "config": vars(args),
        "results": results,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
