"""The worker process: a thin loop around ModelRunner.

Hello -> load the model -> Ready(model facts) -> read ExecuteBatch from the scheduler's shm ring ->
execute -> the result rank (tp rank 0 of the last pipeline stage) sends BatchResult back over ZMQ.
With tensor/pipeline parallelism every rank reads the same step plan from the ring and runs its
part of the model; the ranks meet in torch.distributed collectives (workers/distributed/). Shutdown on the ring ends it with exit 0; any
exception exits non-zero after saying why (with linger, so it leaves): StartupFailed on the
handshake channel before Ready, WorkerFailed on the results channel after.

Spawned by the scheduler process (its parent), which watches this process's sentinel.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
from pagebus.bus.codec import Codec, unpack_frames
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import (
    PROTOCOL_VERSION,
    BatchResult,
    ExecuteBatch,
    Hello,
    ModelFacts,
    Ready,
    Shutdown,
    StartupFailed,
    ToWorker,
    WorkerFailed,
)
from pagebus.bus.nodes import StepSubscriber, local_ranks
from pagebus.bus.proc import freeze_heap
from pagebus.bus.shm import RingHandle, ShmRingReader
from pagebus.bus.sockets import Channel, make_socket

if TYPE_CHECKING:
    from pagebus.workers.runner import ModelRunner

log = logging.getLogger(__name__)

ROLE = "worker"
LINGER_MS = 2_000  # the last message (StartupFailed, WorkerFailed) must get out before the process exits


def worker_main(
    cfg_bytes: bytes,
    model_path: str,
    rank: int,
    ring: bytes,
    handshake_ep: str,
    out_ep: str,
    dist_addr: str = "127.0.0.1",
    dist_port: int = 0,
    steps_ep: str = "",
    device_index: int | None = None,
) -> None:
    """Entry point (module level so `bus.proc.spawn` can import it). A worker on another node than
    the scheduler's gets no ring but `steps_ep`, the head's step broadcast (bus/nodes.py), and so
    does a Ray actor, which also gets `device_index` 0 (Ray shows each actor only its own GPU);
    None: the rank's index among its node's ranks."""
    cfg = msgspec.msgpack.decode(cfg_bytes, type=EngineConfig)
    ctx: zmq.Context[Any] = zmq.Context()
    hs = Channel(make_socket(ctx, zmq.PUSH, handshake_ep, bind=False, linger_ms=LINGER_MS))
    out = Channel(make_socket(ctx, zmq.PUSH, out_ep, bind=False, linger_ms=LINGER_MS))
    code = 0
    runner: ModelRunner | None = None  # set once the model is loaded and Ready is sent
    reader: ShmRingReader | StepSubscriber | None = None
    try:
        # Subscribed before loading: the head sends its first step only after every Ready.
        reader = (
            StepSubscriber(ctx, steps_ep)
            if steps_ep
            else ShmRingReader(msgspec.msgpack.decode(ring, type=RingHandle), rank - local_ranks(cfg).start)
        )
        hs.send(Hello(version=PROTOCOL_VERSION, role=ROLE, rank=rank, pid=os.getpid()))
        runner = _load(cfg, model_path, rank, hs, dist_addr, dist_port, device_index)
        _serve(runner, rank, reader, out)
    except BaseException as e:  # report every failure, then exit non-zero
        log.error("worker %d failed:\n%s", rank, traceback.format_exc())
        reason = f"{type(e).__name__}: {e}"
        try:
            if runner is not None:
                out.send(WorkerFailed(rank=rank, reason=reason), timeout_s=1.0)
            else:
                msg = f"{ROLE}-{rank} failed during start-up: {reason}"
                hs.send(StartupFailed(role=ROLE, rank=rank, reason=msg), timeout_s=1.0)
        except Exception:
            log.exception("could not report the failure")
        code = 1
    finally:
        if reader is not None:
            reader.close()
        hs.close()
        out.close()
        ctx.term()
    if code:
        raise SystemExit(code)


def _load(
    cfg: EngineConfig,
    model_path: str,
    rank: int,
    hs: Channel,
    dist_addr: str,
    dist_port: int,
    device_index: int | None,
) -> ModelRunner:
    """Join the process group, load this rank's part of the model and size its KV cache, then
    send Ready with what that found."""
    # Heavy import here, after Hello: the parent learns at once that the process started.
    t0 = time.monotonic()
    import torch
    from pagebus.workers.device import pick_device
    from pagebus.workers.distributed.layout import Layout
    from pagebus.workers.distributed.state import init_distributed
    from pagebus.workers.runner import ModelRunner

    imports = time.monotonic() - t0
    layout = Layout(cfg.tensor_parallel_size, cfg.pipeline_parallel_size, rank)
    node_ranks = local_ranks(cfg)
    local = rank - node_ranks.start if device_index is None else device_index  # this node's GPU index
    device = pick_device(cfg, local)
    if layout.world_size > 1 and cfg.num_threads is None and device.type == "cpu":
        # Ranks on one CPU share its cores; more threads than cores makes every step wait for
        # the slowest preempted thread, in every collective.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(node_ranks)))
    parallel = init_distributed(layout, dist_addr, dist_port, device)
    runner = ModelRunner(cfg, model_path, local, parallel)  # sets torch threads from cfg.num_threads
    _log_layout(runner)
    facts = ModelFacts(
        num_kv_blocks=runner.num_blocks,
        max_model_len=runner.max_model_len,
        vocab_size=runner.model_config.vocab_size,
        eos_token_id=runner.eos_token_id,
        dtype=str(runner.dtype).removeprefix("torch."),
        device=str(runner.device),
        num_threads=torch.get_num_threads(),
        startup_phases={"imports": imports, **runner.startup_phases},
    )
    freeze_heap()
    hs.send(Ready(role=ROLE, rank=rank, model=facts))
    return runner


def _log_layout(runner: ModelRunner) -> None:
    """What this rank holds, one line per rank at start-up (tests read the weight bytes)."""
    from pagebus.workers.distributed.layout import split_heads

    mc, lay = runner.model_config, runner.parallel.layout
    layers = lay.layers(mc.num_layers)
    h = split_heads(mc.num_heads, mc.num_kv_heads, lay.tp_size, lay.tp_rank)
    tensors = {id(t): t for t in [*runner.model.parameters(), *runner.model.buffers()]}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    log.info(
        "layout: %s on %s: layers %d-%d of %d, attention heads %d-%d of %d, KV heads %d-%d of %d, "
        "weight bytes %d (%.1f MiB)",
        lay.describe(), runner.device, layers.start, layers.stop - 1, mc.num_layers, h.q_start,
        h.q_start + h.num_q - 1, mc.num_heads, h.kv_start, h.kv_start + h.num_kv - 1, mc.num_kv_heads,
        nbytes, nbytes / (1 << 20),
    )  # fmt: skip


def _serve(runner: ModelRunner, rank: int, reader: ShmRingReader | StepSubscriber, out: Channel) -> None:
    # The ring blocks on a wake-up when idle: no spinning beyond spin_s.
    codec = Codec()
    while True:
        msg = codec.decode(unpack_frames(reader.read()), ToWorker)
        match msg:
            case ExecuteBatch():
                result: BatchResult = runner.execute(msg)  # the model's forward is inference_mode
                if rank == runner.parallel.layout.result_rank:
                    out.send(result)
            case Shutdown():
                log.info("worker %d: shutdown", rank)
                return
