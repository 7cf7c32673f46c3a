"""Completions and chat completions without a transport: body bytes in, deltas and an OpenAI body out.

The HTTP app and `pagebus run-batch` both go through `prepare` (decode, validate, build the bus
requests) and `run` (fold the engine's deltas into a `ResponseBuilder`), so a body is accepted,
refused and answered the same way whichever way it came in. Failures are `APIError`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pagebus.bus.config import MAX_N, RequestLimits
from pagebus.bus.messages import GenerateRequest, RequestDelta, SamplingParams
from pagebus.bus.validation import ParamError
from pagebus.frontends.engine.interface import AsyncEngine
from pagebus.frontends.openai import protocol as P
from pagebus.frontends.openai.errors import (
    bad_request,
    delta_error,
    engine_dead,
    from_param_error,
    is_engine_dead,
)
from pagebus.frontends.openai.streaming import ResponseBuilder
from pagebus.frontends.structured.request import tool_mode as tool_mode_of

Kind = Literal["completion", "chat"]


@dataclass(frozen=True)
class Context:
    """What validation and responses need to know of the engine and the deployment."""

    served_model_name: str
    vocab_size: int
    token_text: Callable[[int], str] = str
    limits: RequestLimits | None = None  # None: only OpenAI's cap on n
    max_model_len: int | None = None


def check_bounds(params: SamplingParams, prompts: list[str | list[int]], ctx: Context) -> None:
    """Refuse a request over the per-request bounds before it reaches the engine.

    The token bound counts what is known here: token-id prompts exactly, text prompts as at least
    one token, and no max_tokens as max_model_len per prompt (exactly prompt + max_tokens). The
    scheduler checks each prompt again once tokenized.
    """
    lim = ctx.limits
    max_n = lim.max_n if lim is not None else MAX_N
    if params.n > max_n:
        why = "at most 128 and at most --max-num-seqs" if lim is not None else "OpenAI's limit"
        raise bad_request(f"n is {params.n}, over the limit of {max_n} ({why})", "n")
    if lim is None:
        return
    if len(prompts) > lim.max_prompts:
        raise bad_request(
            f"{len(prompts)} prompts in one request, over --max-prompts-per-request ({lim.max_prompts})",
            "prompt",
        )
    mt, total = params.max_tokens, 0
    for p in prompts:
        least = len(p) if isinstance(p, list) else 1
        total += params.n * (least + mt if mt is not None else max(ctx.max_model_len or 0, least + 1))
    if total > lim.max_tokens:
        raise bad_request(
            f"n x prompts x (prompt + max_tokens) is at least {total} tokens, over "
            f"--max-request-tokens ({lim.max_tokens}); lower n or max_tokens, or send fewer prompts",
            "max_tokens",
        )


@dataclass
class Prepared:
    """A validated request: its body, the bus requests it fans out into, and its response state."""

    kind: Kind
    body: P.CompletionRequest | P.ChatCompletionRequest
    gens: list[GenerateRequest]
    builder: ResponseBuilder


def prepare(kind: Kind, raw: bytes, ctx: Context) -> Prepared:
    """Decode and validate a body; raises APIError (400/404) exactly as the HTTP endpoints answer."""
    if kind == "chat":
        return _prepare_chat(P.decode_body(raw, P.ChatCompletionRequest), ctx)
    return _prepare_completion(P.decode_body(raw, P.CompletionRequest), ctx)


def _prepare_completion(body: P.CompletionRequest, ctx: Context) -> Prepared:
    P.check_model(body.model, ctx.served_model_name)
    params = P.sampling_params(body, ctx.vocab_size)
    prompts = P.prompts(body, ctx.vocab_size)
    check_bounds(params, prompts, ctx)
    rid = f"cmpl-{uuid.uuid4().hex}"
    builder = ResponseBuilder(
        "completion",
        rid,
        ctx.served_model_name,
        n=params.n,
        num_prompts=len(prompts),
        logprobs=params.logprobs,
        echo=body.echo,
        token_text=ctx.token_text,
    )
    gens = [
        GenerateRequest(
            request_id=f"{rid}-{i}",
            params=params,
            prompt=p if isinstance(p, str) else None,
            prompt_token_ids=p if isinstance(p, list) else None,
            priority=body.priority,
            cache_salt=body.cache_salt,
            arrival_time=time.time(),
            echo=body.echo,
        )
        for i, p in enumerate(prompts)
    ]
    return Prepared("completion", body, gens, builder)


def _prepare_chat(body: P.ChatCompletionRequest, ctx: Context) -> Prepared:
    P.check_model(body.model, ctx.served_model_name)
    params = P.sampling_params(body, ctx.vocab_size)
    messages = P.chat_messages(body.messages)
    check_bounds(params, [""], ctx)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    try:  # already checked by sampling_params
        tool_mode, _, tools = tool_mode_of(body.tools, body.tool_choice)
    except ParamError as e:
        raise from_param_error(e) from None
    builder = ResponseBuilder(
        "chat",
        rid,
        ctx.served_model_name,
        n=params.n,
        logprobs=params.logprobs,
        token_text=ctx.token_text,
        tool_mode=tool_mode,
    )
    gen = GenerateRequest(
        request_id=rid,
        params=params,
        messages=messages,
        tools=tools,
        add_generation_prompt=body.add_generation_prompt,
        priority=body.priority,
        cache_salt=body.cache_salt,
        arrival_time=time.time(),
    )
    return Prepared("chat", body, [gen], builder)


async def run(client: AsyncEngine, prep: Prepared) -> AsyncIterator[tuple[int, RequestDelta, list[Any]]]:
    """Run every bus request of `prep`, folding each delta into its builder as it comes.

    Yields (prompt index, delta, stream choices it produced). An engine-reported error or the
    engine's death raises APIError; closing the iterator early aborts the requests.
    """
    deltas = merge([client.generate(g) for g in prep.gens])
    try:
        async with closing(deltas):
            async for i, delta in deltas:
                if delta.error:
                    raise delta_error(delta.error_kind, delta.error)
                yield i, delta, prep.builder.add(i, delta)
    except Exception as e:
        if is_engine_dead(e):
            raise engine_dead(str(e)) from None
        raise


async def complete(client: AsyncEngine, prep: Prepared) -> P.Response:
    """The whole non-streamed response body."""
    async for _ in run(client, prep):
        pass
    return prep.builder.final()


# ---------------------------------------------------------------------- async helpers
@contextlib.asynccontextmanager
async def closing(it: AsyncIterator[Any]) -> AsyncIterator[AsyncIterator[Any]]:
    """Like contextlib.aclosing, for iterators that may lack aclose."""
    try:
        yield it
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


async def merge(gens: list[AsyncIterator[RequestDelta]]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Interleave several requests' deltas as they come, tagged with the prompt index."""
    if len(gens) == 1:
        async with closing(gens[0]) as g:
            async for d in g:
                yield 0, d
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, g: AsyncIterator[RequestDelta]) -> None:
        try:
            async with closing(g):
                async for d in g:
                    queue.put_nowait((i, d, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        else:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, d, err = await queue.get()
            if err is not None:
                raise err
            if d is None:
                remaining -= 1
            else:
                yield i, d
    finally:
        for t in tasks:
            t.cancel()  # closes every still-open delta iterator, which aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)
