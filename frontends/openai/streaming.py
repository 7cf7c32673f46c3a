"""Folding engine deltas into OpenAI responses: SSE chunks while streaming, one body otherwise.

One `ResponseBuilder` serves both modes so streamed and non-streamed outputs cannot drift apart:
`add()` folds a delta into per-choice state and returns the choices that changed (a stream sends
them as one chunk), `final()` builds the whole body from the same state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from pagebus.bus.messages import FinishReason, RequestDelta, TokenLogprobs
from pagebus.frontends.openai.errors import ErrorResponse
from pagebus.frontends.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    FunctionOut,
    Response,
    ToolCallOut,
    TopLogprob,
    Usage,
    usage,
)
from pagebus.frontends.structured.tools import ParsedCall, ToolMode, ToolStream

Kind = Literal["completion", "chat"]
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell nginx-like proxies not to hold the first token back
]
_encoder = msgspec.json.Encoder()


def sse(obj: Response | ErrorResponse) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_len: int = 0  # characters so far, for completions' text_offset
    comp_lp: CompletionLogprobs | None = None
    chat_lp: ChatLogprobs | None = None
    tools: ToolStream | None = None  # a chat with tools: its text may turn into tool calls
    tool_calls: list[ParsedCall] | None = None
    tool_content: str | None = None  # the content beside the calls


@dataclass
class _Prompt:
    num_tokens: int = 0
    num_cached: int = 0


class ResponseBuilder:
    """State of one OpenAI request that fans out into `num_prompts * n` choices."""

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        model: str,
        *,
        n: int,
        num_prompts: int = 1,
        logprobs: int | None = None,
        echo: bool = False,
        token_text: Callable[[int], str] = str,
        tool_mode: ToolMode | None = None,
    ) -> None:
        self.kind, self.id, self.model, self.n = kind, request_id, model, n
        self.created = int(time.time())
        self.logprobs, self.echo, self.token_text = logprobs, echo, token_text
        self.choices = [_Choice() for _ in range(num_prompts * n)]
        if tool_mode is not None:
            for c in self.choices:
                c.tools = ToolStream(tool_mode)
        self.prompts = [_Prompt() for _ in range(num_prompts)]

    # ------------------------------------------------------------------ folding deltas
    def add(self, prompt_index: int, delta: RequestDelta) -> list[Any]:
        """Fold one delta in; returns the stream choices it produced (possibly none)."""
        pr = self.prompts[prompt_index]
        pr.num_tokens = max(pr.num_tokens, delta.num_prompt_tokens)
        pr.num_cached = max(pr.num_cached, delta.num_cached_tokens)
        out: list[Any] = []
        if self.echo and delta.prompt_text:
            for i in range(self.n):  # every sample of a prompt starts with the prompt text
                idx = prompt_index * self.n + i
                self._append_text(self.choices[idx], delta.prompt_text)
                out.append(CompletionChoice(idx, delta.prompt_text))
        for s in delta.samples:
            idx = prompt_index * self.n + s.index
            c = self.choices[idx]
            c.num_tokens += len(s.new_token_ids)
            lp_chunk = self._add_logprobs(c, s.logprobs) if self.logprobs is not None else None
            self._append_text(c, s.text_delta)
            if s.finish_reason is not None:
                c.finish_reason, c.stop_reason = s.finish_reason.value, s.stop_reason
            if not (s.text_delta or s.finish_reason or s.logprobs):
                continue
            if self.kind == "chat" and c.tools is not None:
                out.extend(self._tool_chunk(idx, c, s.text_delta, lp_chunk))
            elif self.kind == "chat":
                out.append(
                    ChatChunkChoice(
                        idx, ChatMessageOut(content=s.text_delta), lp_chunk, c.finish_reason, c.stop_reason
                    )
                )
            else:
                out.append(CompletionChoice(idx, s.text_delta, lp_chunk, c.finish_reason, c.stop_reason))
        return out

    @staticmethod
    def _tool_chunk(idx: int, c: _Choice, text: str, lp_chunk: Any) -> list[ChatChunkChoice]:
        """The stream choice of a delta under tools: content that cannot open a call, and at the
        end the calls, each whole in one chunk (OpenAI's delta shape: index, id, type, function)."""
        assert c.tools is not None
        content = c.tools.feed(text)
        calls: list[ToolCallOut] | None = None
        if c.finish_reason is not None:
            rest, parsed = c.tools.finish(completed=c.finish_reason == FinishReason.STOP.value)
            content += rest
            if parsed:
                c.tool_calls, c.finish_reason, c.stop_reason = parsed, "tool_calls", None
                c.tool_content = c.tools.content
                calls = [
                    ToolCallOut(FunctionOut(p.name, p.arguments), p.id, "function", k)
                    for k, p in enumerate(parsed)
                ]
        if not (content or calls or c.finish_reason or lp_chunk):
            return []
        return [
            ChatChunkChoice(
                idx,
                ChatMessageOut(content=content or None, tool_calls=calls),
                lp_chunk,
                c.finish_reason,
                c.stop_reason,
            )
        ]

    @staticmethod
    def _append_text(c: _Choice, text: str) -> None:
        if text:
            c.text.append(text)
            c.text_len += len(text)

    def _add_logprobs(self, c: _Choice, lps: list[TokenLogprobs]) -> Any:
        """Extend the choice's logprobs; return just the new part, shaped for a stream chunk."""
        tt = self.token_text
        top_n = self.logprobs or 0
        if self.kind == "chat":
            new_chat = [
                ChatTokenLogprob(
                    tt(lp.token_id),
                    lp.logprob,
                    list(tt(lp.token_id).encode()),
                    [
                        TopLogprob(tt(t), v, list(tt(t).encode()))
                        for t, v in zip(lp.top_token_ids[:top_n], lp.top_logprobs[:top_n], strict=True)
                    ],
                )
                for lp in lps
            ]
            c.chat_lp = c.chat_lp or ChatLogprobs()
            c.chat_lp.content.extend(new_chat)
            return ChatLogprobs(new_chat)
        new = CompletionLogprobs()
        offset = c.text_len
        for lp in lps:
            tok = tt(lp.token_id)
            top = {tt(t): v for t, v in zip(lp.top_token_ids[:top_n], lp.top_logprobs[:top_n], strict=True)}
            top.setdefault(tok, lp.logprob)  # OpenAI lists the chosen token among the alternatives
            new.tokens.append(tok)
            new.token_logprobs.append(lp.logprob)
            new.top_logprobs.append(top)
            new.text_offset.append(offset)
            offset += len(tok)
        c.comp_lp = c.comp_lp or CompletionLogprobs()
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(c.comp_lp, name).extend(getattr(new, name))
        return new

    # ------------------------------------------------------------------ bodies
    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def chunk(self, choices: list[Any]) -> Response:
        return Response(self.id, self.chunk_object, self.created, self.model, choices)

    def role_chunk(self) -> Response:
        """Chat streams open every choice with the assistant role, as OpenAI does."""
        return self.chunk(
            [
                ChatChunkChoice(i, ChatMessageOut(role="assistant", content=""))
                for i in range(len(self.choices))
            ]
        )

    def usage_chunk(self) -> Response:
        return Response(self.id, self.chunk_object, self.created, self.model, [], self.usage())

    def usage(self) -> Usage:
        return usage(
            sum(p.num_tokens for p in self.prompts),
            sum(c.num_tokens for c in self.choices),
            sum(p.num_cached for p in self.prompts),
        )

    def final(self) -> Response:
        if self.kind == "chat":
            choices: list[Any] = [
                ChatChoice(
                    i,
                    _message(c),
                    (c.chat_lp or ChatLogprobs()) if self.logprobs is not None else None,
                    c.finish_reason,
                    c.stop_reason,
                )
                for i, c in enumerate(self.choices)
            ]
            obj = "chat.completion"
        else:
            choices = [
                CompletionChoice(
                    i,
                    "".join(c.text),
                    (c.comp_lp or CompletionLogprobs()) if self.logprobs is not None else None,
                    c.finish_reason,
                    c.stop_reason,
                )
                for i, c in enumerate(self.choices)
            ]
            obj = "text_completion"
        return Response(self.id, obj, self.created, self.model, choices, self.usage())


def _message(c: _Choice) -> ChatMessageOut:
    if c.tool_calls:
        calls = [ToolCallOut(FunctionOut(p.name, p.arguments), p.id, "function") for p in c.tool_calls]
        return ChatMessageOut(role="assistant", content=c.tool_content, tool_calls=calls)
    return ChatMessageOut(role="assistant", content="".join(c.text))
