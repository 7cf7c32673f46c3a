"""Turns the scheduler's per-step token updates into request outputs: detokenizes
incrementally, applies stop strings, and gathers the n samples of each request.

Shared by every frontend; runs in the frontend (or tokenizer-pool) process, never the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagebus.bus.messages import FinishReason, SampleKey, SamplingParams, SeqUpdate
from pagebus.frontends.detokenizer import IncrementalDetokenizer
from pagebus.frontends.outputs import CompletionOutput, Logprob, RequestOutput
from pagebus.frontends.tokenizer import Tokenizer


@dataclass
class _RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[CompletionOutput]
    detoks: list[IncrementalDetokenizer]
    num_cached_tokens: int = 0
    error: str | None = None
    finished_samples: set[int] = field(default_factory=set)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams) -> None:
        samples = [CompletionOutput(index=i) for i in range(params.n)]
        if params.logprobs is not None:
            for s in samples:
                s.logprobs, s.cumulative_logprob = [], 0.0
        detoks = (
            [IncrementalDetokenizer(self.tokenizer, prompt_ids, params) for _ in range(params.n)]
            if self.tokenizer is not None
            else []
        )
        self.requests[request_id] = _RequestState(prompt, prompt_ids, params, samples, detoks)

    def process(self, updates: list[SeqUpdate]) -> tuple[list[RequestOutput], list[SampleKey]]:
        """Returns the outputs that changed (finished ones last seen here) and the samples to
        abort in the scheduler because a stop string ended them."""
        for state in self.requests.values():
            for s in state.samples:
                s.text_delta, s.new_token_ids = "", []
        changed: dict[str, None] = {}
        to_abort: list[SampleKey] = []
        for u in updates:
            st = self.requests.get(u.request_id)
            if st is None or u.sample_index in st.finished_samples:
                continue  # already finished here (stop string) or unknown
            changed[u.request_id] = None
            if self._apply(st, u):
                to_abort.append(SampleKey(u.request_id, u.sample_index))
        outs = []
        for rid in changed:
            st = self.requests[rid]
            done = len(st.finished_samples) == len(st.samples)
            outs.append(
                RequestOutput(
                    rid, st.prompt, st.prompt_token_ids, st.samples, done, st.num_cached_tokens, st.error
                )
            )
            if done:
                del self.requests[rid]
        return outs, to_abort

    def _apply(self, st: _RequestState, u: SeqUpdate) -> bool:
        """Fold one update into its sample; True when a stop string ended it here."""
        s = st.samples[u.sample_index]
        if u.num_cached_tokens:
            st.num_cached_tokens = max(st.num_cached_tokens, u.num_cached_tokens)
        s.token_ids.extend(u.new_token_ids)
        s.new_token_ids.extend(u.new_token_ids)
        for lp in u.logprobs:
            assert s.logprobs is not None
            entry = {tid: Logprob(v, None) for tid, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
            for rank, tid in enumerate(lp.top_token_ids, start=1):
                entry[tid].rank = rank
            entry[lp.token_id] = Logprob(lp.logprob, lp.rank)
            s.logprobs.append(entry)
            s.cumulative_logprob = (s.cumulative_logprob or 0.0) + lp.logprob
        stopped_here = False
        if st.detoks:
            res = st.detoks[u.sample_index].push(u.new_token_ids)
            s.text_delta += res.text_delta
            if res.finished_by_stop and u.finish_reason is None:
                s.finish_reason, s.stop_reason = FinishReason.STOP.value, res.stop_matched
                stopped_here = True
            elif u.finish_reason is not None:
                s.text_delta += st.detoks[u.sample_index].flush().text_delta
            s.text = st.detoks[u.sample_index].text
        if u.finish_reason is not None and s.finish_reason is None:
            s.finish_reason = u.finish_reason.value
            s.stop_reason = u.stop_token_id
        if u.error:
            st.error = u.error
        if s.finish_reason is not None:
            st.finished_samples.add(u.sample_index)
        return stopped_here
