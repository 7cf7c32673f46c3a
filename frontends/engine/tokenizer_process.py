"""A tokenizer process: text in, token ids to the scheduler; token ids back, text deltas out.

    frontend --PUSH--> [tokenizer i] --DEALER(tok-i)--> scheduler
    scheduler --PUSH (StepOutput)--> [tokenizer i] --PUSH (one DeltaBatch per step)--> frontend

The launcher starts `tokenizer_workers` of them (a pool); the frontend routes every message of
one request to the same one, by request id. The work itself is `TextProcessor`'s, shared with
the in-process engine; this module only owns the sockets. Imports neither torch nor
transformers model code: it starts in ~0.2 s.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
import zmq
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    DeltaBatch,
    DetokenizeRequest,
    EngineDead,
    FromScheduler,
    GenerateRequest,
    Hello,
    Ready,
    RequestDelta,
    Shutdown,
    StepOutput,
    TokenizeRequest,
    TokenizeResult,
    ToTokenizer,
)
from pagebus.bus.proc import freeze_heap
from pagebus.bus.sockets import Channel, make_socket
from pagebus.frontends.engine.text import TextProcessor
from pagebus.frontends.model_files import tokenizer_dir
from pagebus.frontends.tokenizer import Tokenizer

log = logging.getLogger(__name__)

LINGER_MS = 2_000
SEND_TIMEOUT_S = 30.0


def tokenizer_main(cfg_bytes: bytes, model_path: str, rank: int, addrs: dict[str, str]) -> None:
    """Entry point (module level so `bus.proc.spawn` can import it)."""
    cfg = msgspec.msgpack.decode(cfg_bytes, type=EngineConfig)
    ctx: zmq.Context[Any] = zmq.Context()
    hs = Channel(make_socket(ctx, zmq.PUSH, addrs["handshake"], bind=False, linger_ms=LINGER_MS))
    hs.send(Hello(version=PROTOCOL_VERSION, role="tokenizer", rank=rank, pid=os.getpid()))
    tok = Tokenizer(tokenizer_dir(cfg.tokenizer or model_path))
    fe_in = Channel.open(ctx, zmq.PULL, addrs[f"tok_in_{rank}"], bind=True, recv_type=ToTokenizer)
    steps = Channel.open(ctx, zmq.PULL, addrs[f"tok_step_{rank}"], bind=True, recv_type=FromScheduler)
    sched = ctx.socket(zmq.DEALER)
    sched.setsockopt(zmq.LINGER, LINGER_MS)
    sched.setsockopt(zmq.ROUTING_ID, f"tok-{rank}".encode())  # the scheduler routes outputs by it
    sched.connect(addrs["scheduler_in"])
    to_sched = Channel(sched)
    fe_out = Channel(make_socket(ctx, zmq.PUSH, addrs["frontend_in"], bind=False, linger_ms=LINGER_MS))
    freeze_heap()
    hs.send(Ready(role="tokenizer", rank=rank))
    try:
        TokenizerProcess(TextProcessor(tok), fe_in, steps, to_sched, fe_out).run()
    finally:
        for ch in (hs, fe_in, steps, to_sched, fe_out):
            ch.close()
        ctx.term()


class TokenizerProcess:
    """The loop of one tokenizer process: frontend requests in, scheduler outputs in, each
    handled by its `TextProcessor` and sent on."""

    def __init__(
        self, text: TextProcessor, fe_in: Channel, steps: Channel, to_sched: Channel, fe_out: Channel
    ) -> None:
        self.text, self.fe_in, self.steps, self.to_sched, self.fe_out = text, fe_in, steps, to_sched, fe_out
        self.poller = zmq.Poller()
        self.poller.register(fe_in.sock, zmq.POLLIN)
        self.poller.register(steps.sock, zmq.POLLIN)

    def run(self) -> None:
        while True:
            events = dict(self.poller.poll())  # blocks when idle
            if self.steps.sock in events:  # outputs first: they free the frontend's memory
                self._drain_steps()
            while self.fe_in.sock in events:
                try:
                    msg = self.fe_in.recv_now()
                except zmq.Again:
                    break
                if self._on_frontend(msg):
                    self._drain_steps()  # flush what the scheduler already sent, then stop
                    return

    def _drain_steps(self) -> None:
        while True:
            try:
                msg = self.steps.recv_now()
            except zmq.Again:
                return
            match msg:
                case StepOutput():
                    self._on_step(msg)
                case EngineDead():
                    log.error("engine dead: %s", msg.reason)
                    self.fe_out.send(msg, timeout_s=1.0)

    def _on_frontend(self, msg: Any) -> bool:
        """Handle one message; True on Shutdown."""
        match msg:
            case GenerateRequest():
                out = self.text.generate(msg)
                if isinstance(out, RequestDelta):
                    self._reply(DeltaBatch(deltas=[out]))
                else:
                    self.to_sched.send(out, timeout_s=SEND_TIMEOUT_S)
            case TokenizeRequest():
                self._reply(self.text.tokenize(msg))
            case DetokenizeRequest():
                self._reply(self.text.detokenize(msg))
            case AbortRequest():
                self.to_sched.send(msg, timeout_s=SEND_TIMEOUT_S)
            case Shutdown():
                return True
        return False

    def _on_step(self, step: StepOutput) -> None:
        deltas, to_abort = self.text.process(step.updates)
        if to_abort:  # stop strings ended these samples here; free their blocks in the scheduler
            self.to_sched.send(AbortRequest(request_ids=[], samples=to_abort), timeout_s=SEND_TIMEOUT_S)
        self._reply(DeltaBatch(deltas=deltas, stats=step.stats))

    def _reply(self, msg: TokenizeResult | DeltaBatch) -> None:
        self.fe_out.send(msg, timeout_s=SEND_TIMEOUT_S)
