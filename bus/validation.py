"""Checks on user-supplied values, shared by every frontend (one validation path)."""

from __future__ import annotations

from pagebus.bus.messages import SamplingParams, StructuredOutputsParams


class ParamError(ValueError):
    """A value a user gave is invalid; `param` names it (an OpenAI error's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def need(ok: bool, message: str, param: str | None = None) -> None:
    """Raise ParamError(message, param) unless `ok`."""
    if not ok:
        raise ParamError(message, param)


def check_sampling_params(p: SamplingParams, vocab_size: int | None = None) -> None:
    """Raise ParamError naming the offending parameter."""
    need(p.n >= 1, f"n must be at least 1, got {p.n}", "n")
    need(
        p.max_tokens is None or p.max_tokens >= 1,
        f"max_tokens must be at least 1, got {p.max_tokens}",
        "max_tokens",
    )
    need(p.min_tokens >= 0, f"min_tokens must be non-negative, got {p.min_tokens}", "min_tokens")
    need(
        p.max_tokens is None or p.min_tokens <= p.max_tokens,
        f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})",
        "min_tokens",
    )
    need(p.temperature >= 0.0, f"temperature must be non-negative, got {p.temperature}", "temperature")
    need(0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}", "top_p")
    need(p.top_k >= -1, f"top_k must be -1 (disabled) or positive, got {p.top_k}", "top_k")
    need(0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}", "min_p")
    need(
        -2.0 <= p.presence_penalty <= 2.0,
        f"presence_penalty must be in [-2, 2], got {p.presence_penalty}",
        "presence_penalty",
    )
    need(
        -2.0 <= p.frequency_penalty <= 2.0,
        f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}",
        "frequency_penalty",
    )
    need(
        p.repetition_penalty > 0.0,
        f"repetition_penalty must be positive, got {p.repetition_penalty}",
        "repetition_penalty",
    )
    need(
        p.logprobs is None or 0 <= p.logprobs <= 20,
        f"logprobs must be in [0, 20], got {p.logprobs}",
        "logprobs",
    )
    need(all(s for s in p.stop), "stop strings must be non-empty", "stop")
    if p.structured_outputs is not None:
        check_structured_shape(p.structured_outputs)
    if vocab_size is not None:
        bad = [t for t in p.stop_token_ids if not 0 <= t < vocab_size]
        need(
            not bad, f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})", "stop_token_ids"
        )


def check_structured_shape(c: StructuredOutputsParams) -> None:
    """Exactly one constraint, none empty; `frontends.structured.validate` checks the contents."""
    given = [
        name
        for name, on in (
            ("json", c.json is not None),
            ("regex", c.regex is not None),
            ("choice", c.choice is not None),
            ("grammar", c.grammar is not None),
            ("json_object", c.json_object),
        )
        if on
    ]
    need(
        len(given) == 1,
        "structured_outputs needs exactly one of json, regex, choice, grammar or json_object, got "
        + (", ".join(given) or "none"),
        "structured_outputs",
    )
    need(
        c.choice is None or len(c.choice) > 0,
        "structured_outputs.choice must not be empty",
        "structured_outputs",
    )
    need(c.regex != "", "structured_outputs.regex must not be empty", "structured_outputs")
    need(
        c.grammar is None or bool(c.grammar.strip()),
        "structured_outputs.grammar must not be empty",
        "structured_outputs",
    )
