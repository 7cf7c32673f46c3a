"""Runs one ModelRunner per rank in spawned processes joined by gloo, drives the same greedy
requests through each rank's own Scheduler (deterministic, so every rank plans the same steps),
and returns what each rank saw. With pipeline_steps_in_flight > 1 only the last stage samples
(earlier stages learn the tokens from the next plan), so the result rank's BatchResult is
broadcast to every rank's schedulers here, standing in for the one scheduler a served engine has."""

from __future__ import annotations

import multiprocessing
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from bench.ports import free_port

TIMEOUT_S = 120.0


@dataclass
class RankResult:
    rank: int
    tokens: dict[str, list[int]] | None  # the greedy outputs this rank's runner produced
    logits: Any  # numpy array: prompt_logits of the first prompt (None before the last stage)
    weight_bytes: int  # parameter bytes the rank holds
    kv_heads: int  # KV heads in this rank's cache
    layers: list[int]  # decoder layers this rank holds
    error: str | None = None


def _rank_main(
    rank: int, tp: int, pp: int, port: int, path: str, cfg_kw: dict[str, Any], prompts: Any, q: Any
) -> None:
    torch.set_num_threads(1)  # 2 cores shared by every rank
    from pagebus.bus.config import EngineConfig
    from pagebus.workers.distributed.layout import Layout
    from pagebus.workers.distributed.state import init_distributed
    from pagebus.workers.runner import ModelRunner

    from tests.workers.drive import drive_greedy

    try:
        layout = Layout(tp, pp, rank)
        parallel = init_distributed(layout, "127.0.0.1", port, torch.device("cpu"))
        runner = ModelRunner(EngineConfig(**cfg_kw), path, rank, parallel)
        depth = cfg_kw.get("pipeline_steps_in_flight") or 1
        if depth > 1:
            execute = runner.execute

            def shared_result(batch: Any) -> Any:
                box = [execute(batch)]
                torch.distributed.broadcast_object_list(box, src=layout.result_rank)
                return box[0]

            runner.execute = shared_result  # type: ignore[method-assign]
        tokens = drive_greedy(runner, prompts, engines=depth)[0]
        first = next(iter(prompts.values()))[0]
        logits = runner.prompt_logits(first, list(range(1, 1 + -(-len(first) // runner.block_size))))
        held = [i for i in layout.layers(runner.model_config.num_layers)]
        nbytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        kv = runner.kv_caches[held[0]][0].shape[2]
        # numpy, not a tensor: a queued tensor is shared memory, gone when this process exits
        arr = None if logits is None else logits.numpy().copy()
        q.put(RankResult(rank, tokens, arr, nbytes, kv, held))
    except BaseException as e:
        q.put(RankResult(rank, None, None, 0, 0, [], f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(
    path: str, tp: int, pp: int, prompts: dict[str, tuple[list[int], int]], **cfg_kw: Any
) -> list[RankResult]:
    """Every rank's result, by rank; a rank that failed has `error` set."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    cfg = {"dtype": "float32", "num_kv_blocks": 64, "tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    cfg.update(cfg_kw)
    procs = [
        ctx.Process(target=_rank_main, args=(r, tp, pp, port, path, cfg, prompts, q), daemon=True)
        for r in range(tp * pp)
    ]
    for p in procs:
        p.start()
    try:
        out = [q.get(timeout=TIMEOUT_S) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return sorted(out, key=lambda r: r.rank)
