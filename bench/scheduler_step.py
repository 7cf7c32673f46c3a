"""The scheduler's own CPU time per step (schedule + update) at N running decodes, with no
model: a fake worker answers instantly. It must stay far below a model step.

    python -m bench.scheduler_step [--num-seqs 256] [--steps 1000]
"""

from __future__ import annotations

import argparse
import time

from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import AddRequest, BatchResult, SamplingParams
from pagebus.scheduler.scheduler import Scheduler

from bench.common import emit, setup_logging


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    cfg = EngineConfig(max_num_seqs=args.num_seqs, max_num_batched_tokens=max(2048, args.num_seqs))
    sched = Scheduler(cfg, num_blocks=args.num_seqs * 128, max_model_len=8192, eos_token_id=None)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 1000, ignore_eos=True)
    for i in range(args.num_seqs):
        prompt = [(i * 31 + j) % 30000 + 3 for j in range(args.prompt_len)]
        sched.add_request(AddRequest(request_id=str(i), prompt_token_ids=prompt, params=params))

    def step() -> None:
        batch = sched.schedule()
        assert batch is not None
        ids = [s.seq_id for s in (*batch.new_seqs, *batch.cached_seqs)]
        sched.update(batch, BatchResult(step_id=batch.step_id, seq_ids=ids, token_ids=[5] * len(ids)))

    while sched.stats().num_running < args.num_seqs or sched.stats().num_waiting:  # admit every prompt
        step()
    t = time.process_time()
    for _ in range(args.steps):
        step()
    per_step = (time.process_time() - t) / args.steps
    emit({
        "bench": "scheduler_step",
        "config": vars(args),
        "cpu_ms_per_step": round(per_step * 1e3, 4),
        "cpu_us_per_seq_per_step": round(per_step * 1e6 / args.num_seqs, 3),
    })  # fmt: skip


if __name__ == "__main__":
    main()
