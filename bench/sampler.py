"""The sampler's cost per row: the batched device sampler against the per-row host sampler it
replaced (workers/sampling.py at --baseline, loaded from git), interleaved call by call on the
same logits, in alternating order, so machine load and warm caches favour neither.

    python -m bench.sampler [--batch-sizes 1 32 256] [--vocab 49152] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from pagebus.bus.messages import SamplingParams
from pagebus.workers import sampling

from bench.common import cpu_flags, emit, log, setup_logging

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "01cb25c"  # the last commit with the per-row host sampler

MIXES: dict[str, list[SamplingParams]] = {
    "greedy": [SamplingParams(temperature=0.0)],
    "random": [SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, seed=1)],
    "top_k_top_p": [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=2)],
    "top_p": [SamplingParams(temperature=0.8, top_p=0.9)],
    "min_p": [SamplingParams(temperature=0.8, min_p=0.05, seed=3)],
    "penalties": [
        SamplingParams(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
    ],
    "mixed": [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=4),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.95),
        SamplingParams(temperature=0.8, frequency_penalty=0.5, logprobs=5),
    ],
}


def load_baseline(rev: str) -> ModuleType | None:
    try:
        src = subprocess.run(
            ["git", "show", f"{rev}:workers/sampling.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("no baseline sampler at %s: %s", rev, e)
        return None
    path = Path(tempfile.mkdtemp()) / "baseline_sampling.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("baseline_sampling", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def make_rows(row_cls: Any, mix: list[SamplingParams], num: int, vocab: int, rng: random.Random) -> list[Any]:
    rows = []
    for i in range(num):
        prompt = [rng.randrange(vocab) for _ in range(200)]
        output = [rng.randrange(vocab) for _ in range(50)]
        rows.append(row_cls(mix[i % len(mix)], prompt, output, 0, (2,)))
    return rows


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared box)")
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the old sampler; '' skips it")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    old_mod = load_baseline(args.baseline) if args.baseline else None
    rng = random.Random(0)
    results = []
    for mix in args.mixes:
        for num in args.batch_sizes:
            g = torch.Generator().manual_seed(num)
            logits = torch.randn(num, args.vocab, generator=g) * 4
            new_s, new_rows = (
                sampling.Sampler(0),
                make_rows(sampling.SampleRow, MIXES[mix], num, args.vocab, rng),
            )
            impls: dict[str, tuple[Any, list[Any]]] = {"new": (new_s, new_rows)}
            if old_mod is not None:
                old_rows = [
                    old_mod.SampleRow(r.params, r.prompt_ids, r.output_ids, 0, r.stop_ids) for r in new_rows
                ]
                impls["old"] = (old_mod.Sampler(0), old_rows)
            times: dict[str, list[float]] = {k: [] for k in impls}
            for rep in range(args.repeats + 1):  # the first call of each warms up
                order = list(impls.items())
                for name, (s, rows) in order if rep % 2 else order[::-1]:  # neither always goes first
                    t = time.perf_counter()
                    tokens, _ = s(logits, rows)
                    if rep:
                        times[name].append(time.perf_counter() - t)
                    assert len(tokens) == num
            r: dict[str, Any] = {"mix": mix, "rows": num}
            for name, ts in times.items():
                r[f"{name}_us_per_row"] = round(statistics.median(ts) * 1e6 / num, 1)
            if "old" in times:
                r["speedup"] = round(statistics.median(times["old"]) / statistics.median(times["new"]), 2)
            log.info("%s", r)
            results.append(r)
    emit({
        "bench": "sampler",
        "torch": torch.__version__,
        "cpu_flags": cpu_flags(),
        "threads": args.threads,
        "config": vars(args),
        "results": results,
    })  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
