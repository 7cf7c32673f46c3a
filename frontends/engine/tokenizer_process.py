"""A tokenizer-pool process: text in, token ids to the scheduler; token ids back, text deltas out.

    frontend --PUSH--> [pool i] --DEALER(tok-i)--> scheduler
    scheduler --PUSH (StepOutput)--> [pool i] --PUSH (one DeltaBatch per step)--> frontend

Requests are keyed by request id; the frontend routes every message of one request to the same
pool. Detokenization and stop strings are `OutputProcessor`'s, shared with the in-process `LLM`.
Imports neither torch nor transformers model code: it starts in ~0.2 s.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    AddRequest,
    DeltaBatch,
    DetokenizeRequest,
    EngineDead,
    ErrorKind,
    FinishReason,
    FromScheduler,
    GenerateRequest,
    Hello,
    Ready,
    RequestDelta,
    SampleDelta,
    Shutdown,
    StepOutput,
    TokenizeRequest,
    TokenizeResult,
    TokenLogprobs,
    ToTokenizer,
)
from pagebus.bus.sockets import Channel, make_socket
from pagebus.bus.validation import check_sampling_params
from pagebus.frontends.model_files import tokenizer_dir
from pagebus.frontends.output_processor import OutputProcessor
from pagebus.frontends.outputs import RequestOutput
from pagebus.frontends.tokenizer import Tokenizer

log = logging.getLogger(__name__)

LINGER_MS = 2_000
SEND_TIMEOUT_S = 30.0


@dataclass
class _Meta:
    echo: bool
    prompt_text: str | None
    first_sent: bool = False
    reported: set[int] = field(default_factory=set)  # samples whose finish was already sent


def pool_main(cfg_bytes: bytes, model_path: str, rank: int, addrs: dict[str, str]) -> None:
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
    hs.send(Ready(role="tokenizer", rank=rank))
    try:
        Pool(tok, fe_in, steps, to_sched, fe_out).run()
    finally:
        for ch in (hs, fe_in, steps, to_sched, fe_out):
            ch.close()
        ctx.term()


class Pool:
    def __init__(
        self, tok: Tokenizer, fe_in: Channel, steps: Channel, to_sched: Channel, fe_out: Channel
    ) -> None:
        self.tok, self.fe_in, self.steps, self.to_sched, self.fe_out = tok, fe_in, steps, to_sched, fe_out
        self.op = OutputProcessor(tok)
        self.meta: dict[str, _Meta] = {}
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

    # ------------------------------------------------------------------ frontend -> pool
    def _on_frontend(self, msg: Any) -> bool:
        """Handle one message; True on Shutdown."""
        match msg:
            case GenerateRequest():
                self._generate(msg)
            case TokenizeRequest():
                self._tokenize(msg)
            case DetokenizeRequest(request_id=rid, token_ids=ids):
                try:
                    self._reply(TokenizeResult(request_id=rid, text=self.tok.decode(ids)))
                except Exception as e:
                    self._reply(TokenizeResult(request_id=rid, error=f"cannot decode: {e}"))
            case AbortRequest():
                self.to_sched.send(msg, timeout_s=SEND_TIMEOUT_S)
            case Shutdown():
                return True
        return False

    def _reply(self, msg: TokenizeResult | DeltaBatch) -> None:
        self.fe_out.send(msg, timeout_s=SEND_TIMEOUT_S)

    def _prompt(
        self, prompt: str | None, ids: list[int] | None, messages: list[Any] | None, agp: bool, special: bool
    ) -> tuple[str | None, list[int]]:
        if sum(x is not None for x in (prompt, ids, messages)) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        if ids is not None:
            bad = [t for t in ids if not 0 <= t < len(self.tok)]
            if bad:
                raise ValueError(f"prompt_token_ids {bad[:5]} are outside the vocabulary")
            return None, list(ids)
        if messages is not None:
            text = self.tok.apply_chat_template([msgspec.structs.asdict(m) for m in messages], agp)
            return text, self.tok.encode(text, add_special_tokens=False)  # the template holds them
        assert prompt is not None
        return prompt, self.tok.encode(prompt, add_special_tokens=special)

    def _generate(self, req: GenerateRequest) -> None:
        rid = req.request_id
        try:
            check_sampling_params(req.params)
            text, ids = self._prompt(
                req.prompt, req.prompt_token_ids, req.messages, req.add_generation_prompt, True
            )
        except ValueError as e:  # includes ChatTemplateError
            delta = RequestDelta(rid, [], finished=True, error=str(e), error_kind=ErrorKind.INVALID_REQUEST)
            self._reply(DeltaBatch(deltas=[delta]))
            return
        self.op.add(rid, text, ids, req.params)
        self.meta[rid] = _Meta(req.echo, text)
        add = AddRequest(
            request_id=rid,
            prompt_token_ids=ids,
            params=req.params,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
        )
        self.to_sched.send(add, timeout_s=SEND_TIMEOUT_S)

    def _tokenize(self, req: TokenizeRequest) -> None:
        try:
            _, ids = self._prompt(
                req.prompt, None, req.messages, req.add_generation_prompt, req.add_special_tokens
            )
            self._reply(TokenizeResult(request_id=req.request_id, token_ids=ids))
        except ValueError as e:
            self._reply(TokenizeResult(request_id=req.request_id, error=str(e)))

    # ------------------------------------------------------------------ scheduler -> pool
    def _on_step(self, step: StepOutput) -> None:
        lps: dict[tuple[str, int], list[TokenLogprobs]] = {}
        for u in step.updates:
            if u.logprobs:
                lps.setdefault((u.request_id, u.sample_index), []).extend(u.logprobs)
        outs, to_abort = self.op.process(step.updates)
        if to_abort:  # stop strings ended these samples here; free their blocks in the scheduler
            self.to_sched.send(AbortRequest(request_ids=[], samples=to_abort), timeout_s=SEND_TIMEOUT_S)
        deltas = [self._delta(out, lps) for out in outs]
        self._reply(DeltaBatch(deltas=deltas, stats=step.stats))

    def _delta(self, out: RequestOutput, lps: dict[tuple[str, int], list[TokenLogprobs]]) -> RequestDelta:
        rid = out.request_id
        meta = self.meta.get(rid) or _Meta(False, None, first_sent=True)
        samples = []
        for s in out.outputs:
            new_finish = s.finish_reason is not None and s.index not in meta.reported
            if not (s.new_token_ids or s.text_delta or new_finish):
                continue
            if new_finish:
                meta.reported.add(s.index)
            samples.append(
                SampleDelta(
                    s.index,
                    s.text_delta,
                    list(s.new_token_ids),
                    lps.get((rid, s.index), []),
                    FinishReason(s.finish_reason) if new_finish else None,
                    s.stop_reason if new_finish else None,
                )
            )
        first = not meta.first_sent
        meta.first_sent = True
        if out.finished:
            self.meta.pop(rid, None)
        return RequestDelta(
            rid,
            samples,
            finished=out.finished,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens,
            prompt_token_ids=list(out.prompt_token_ids) if first else None,
            prompt_text=meta.prompt_text if first and meta.echo else None,
            error=out.error,
            error_kind=ErrorKind.INVALID_REQUEST if out.error else None,  # the scheduler's admission checks
        )
