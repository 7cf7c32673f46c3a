"""Runs a ModelRunner under a real Scheduler with greedy token-id prompts (no tokenizer)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from pagebus.bus.messages import AddRequest, ExecuteBatch, SamplingParams
from pagebus.scheduler.scheduler import Scheduler
from pagebus.scheduler.virtual import VirtualEngines
from pagebus.workers.runner import ModelRunner


def drive_greedy(
    runner: ModelRunner, prompts: dict[str, tuple[list[int], int]], engines: int = 1, lookahead: bool = False
) -> tuple[dict[str, list[int]], Scheduler | VirtualEngines]:
    """prompts: request id -> (prompt ids, max_tokens). Returns each request's output ids and
    the scheduler (for its stats) once every request has finished. `engines` > 1: the virtual
    engines of a pipeline with steps in flight, whose plans carry the sampled tokens to earlier
    stages (here one step at a time: each stage's worker is the same either way). `lookahead`:
    async scheduling, each step planned before the previous step's result, as the scheduler
    process runs it."""
    sched: Scheduler | VirtualEngines = (
        VirtualEngines(runner.cfg, runner.num_blocks, runner.max_model_len, None, engines, hash_seed=b"t")
        if engines > 1
        else Scheduler(
            runner.cfg, runner.num_blocks, runner.max_model_len, None, hash_seed=b"t", lookahead=lookahead
        )
    )
    for rid, (ids, n) in prompts.items():
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        assert not sched.add_request(AddRequest(request_id=rid, prompt_token_ids=ids, params=params))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    in_flight: deque[ExecuteBatch] = deque()
    while sched.has_unfinished() or in_flight:
        while len(in_flight) < sched.max_in_flight and (planned := sched.schedule()) is not None:
            in_flight.append(planned)
        assert in_flight, "unfinished work but nothing scheduled"
        batch = in_flight.popleft()
        for u in sched.update(batch, runner.execute(batch)):
            out[u.request_id].extend(u.new_token_ids)
    return out, sched


def drive_greedy_seen(
    runner: ModelRunner, prompts: dict[str, tuple[list[int], int]], seen: Callable[[Any, torch.Tensor], None]
) -> dict[str, list[int]]:
    """drive_greedy, calling seen(forward_batch, logits) after every forward of the runner's model
    (every step then runs `forward` and takes logits, not the fused argmax: see
    ModelRunner.fused_greedy)."""
    forward: Callable[..., torch.Tensor] = runner.model.forward

    def spy(fb: Any) -> torch.Tensor:
        out = forward(fb)
        seen(fb, out)
        return out

    runner.model.forward = spy  # type: ignore[method-assign]
    runner.fused_greedy = False
    try:
        tokens, _ = drive_greedy(runner, prompts)
    finally:
        del runner.model.forward
        del runner.fused_greedy
    return tokens
