"""The text side of the engine, without a transport.

A `GenerateRequest` becomes the scheduler's `AddRequest` (sampling params checked, prompt
tokenized or chat template applied, token ids checked against the vocabulary); the scheduler's
per-step `SeqUpdate`s become `RequestDelta`s (`OutputProcessor`: incremental detokenization,
stop strings, the n samples gathered). A tokenizer process runs one `TextProcessor` behind its
sockets; `InprocEngine` calls one directly, so both engines accept, refuse and answer a request
the same way.
"""

from __future__ import annotations

from typing import Any

import msgspec
from pagebus.bus.messages import (
    AddRequest,
    ChatMessage,
    DetokenizeRequest,
    ErrorKind,
    GenerateRequest,
    RequestDelta,
    SampleKey,
    SeqUpdate,
    TokenizeRequest,
    TokenizeResult,
)
from pagebus.bus.validation import check_sampling_params
from pagebus.frontends.output_processor import OutputProcessor
from pagebus.frontends.structured.tools import chat_prompt
from pagebus.frontends.structured.validate import check_structured
from pagebus.frontends.tokenizer import Tokenizer


class TextProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.outputs = OutputProcessor(tokenizer)

    def generate(self, req: GenerateRequest) -> AddRequest | RequestDelta:
        """The scheduler's request, or the final delta that refuses it (an invalid request)."""
        try:
            check_sampling_params(req.params)
            if req.params.structured_outputs is not None:  # refused here, not in the worker
                check_structured(req.params.structured_outputs)
            text, ids = self._prompt(
                req.prompt, req.prompt_token_ids, req.messages, req.add_generation_prompt, True, req.tools
            )
        except ValueError as e:  # includes ChatTemplateError and ParamError
            return RequestDelta(
                req.request_id, [], finished=True, error=str(e), error_kind=ErrorKind.INVALID_REQUEST
            )
        self.outputs.add(req.request_id, text, ids, req.params, req.echo, req.final_only)
        return AddRequest(
            request_id=req.request_id,
            prompt_token_ids=ids,
            params=req.params,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
        )

    def process(self, updates: list[SeqUpdate]) -> tuple[list[RequestDelta], list[SampleKey]]:
        """The deltas of one step, and the samples a stop string ended (abort them)."""
        return self.outputs.process(updates)

    def tokenize(self, req: TokenizeRequest) -> TokenizeResult:
        try:
            _, ids = self._prompt(
                req.prompt, None, req.messages, req.add_generation_prompt, req.add_special_tokens
            )
        except ValueError as e:
            return TokenizeResult(request_id=req.request_id, error=str(e))
        return TokenizeResult(request_id=req.request_id, token_ids=ids)

    def detokenize(self, req: DetokenizeRequest) -> TokenizeResult:
        try:
            return TokenizeResult(request_id=req.request_id, text=self.tok.decode(req.token_ids))
        except Exception as e:  # ids the tokenizer cannot decode are the caller's error
            return TokenizeResult(request_id=req.request_id, error=f"cannot decode: {e}")

    def _prompt(
        self,
        prompt: str | None,
        ids: list[int] | None,
        messages: list[ChatMessage] | None,
        add_generation_prompt: bool,
        add_special_tokens: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str | None, list[int]]:
        """(prompt text if known, prompt token ids); ValueError says what is wrong."""
        if sum(x is not None for x in (prompt, ids, messages)) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        if ids is not None:
            bad = [t for t in ids if not 0 <= t < len(self.tok)]
            if bad:
                raise ValueError(f"prompt_token_ids {bad[:5]} are outside the vocabulary")
            return None, list(ids)
        if messages is not None:
            convo = [msgspec.to_builtins(m) for m in messages]
            text = chat_prompt(self.tok, convo, add_generation_prompt, tools)
            return text, self.tok.encode(text, add_special_tokens=False)  # the template holds them
        assert prompt is not None
        return prompt, self.tok.encode(prompt, add_special_tokens=add_special_tokens)
