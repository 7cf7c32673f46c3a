"""The worker process: a thin loop around ModelRunner.

Hello -> load the model -> Ready(facts) -> read ExecuteBatch from the scheduler's shm ring ->
execute -> rank 0 sends BatchResult back over ZMQ. Shutdown on the ring ends it with exit 0; any
exception sends WorkerFailed (with linger, so it leaves) and exits non-zero.

Spawned by the scheduler process (its parent), which watches this process's sentinel.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

import msgspec
import zmq
from pagebus.bus.codec import Codec, unpack_frames
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import (
    PROTOCOL_VERSION,
    BatchResult,
    ExecuteBatch,
    Hello,
    Ready,
    Shutdown,
    ToWorker,
    WorkerFailed,
)
from pagebus.bus.shm import RingHandle, ShmRingReader
from pagebus.bus.sockets import Channel, make_socket

log = logging.getLogger(__name__)

ROLE = "worker"
LINGER_MS = 2_000  # the last message (WorkerFailed) must get out before the process exits


def worker_main(
    cfg_bytes: bytes, model_path: str, rank: int, ring: bytes, handshake_ep: str, out_ep: str
) -> None:
    """Entry point (module level so `bus.proc.spawn` can import it)."""
    cfg = msgspec.msgpack.decode(cfg_bytes, type=EngineConfig)
    handle = msgspec.msgpack.decode(ring, type=RingHandle)
    ctx: zmq.Context[Any] = zmq.Context()
    hs = Channel(make_socket(ctx, zmq.PUSH, handshake_ep, bind=False, linger_ms=LINGER_MS))
    out = Channel(make_socket(ctx, zmq.PUSH, out_ep, bind=False, linger_ms=LINGER_MS))
    code = 0
    try:
        hs.send(Hello(version=PROTOCOL_VERSION, role=ROLE, rank=rank, pid=os.getpid()))
        _run(cfg, model_path, rank, handle, hs, out)
    except BaseException as e:  # report every failure, then exit non-zero
        log.error("worker %d failed:\n%s", rank, traceback.format_exc())
        try:
            out.send(WorkerFailed(rank=rank, reason=f"{type(e).__name__}: {e}"), timeout_s=1.0)
        except Exception:
            log.exception("could not send WorkerFailed")
        code = 1
    finally:
        hs.close()
        out.close()
        ctx.term()
    if code:
        raise SystemExit(code)


def _run(
    cfg: EngineConfig, model_path: str, rank: int, handle: RingHandle, hs: Channel, out: Channel
) -> None:
    # Heavy import here, after Hello: the parent learns at once that the process started.
    import torch
    from pagebus.workers.runner import ModelRunner

    runner = ModelRunner(cfg, model_path, rank)  # sets torch threads from cfg.num_threads
    mc = runner.model_config
    hs.send(
        Ready(
            role=ROLE,
            rank=rank,
            facts={
                "num_kv_blocks": runner.num_blocks,
                "max_model_len": runner.max_model_len,
                "eos_token_id": -1 if runner.eos_token_id is None else runner.eos_token_id,
                "vocab_size": mc.vocab_size,
                "dtype": str(runner.dtype).removeprefix("torch."),
                "device": str(runner.device),
                "num_threads": torch.get_num_threads(),
            },
        )
    )
    reader = ShmRingReader(handle, rank)  # blocks on a wake-up when idle: no spinning beyond spin_s
    codec = Codec()
    try:
        while True:
            msg = codec.decode(unpack_frames(reader.read()), ToWorker)
            match msg:
                case ExecuteBatch():
                    result: BatchResult = runner.execute(msg)  # the model's forward is inference_mode
                    if rank == 0:
                        out.send(result)
                case Shutdown():
                    log.info("worker %d: shutdown", rank)
                    return
    finally:
        reader.close()
