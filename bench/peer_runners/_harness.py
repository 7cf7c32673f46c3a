"""The timing protocol every engine goes through, pagebus included, so the figures compare.

Stdlib only: it is imported by each peer's driver (inside that peer's venv) and by bench/peers.py.

Job (JSON on the driver's stdin):
    {"prompts": [[token ids], ...], "output_len": 128, "single_output_len": 128,
     "offline_sizes": [32, 64], "offline_repeats": 1, "single_prompt": [token ids], "modes": ["offline", "single"],
     "model": "/path", "options": {...engine specific...}}
Result (one JSON object on stdout): {"engine": ..., "load_s": ..., "offline": {...},
    "offline_by_size": {"32": {...}, "64": {...}}, "single": {...}}   ("offline": the first size)

- offline: for each size n, the first n prompts submitted at once, greedy, ignore EOS, output_len
  new tokens each. output_tokens_per_s = output tokens / wall time of the whole batch (prefill
  included); with "offline_repeats": k in the job, the batch is timed k times (other prompts each
  time) and the median run kept, every run listed.
- single: single_prompt (default: the first prompt) alone. Timed once with 1 new token (prefill +
  first token) and SINGLE_REPEATS times with single_output_len (the median kept, every run
  listed); decode_tokens_per_s = (n - 1) / (t_n - t_1) excludes the prefill without needing a
  streaming API from every engine.
Each mode is warmed up first with the same batch shape and 4 new tokens (excluded).
Every run gets prompts no earlier run has seen (the token ids shifted, see offline_plan), so an
engine's prefix cache cannot skip a prefill it did in the warm-up; engines are also told to turn
theirs off.

Interactive ("interactive": true in the job): the driver loads, prints one line ({"engine",
"version", "load_s"} or {"error"}), then answers one command a line on stdin, {"prompts": [...],
"max_tokens": n}, with one line {"elapsed_s", "counts"} (or {"error"}), until stdin closes. The
caller (bench/interleave.py) then composes the runs above itself, one engine's run after another's.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# generate(prompts, max_new_tokens) -> number of new tokens produced for each prompt
Generate = Callable[[list[list[int]], int], list[int]]

WARMUP_TOKENS = 4
# The single stream is timed this many times and the median kept: one ~1 s run on these shared
# 2-vCPU machines swings 10-20% from the next, more than the differences being measured.
SINGLE_REPEATS = 3


def variant(prompts: list[list[int]], k: int) -> list[list[int]]:
    """The same lengths, other ids: variant k of the prompts (k=0 is the original).

    make_prompts draws ids from [100, 20000); shifting within that range keeps them ordinary tokens.
    """
    return [[100 + (t - 100 + 997 * k) % 19900 for t in p] for p in prompts]


def offline_plan(sizes: list[int], repeats: int = 1) -> list[tuple[int, int, list[int]]]:
    """(size, warm-up variant, timed variants) per offline size: one variant per timed repeat.
    Variants 2-4 and 40-99 are the single stream's; the first repeat of size i keeps variant
    6 + 2i, its other repeats-1 take their own run from 100 on, so no two runs share prompts.
    The timed prompts are what bench/peers.py also sends through run-batch."""
    if repeats < 1:
        raise ValueError(f"offline repeats must be at least 1, got {repeats}")
    extra = repeats - 1
    return [
        (n, 5 + 2 * i, [6 + 2 * i] + [100 + i * extra + r for r in range(extra)]) for i, n in enumerate(sizes)
    ]


def single_plan(rounds: int) -> tuple[int, list[tuple[int, int]]]:
    """The single stream's variants when it is timed in `rounds` rounds: (warm-up, [(first-token
    run, timed run) a round]). Round 0 keeps measure_single's 3 and 4; later rounds take pairs from
    42 on, inside the single stream's 40-99, so at most 29 rounds."""
    if not 1 <= rounds <= 29:
        raise ValueError(f"single stream rounds must be 1-29, got {rounds}")
    return 2, [(3, 4)] + [(40 + 2 * r, 41 + 2 * r) for r in range(1, rounds)]


def _timed(generate: Generate, prompts: list[list[int]], n: int) -> tuple[float, list[int]]:
    t = time.perf_counter()
    counts = generate(prompts, n)
    return time.perf_counter() - t, counts


def measure_offline(
    generate: Generate,
    prompts: list[list[int]],
    output_len: int,
    warm: int = 1,
    timed: list[int] | None = None,
) -> dict[str, Any]:
    generate(variant(prompts, warm), WARMUP_TOKENS)
    runs = [_timed(generate, variant(prompts, v), output_len) for v in timed or [0]]
    return offline_result(prompts, [t for t, _ in runs], sum(runs[0][1]))


def offline_result(prompts: list[list[int]], elapsed: list[float], out: int) -> dict[str, Any]:
    """One size's offline figures from its timed runs: the median run's, with every run listed."""
    tn = statistics.median(elapsed)
    return {
        "requests": len(prompts),
        "input_tokens": sum(len(p) for p in prompts),
        "output_tokens": out,
        "elapsed_s": round(tn, 3),
        "elapsed_runs_s": [round(t, 3) for t in elapsed],
        "output_tokens_per_s": round(out / tn, 2),
    }


def measure_single(
    generate: Generate, prompt: list[int], output_len: int, repeats: int = SINGLE_REPEATS
) -> dict[str, Any]:
    # Variants 2-4 (then 40 on for the repeats): the offline run has already seen the original prompt.
    generate(variant([prompt], 2), WARMUP_TOKENS)
    t1, _ = _timed(generate, variant([prompt], 3), 1)
    runs = [_timed(generate, variant([prompt], 4 if i == 0 else 40 + i), output_len) for i in range(repeats)]
    tn = statistics.median(t for t, _ in runs)
    out = runs[0][1][0]
    decode_s = tn - t1
    return {
        "input_tokens": len(prompt),
        "output_tokens": out,
        "elapsed_s": round(tn, 3),
        "elapsed_runs_s": [round(t, 3) for t, _ in runs],
        "first_token_s": round(t1, 4),
        "output_tokens_per_s": round(out / tn, 2),
        # A noisy machine can make t_n - t_1 tiny or negative for very short outputs; report None.
        "decode_tokens_per_s": round((out - 1) / decode_s, 2) if out > 1 and decode_s > 0 else None,
    }


def measure(job: dict[str, Any], generate: Generate) -> dict[str, Any]:
    result: dict[str, Any] = {}
    modes = job.get("modes", ["offline", "single"])
    if "offline" in modes:
        sizes = job.get("offline_sizes") or [len(job["prompts"])]
        by_size = {
            str(n): measure_offline(generate, job["prompts"][:n], job["output_len"], warm, timed)
            for n, warm, timed in offline_plan(sizes, job.get("offline_repeats", 1))
        }
        result["offline"] = by_size[str(sizes[0])]
        result["offline_by_size"] = by_size
    if "single" in modes:
        n = job.get("single_output_len", job["output_len"])
        result["single"] = measure_single(generate, job.get("single_prompt") or job["prompts"][0], n)
    return result


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve_commands(generate: Generate) -> None:
    """Interactive mode after the load: one timed generate a command line, until stdin closes."""
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            t, counts = _timed(generate, cmd["prompts"], int(cmd["max_tokens"]))
            _say({"elapsed_s": t, "counts": counts})
        except Exception as e:  # the caller drops this engine from the later runs
            traceback.print_exc()
            _say({"error": f"{type(e).__name__}: {e}"})


def run_driver(engine: str, version: str, load: Callable[[dict[str, Any]], Generate]) -> None:
    """A peer driver's main: the job (one line) from stdin, one JSON result on stdout, errors as
    JSON too; in interactive mode the load's line, then serve_commands."""
    job = json.loads(sys.stdin.readline())
    try:
        t = time.perf_counter()
        generate = load(job)
        result: dict[str, Any] = {
            "engine": engine,
            "version": version,
            "load_s": round(time.perf_counter() - t, 2),
        }
        if job.get("interactive"):
            _say(result)
            serve_commands(generate)
            return
        result |= measure(job, generate)
    except Exception as e:  # the caller records the error and goes on with the other peers
        traceback.print_exc()
        result = {"engine": engine, "error": f"{type(e).__name__}: {e}"}
    _say(result)
