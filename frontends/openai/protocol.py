"""OpenAI request and response bodies as msgspec Structs, and their mapping onto bus messages.

Unknown fields are ignored (clients send fields we do not use); a wrong type is a 400 that names
the field. Names follow OpenAI first and accept vLLM's extensions (top_k, min_p, ignore_eos, ...).
Sampling checks go through `bus.validation.check_sampling_params`, the one validation path.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from pagebus.bus.messages import ChatMessage, SamplingParams, StructuredOutputsParams, ToolCall
from pagebus.bus.validation import ParamError, check_sampling_params
from pagebus.frontends.openai.errors import (
    APIError,
    ErrorCode,
    bad_request,
    from_param_error,
    from_validation_error,
)
from pagebus.frontends.structured import request as S

# Every integer a body carries crosses the bus as msgpack, which holds int64 (and uint64) only: a
# JSON integer outside int64 (`"priority": -9223372036854775809`) decoded fine here and then failed
# to encode in the engine client, a 500. Bounded at decode, it is a 400 naming the field.
Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    n: Int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Int = 0
    cache_salt: str | None = None
    user: str | None = None  # accepted and ignored, as OpenAI does for abuse tracking
    # Structured outputs (frontends/structured/request.py): OpenAI's, vLLM's, vLLM's older names.
    response_format: S.ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec allows one array type per union,
    # so the list forms are told apart in `prompts()`.
    prompt: str | list[Any]
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a `tool` message answers this call
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessageIn]
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    tools: list[S.Tool] | None = None
    tool_choice: str | S.NamedToolChoice | None = None


class TokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(msgspec.Struct, kw_only=True):
    tokens: list[Int]
    model: str | None = None


def decode_body(body: bytes, typ: type[Any]) -> Any:
    """JSON bytes -> Struct, or a 400 saying what is wrong (malformed JSON or a field's type)."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        raise from_validation_error(e) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"malformed JSON body: {e}") from None


# ---------------------------------------------------------------------------- mapping
def sampling_params(req: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> SamplingParams:
    """The request's SamplingParams; ParamError from the shared checks becomes a 400."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        logprobs = req.logprobs
    given: dict[str, Any] = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    # max_completion_tokens is OpenAI's newer name; None means "up to the context limit" (vLLM).
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    p = SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        structured_outputs=_constraint(req),
        **{k: v for k, v in given.items() if v is not None},
    )
    try:
        check_sampling_params(p, vocab_size)
    except ParamError as e:
        if isinstance(req, ChatCompletionRequest) and e.param == "logprobs":  # chat calls it top_logprobs
            raise bad_request(str(e).replace("logprobs", "top_logprobs", 1), "top_logprobs") from None
        raise from_param_error(e) from None
    return p


def _constraint(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The one structured-output constraint of a body: its fields, or a forced tool call."""
    try:
        c = S.constraint(req)
        if isinstance(req, ChatCompletionRequest):
            forced = S.tool_mode(req.tools, req.tool_choice)[1]
            if forced is not None:
                if c is not None:
                    raise ParamError(
                        "a forced tool_choice cannot be combined with another constraint", "tool_choice"
                    )
                c = forced
    except ParamError as e:
        raise from_param_error(e) from None
    return c


def prompts(req: CompletionRequest, vocab_size: int) -> list[str | list[int]]:
    """The prompt field as a list of prompts: text or token ids."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request("prompt must not be empty", "prompt")
    try:
        if all(isinstance(x, str) for x in p):
            out: list[str | list[int]] = list(p)
        elif all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            out = [msgspec.convert(p, list[Int])]
        else:
            out = list(msgspec.convert(p, list[list[Int]]))
    except msgspec.ValidationError:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
            "prompt",
        ) from None
    for x in out:
        if isinstance(x, list):
            if not x:
                raise bad_request("a token-id prompt must not be empty", "prompt")
            bad = [t for t in x if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"prompt token ids {bad[:8]} are outside the vocabulary", "prompt")
    return out


ROLES = ("system", "developer", "user", "assistant", "tool")
# Part types OpenAI defines that this server cannot take (text-only models): a clear 400, not "unknown".
_UNSUPPORTED_PARTS = ("image_url", "input_audio", "file", "refusal")


def check_messages(messages: list[ChatMessageIn]) -> None:
    """OpenAI's rules for `messages`, strictly: a 400 whose `param` is the offending field's path."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if m.role not in ROLES:
            raise bad_request(f"{at}.role must be one of {', '.join(ROLES)}, not {m.role!r}", f"{at}.role")
        # An assistant message may carry tool calls instead of content; every other role needs content.
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad_request(f"{at}.content is required for a {m.role} message", f"{at}.content")
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request(f"{at}.tool_call_id is required for a tool message", f"{at}.tool_call_id")
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            where = f"{at}.content[{j}]"
            if part.type in _UNSUPPORTED_PARTS:
                raise bad_request(
                    f"{where}.type {part.type!r} is not supported by this model", f"{where}.type"
                )
            if part.type != "text":
                raise bad_request(f"{where}.type must be 'text', not {part.type!r}", f"{where}.type")
            if part.text is None:
                raise bad_request(f"{where}.text is required for a text part", f"{where}.text")


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """OpenAI messages -> bus ChatMessages; content parts must be text (no images here)."""
    check_messages(messages)
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # text parts only, as check_messages made sure
            content = "".join(part.text or "" for part in content)
        out.append(
            ChatMessage(
                role=m.role,
                content=content,
                name=m.name,
                tool_call_id=m.tool_call_id,
                tool_calls=m.tool_calls,
            )
        )
    return out


def check_model(model: str | None, served: str) -> None:
    if model is not None and model != served:
        raise APIError(
            404, f"The model `{model}` does not exist.", param="model", code=ErrorCode.MODEL_NOT_FOUND
        )


# -------------------------------------------------------------------------- responses
class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
        PromptTokensDetails(cached_tokens),
    )


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] = []


class FunctionOut(msgspec.Struct, omit_defaults=True):
    name: str | None = None  # None: a stream chunk continuing the call's arguments
    arguments: str | None = None


class ToolCallOut(msgspec.Struct, omit_defaults=True):
    """A tool call of a message (`index` None), or of a stream delta (`id`, `type` only first)."""

    function: FunctionOut
    id: str | None = None
    type: str | None = None
    index: int | None = None


class ChatMessageOut(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Response(msgspec.Struct):
    """One body for completions, chat completions and their stream chunks (they differ in `object`)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]  # CompletionChoice | ChatChoice | ChatChunkChoice
    usage: Usage | None = None
