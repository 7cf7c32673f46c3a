"""Turns the scheduler's per-step token updates into the deltas frontends see: detokenizes
incrementally, applies stop strings, and gathers the n samples of each request.

Runs beside the tokenizer (in a tokenizer process, or in-process with `InprocEngine`), never in
the worker. Its output, `RequestDelta`, is what every frontend receives from either engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagebus.bus.messages import (
    ErrorKind,
    FinishReason,
    RequestDelta,
    SampleDelta,
    SampleKey,
    SamplingParams,
    SeqUpdate,
    TokenLogprobs,
)
from pagebus.frontends.detokenizer import IncrementalDetokenizer
from pagebus.frontends.tokenizer import Tokenizer


@dataclass
class _RequestState:
    prompt_text: str | None
    prompt_token_ids: list[int]
    n: int
    echo: bool  # the first delta carries the prompt text
    detoks: list[IncrementalDetokenizer]
    num_cached_tokens: int = 0
    error: str | None = None
    finished: set[int] = field(default_factory=set)  # sample indexes whose finish was sent
    first_sent: bool = False


@dataclass
class _SampleStep:
    """What one sample gained in one `process` call."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def add(
        self,
        request_id: str,
        prompt_text: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        echo: bool = False,
        final_only: bool = False,
    ) -> None:
        """final_only: the caller reads only each sample's whole text (IncrementalDetokenizer)."""
        detoks = (
            [IncrementalDetokenizer(self.tokenizer, prompt_ids, params, final_only) for _ in range(params.n)]
            if self.tokenizer is not None
            else []
        )
        self.requests[request_id] = _RequestState(prompt_text, prompt_ids, params.n, echo, detoks)

    def process(self, updates: list[SeqUpdate]) -> tuple[list[RequestDelta], list[SampleKey]]:
        """One delta per request that changed (the last one has `finished`), and the samples to
        abort in the scheduler because a stop string ended them here."""
        steps: dict[str, dict[int, _SampleStep]] = {}
        to_abort: list[SampleKey] = []
        for u in updates:
            st = self.requests.get(u.request_id)
            if st is None or u.sample_index in st.finished:
                continue  # already finished here (stop string) or unknown
            step = steps.setdefault(u.request_id, {}).setdefault(u.sample_index, _SampleStep())
            if self._apply(st, u, step):
                to_abort.append(SampleKey(u.request_id, u.sample_index))
        return [self._delta(rid, samples) for rid, samples in steps.items()], to_abort

    def _apply(self, st: _RequestState, u: SeqUpdate, step: _SampleStep) -> bool:
        """Fold one update into its sample's step; True when a stop string ended it here."""
        i = u.sample_index
        if u.num_cached_tokens:
            st.num_cached_tokens = max(st.num_cached_tokens, u.num_cached_tokens)
        ids, lps = u.new_token_ids, u.logprobs
        stopped_here = False
        if st.detoks:
            # Speculative decoding delivers several tokens at once: push them one at a time, so a
            # stop string ends the sample at the token that completed it, as without speculation.
            res = st.detoks[i].push(ids[:1])
            step.text += res.text_delta
            for j in range(1, len(ids)):
                if res.finished_by_stop:
                    ids, lps = ids[:j], lps[:j]
                    break
                res = st.detoks[i].push(ids[j : j + 1])
                step.text += res.text_delta
        step.token_ids.extend(ids)
        step.logprobs.extend(lps)
        if st.detoks:
            # a stop string before the update's last token ends the sample whatever ended that token
            cut = len(ids) < len(u.new_token_ids)
            if res.finished_by_stop and (u.finish_reason is None or cut):
                step.finish_reason, step.stop_reason = FinishReason.STOP, res.stop_matched
                stopped_here = True
            elif u.finish_reason is not None:
                step.text += st.detoks[i].flush().text_delta
        if u.finish_reason is not None and step.finish_reason is None:
            step.finish_reason, step.stop_reason = u.finish_reason, u.stop_token_id
        if u.error:
            st.error = u.error
        if step.finish_reason is not None:
            st.finished.add(i)
        return stopped_here

    def _delta(self, request_id: str, steps: dict[int, _SampleStep]) -> RequestDelta:
        st = self.requests[request_id]
        samples = [
            SampleDelta(i, s.text, s.token_ids, s.logprobs, s.finish_reason, s.stop_reason)
            for i, s in sorted(steps.items())
            if s.token_ids or s.text or s.finish_reason is not None
        ]
        first, st.first_sent = not st.first_sent, True
        done = len(st.finished) == st.n
        if done:
            del self.requests[request_id]
        return RequestDelta(
            request_id,
            samples,
            finished=done,
            num_prompt_tokens=len(st.prompt_token_ids),
            num_cached_tokens=st.num_cached_tokens,
            prompt_token_ids=list(st.prompt_token_ids) if first else None,
            prompt_text=st.prompt_text if first and st.echo else None,
            error=st.error,
            # Errors reported in updates come from the scheduler's admission checks.
            error_kind=ErrorKind.INVALID_REQUEST if st.error else None,
        )
