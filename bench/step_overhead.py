"""CPU time a decode step spends outside the matmuls, per backend (torch vs cpu).

    python -m bench.step_overhead [--batch 1 32] [--steps 64] [--backends torch cpu] [--dtype float32]

A model with SmolLM2-135M's depth (30 layers) and head structure but 64-wide layers, random
weights: its matmuls cost next to nothing, so a step's CPU time is the ops' dispatch and the
runner's own work, the part that does not shrink with faster GEMMs. One thread; thread CPU
time, so other load on the machine inflates it less than wall time. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import AddRequest, SamplingParams
from pagebus.scheduler.scheduler import Scheduler
from pagebus.workers.runner import ModelRunner

from bench.common import cpu_flags, emit, log, setup_logging
from bench.gpu_e2e import write_llama_config

SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=2048,
    rope_theta=100000.0,
)


def decode_step_times(runner: ModelRunner, batch: int, steps: int, prompt_len: int = 32) -> list[float]:
    """Thread CPU seconds of each decode-only step (every sequence, one token) of `batch`
    greedy sequences of `prompt_len`-token prompts, `steps` of them each."""
    sched = Scheduler(runner.cfg, runner.num_blocks, runner.max_model_len, None, hash_seed=b"b")
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        ids = [(7 * i + j) % 500 + 3 for j in range(prompt_len)]
        sched.add_request(AddRequest(request_id=f"r{i}", prompt_token_ids=ids, params=params))
    times: list[float] = []
    while sched.has_unfinished():
        b = sched.schedule()
        assert b is not None
        t = time.thread_time()
        result = runner.execute(b)
        if not b.new_seqs and len(b.cached_seqs) == batch:
            times.append(time.thread_time() - t)
        sched.update(b, result)
    return times


def measure(backend: str, batch: int, steps: int, prompt_len: int, dtype: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        write_llama_config(d, SHAPE)
        cfg = EngineConfig(
            model=d, load_format="dummy", dtype=dtype, num_kv_blocks=1024, attention_backend=backend
        )
        runner = ModelRunner(cfg, d)
    times = sorted(decode_step_times(runner, batch, steps, prompt_len))
    median = times[len(times) // 2]
    log.info(
        "%s, batch %d: %.2f ms CPU per decode step (median of %d)", backend, batch, median * 1e3, len(times)
    )
    return {"ms_per_step_median": round(median * 1e3, 3), "ms_per_step_min": round(times[0] * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--backends", nargs="+", default=["torch", "cpu"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    setup_logging()
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for batch in args.batch:
        for backend in args.backends:
            results[f"{backend}_b{batch}"] = measure(backend, batch, args.steps, args.prompt_len, args.dtype)
    emit(
        {
            "bench": "step_overhead",
            "cpu_flags": cpu_flags(),
            "threads": 1,
            "dtype": args.dtype,
            "shape": SHAPE,
            "results": results,
        }
    )


if __name__ == "__main__":
    main()
