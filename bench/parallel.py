"""Tensor and pipeline parallelism: output tok/s and start-up time per layout, and the cost of one
all-reduce at the model's hidden size. Prints ONE JSON object; logs to stderr.

    python -m bench.parallel [--layouts 1x1 2x1 1x2 1x2:2 --requests 8 --output-len 32]

A layout is TPxPP, or TPxPP:D for D pipeline steps in flight (pipeline_steps_in_flight; without
it the engine's default: PP on GPUs, 1 on CPUs), so `1x2:1 1x2:2` is the depth A/B, interleaved. Each layout starts the multi-process engine (one worker process per rank),
warms it with one request, then times `generate` on the same greedy requests; the outputs of
every layout must equal the first layout's. The all-reduce timing runs two gloo ranks on the
loopback (NCCL ranks on CUDA when two GPUs exist) reducing [rows, hidden] float32 tensors, the
shape every row-parallel layer reduces: 2 per decoder layer per step.

Each worker's busy fraction (per pipeline stage: 1 - it is the bubble) comes from its main
thread's /proc schedstat over the timed run: time on a CPU / (wall time - time it was runnable
but waiting for a CPU). A rank waiting for a peer or for the next step sleeps in a socket read,
and the time other processes held the cores is taken out, so on a loaded machine it still says
how much of the time the stage had work (with one torch thread per worker, which computes on the
main thread). The raw CPU / wall is reported beside it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from typing import Any

from bench.common import emit, log, setup_logging
from bench.ports import free_port

HIDDEN = 576  # SmolLM2-135M


def _allreduce_rank(rank: int, port: int, rows: list[int], iters: int, q: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = torch.cuda.device_count() >= 2
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    out = {}
    for n in rows:
        x = torch.ones(n, HIDDEN, device=dev)
        for _ in range(max(10, iters // 10)):  # warm-up: connections, allocator
            dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize(dev)
        out[str(n)] = (time.perf_counter() - t0) / iters * 1e6
    if rank == 0:
        q.put({"backend": "nccl" if cuda else "gloo", "us_per_allreduce_by_rows": out})
    dist.destroy_process_group()


def allreduce_cost(rows: list[int], iters: int) -> dict[str, Any]:
    port = free_port()  # the rendezvous
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, rows, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    res: dict[str, Any] = q.get(timeout=300)
    for p in procs:
        p.join(30)
    return res


def _workers() -> list[int]:
    """The pids of this process's engine workers (`pagebus::worker-<rank>`), by rank."""
    import psutil

    found = {}
    for p in psutil.Process().children(recursive=True):
        title = " ".join(p.cmdline())
        if "pagebus::worker-" in title:
            found[int(title.split("pagebus::worker-")[1].split()[0])] = p.pid
    return [found[r] for r in sorted(found)]


def _schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of the process's main thread."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        run_ns, wait_ns, _ = (int(x) for x in f.read().split())
    return run_ns / 1e9, wait_ns / 1e9


def parse_layout(spec: str) -> tuple[int, int, int | None]:
    """(tp, pp, steps in flight or None for the default) of "TPxPP" or "TPxPP:D"."""
    shape, _, depth = spec.partition(":")
    tp, _, pp = shape.partition("x")
    try:
        return int(tp), int(pp), int(depth) if depth else None
    except ValueError:
        raise SystemExit(f"layout {spec!r}: expected TPxPP or TPxPP:D, e.g. 2x1 or 1x2:2") from None


def layout_run(
    tp: int, pp: int, depth: int | None, prompts: list[list[int]], output_len: int, num_threads: int | None
) -> tuple[dict[str, Any], list[list[int]]]:
    from pagebus import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(
        dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp, multiprocess=True, seed=0,
        num_threads=num_threads, pipeline_steps_in_flight=depth,
    )  # fmt: skip
    startup = time.monotonic() - t0
    try:
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, temperature=0))  # warm
        workers = _workers()
        before = [_schedstat(w) for w in workers]
        t0 = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        wall = time.monotonic() - t0
        spent = [
            (r1 - r0, q1 - q0) for (r0, q0), (r1, q1) in zip(before, map(_schedstat, workers), strict=True)
        ]
        busy = [round(run / (wall - queued), 3) for run, queued in spent]
        cpu_share = [round(run / wall, 3) for run, _ in spent]
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(len(t) for t in tokens)
    row = {
        "tp": tp,
        "pp": pp,
        "steps_in_flight": depth if depth is not None else "auto",
        "startup_s": round(startup, 1),
        "output_tok_s": round(n / wall, 2),
        "wall_s": round(wall, 2),
        "worker_busy_fraction": busy,  # by rank: on-CPU s / (wall s - s waiting for a CPU)
        "worker_cpu_share": cpu_share,  # by rank: on-CPU s / wall s
    }
    log.info("layout %dx%d depth %s: %s", tp, pp, depth or "auto", row)
    return row, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--layouts", nargs="+", default=["1x1", "2x1", "1x2"], help="TPxPP[:D], D = pipeline steps in flight"
    )
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--allreduce-rows", type=int, nargs="+", default=[1, 8, 32, 256])
    ap.add_argument("--allreduce-iters", type=int, default=500)
    ap.add_argument(
        "--rounds", type=int, default=2, help="layouts run in turn this many times (load spikes hit all)"
    )
    ap.add_argument(
        "--num-threads", type=int, default=None, help="torch threads per worker (default: cores / ranks)"
    )
    args = ap.parse_args()
    setup_logging()
    comm = allreduce_cost(args.allreduce_rows, args.allreduce_iters)
    log.info("all-reduce: %s", comm)
    prompts = [[(7 * i + 13 * j) % 30000 + 100 for j in range(args.input_len)] for i in range(args.requests)]
    rows, first = [], None
    for rnd in range(args.rounds):
        for spec in args.layouts:
            tp, pp, depth = parse_layout(spec)
            row, tokens = layout_run(tp, pp, depth, prompts, args.output_len, args.num_threads)
            if first is None:
                first = tokens
            row["round"] = rnd
            row["outputs_equal_first_layout"] = tokens == first
            rows.append(row)
    emit(
        {
            "bench": "parallel",
            "requests": args.requests,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "hidden_size": HIDDEN,
            "num_threads": args.num_threads,
            "allreduce": comm,
            "layouts": rows,
        }
    )


if __name__ == "__main__":
    main()
