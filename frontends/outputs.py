"""What the Python API returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagebus.bus.messages import RequestDelta, SamplingParams


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per token: id -> Logprob (chosen + top-N)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string, if any
    # What this update added, for streaming frontends.
    text_delta: str = ""
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None


def new_output(request_id: str, prompt: str | None, params: SamplingParams) -> RequestOutput:
    """An empty output for a request with `params.n` samples, ready for `apply_delta`."""
    samples = [CompletionOutput(index=i) for i in range(params.n)]
    if params.logprobs is not None:
        for s in samples:
            s.logprobs, s.cumulative_logprob = [], 0.0
    return RequestOutput(request_id, prompt, [], samples)


def apply_delta(out: RequestOutput, d: RequestDelta) -> None:
    """Fold one engine delta into `out`: the one place deltas become a RequestOutput. The samples'
    `text_delta` and `new_token_ids` grow too; the caller clears them per step."""
    if d.prompt_token_ids is not None:
        out.prompt_token_ids = list(d.prompt_token_ids)
    if d.prompt_text is not None:
        out.prompt = d.prompt_text
    out.num_cached_tokens = max(out.num_cached_tokens, d.num_cached_tokens)
    if d.error:
        out.error = d.error
    for sd in d.samples:
        s = out.outputs[sd.index]
        s.text += sd.text_delta
        s.text_delta += sd.text_delta
        s.token_ids.extend(sd.new_token_ids)
        s.new_token_ids.extend(sd.new_token_ids)
        for lp in sd.logprobs:
            assert s.logprobs is not None
            entry = {
                t: Logprob(v, r)
                for r, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1)
            }
            entry[lp.token_id] = Logprob(lp.logprob, lp.rank)
            s.logprobs.append(entry)
            s.cumulative_logprob = (s.cumulative_logprob or 0.0) + lp.logprob
        if sd.finish_reason is not None:
            s.finish_reason, s.stop_reason = sd.finish_reason.value, sd.stop_reason
    if d.finished:
        out.finished = True
        if out.error:
            for s in out.outputs:
                s.finish_reason = s.finish_reason or "error"
