"""A change to the engine's own step path, on and off alternating step by step in one process.

    python -m bench.step_ab --variant greedy_decoder [--rounds 16] [--requests 1] [--control]

One `LLM` (bf16 where the CPU has AVX-512 BF16, else float32) generates `--requests` prompts of
32 tokens x 128 new ones, `--rounds` times; the variant's path flips at every engine step, and
each step's wall time (one `step()` start to the next) is filed under the path it ran. The two
paths then share every drift of the machine (this VM's memory speed flips between levels ~30%
apart from one few seconds to the next, far more than the ~1% a change to the step's Python
moves), so a pair of neighbouring steps compares them. `--control` flips nothing: the spread of
its ratio is what these rounds cannot tell from noise. Prints one JSON object: the median step
time of each path, old / new paired over neighbouring steps, and whether the tokens match.

Variants (each turns the new path off by swapping one function back):
- greedy_decoder: a plain-greedy decode step as one native call (runner `_greedy_step`) against
  the model's `forward` with the decode stack's tail.
- stack_tail: the decode stack ending with the final norm and the head's argmax against the
  row gather, norm and head from Python (the greedy decoder off in both).
- kept_views: a decode step's input views kept by size against made every step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from pagebus.bus.messages import SamplingParams
from pagebus.frontends.llm import LLM
from pagebus.workers.models import llama

from bench.common import cpu_flags, emit, log, setup_logging

Toggle = Callable[[bool], None]


def _greedy_decoder(llm: Any) -> Toggle:
    runner = llm.engine.runner
    new = runner._greedy_step

    def toggle(on: bool) -> None:
        runner._greedy_step = new if on else (lambda step: None)

    return toggle


def _stack_tail(llm: Any) -> Toggle:
    _greedy_decoder(llm)(False)
    new = llama.Model._stack_tail

    def toggle(on: bool) -> None:
        llama.Model._stack_tail = new if on else (lambda self, fb, x, stack: 0)  # type: ignore[method-assign]

    return toggle


def _kept_views(llm: Any) -> Toggle:
    inputs = llm.engine.runner.inputs
    new = inputs.views

    def toggle(on: bool) -> None:
        inputs.views = new if on else inputs._views

    return toggle


VARIANTS: dict[str, Callable[[Any], Toggle]] = {
    "greedy_decoder": _greedy_decoder,
    "stack_tail": _stack_tail,
    "kept_views": _kept_views,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--control", action="store_true", help="flip nothing (the harness's own spread)")
    args = ap.parse_args()
    setup_logging()
    flags = cpu_flags()
    dtype = "bfloat16" if "avx512_bf16" in flags else "float32"
    llm = LLM(dtype=dtype)
    params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0)
    prompts = [[1000 + 37 * i + j for j in range(32)] for i in range(args.requests)]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    toggle = VARIANTS[args.variant](llm)
    engine, step = llm.engine, llm.engine.step
    marks: list[tuple[float, bool]] = []
    count = [0]

    def flipping_step() -> Any:
        count[0] += 1
        on = count[0] % 2 == 0
        if not args.control:
            toggle(on)
        marks.append((time.perf_counter(), on))
        return step()

    engine.step = flipping_step
    times: dict[bool, list[float]] = {True: [], False: []}
    pairs: list[float] = []
    tokens: dict[bool, list[list[int]]] = {}
    for r in range(args.rounds):
        marks.clear()
        count[0] = r % 2
        out = llm.generate(prompts, params, use_tqdm=False)
        tokens.setdefault(r % 2 == 0, [o.outputs[0].token_ids for o in out])
        # the first steps hold the prefill, the last one the final token's bookkeeping
        steps = [(marks[i + 1][0] - marks[i][0], marks[i][1]) for i in range(2, len(marks) - 1)]
        for dt, on in steps:
            times[on].append(dt)
        for a, b in zip(steps[::2], steps[1::2], strict=False):
            new, old = (a, b) if a[1] else (b, a)
            pairs.append(old[0] / new[0])
        log.info("round %d: %d steps", r + 1, len(steps))
    toggle(True)
    q = statistics.quantiles(pairs, n=4)
    emit(
        {
            "bench": "step_ab",
            "cpu_flags": flags,
            "torch_threads": torch.get_num_threads(),
            "dtype": dtype,
            "variant": args.variant,
            "control": args.control,
            "requests": args.requests,
            "rounds": args.rounds,
            "new_step_ms_median": round(statistics.median(times[True]) * 1e3, 4),
            "old_step_ms_median": round(statistics.median(times[False]) * 1e3, 4),
            "old_over_new_paired_median": round(statistics.median(pairs), 4),
            "paired_quartiles": [round(x, 4) for x in (q[0], q[2])],
            "pairs": len(pairs),
            "same_tokens": tokens.get(True) == tokens.get(False),
        }
    )


if __name__ == "__main__":
    main()
