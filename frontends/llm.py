"""The Python API, as vLLM users know it:

from pagebus import LLM, SamplingParams
llm = LLM()  # default model: SmolLM2-135M-Instruct
outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))

Written once against `Engine` (frontends/engine/interface.py): the in-process engine by default,
the multi-process one with `multiprocess=True`; every method works the same on both.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence
from typing import Any, cast

import msgspec
from pagebus.bus.config import EngineConfig, make_engine_config
from pagebus.bus.messages import ChatMessage, GenerateRequest, SamplingParams
from pagebus.bus.validation import check_sampling_params
from pagebus.frontends.engine.interface import Engine
from pagebus.frontends.model_files import resolve_model, tokenizer_dir
from pagebus.frontends.outputs import RequestOutput, apply_delta, new_output
from pagebus.frontends.tokenizer import Tokenizer

PromptType = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt_token_ids": [...]}


class LLM:
    def __init__(
        self, model: str | None = None, multiprocess: bool = False, tokenizer_workers: int = 1, **kwargs: Any
    ) -> None:
        """`multiprocess=True` runs the engine in its own processes (tokenizer processes, scheduler,
        workers), as the server does, and so does any tensor_parallel_size or
        pipeline_parallel_size above 1; every method returns the same outputs."""
        cfg = make_engine_config(model=model, **kwargs)
        path = resolve_model(cfg.model)
        self.config: EngineConfig = msgspec.structs.replace(cfg, model=path)
        self.tokenizer = Tokenizer(tokenizer_dir(cfg.tokenizer or path))
        self.engine: Engine
        # One worker process per rank: tensor/pipeline parallelism always runs as processes.
        if multiprocess or cfg.tensor_parallel_size * cfg.pipeline_parallel_size > 1:
            from pagebus.frontends.engine.sync_client import MultiprocEngine

            self.engine = MultiprocEngine(self.config, tokenizer_workers)
        else:  # imported here: the in-process engine imports torch
            from pagebus.frontends.engine.inproc import InprocEngine

            self.engine = InprocEngine(self.config, path, self.tokenizer)
        self._outputs: dict[str, RequestOutput] = {}  # unfinished requests, by id
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        # One prompt is text, a {...} or a list of token ids; only the values tell it from many.
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            batch = [cast(PromptType, prompts)]
        else:
            batch = list(cast(Sequence[PromptType], prompts))
        params = self._params_list(sampling_params, len(batch))
        ids = [
            self._add(*self._request(prompt, p, priority[i] if priority else 0, final_only=True))
            for i, (prompt, p) in enumerate(zip(batch, params, strict=True))
        ]
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """`tools`: OpenAI tool definitions, rendered into the prompt (frontends/structured/tools.py)."""
        one = bool(messages) and isinstance(messages[0], dict)  # one conversation, or a list of them
        convs = [cast(list[dict[str, str]], messages)] if one else cast(list[list[dict[str, str]]], messages)
        params = self._params_list(sampling_params, len(convs))
        ids = [
            self._add(
                None,
                GenerateRequest(
                    request_id=str(next(self._ids)),
                    params=p,
                    messages=msgspec.convert(c, list[ChatMessage]),
                    add_generation_prompt=add_generation_prompt,
                    arrival_time=time.time(),
                    tools=tools,
                    echo=True,  # the first delta brings the templated prompt: RequestOutput.prompt
                    final_only=True,
                ),
            )
            for c, p in zip(convs, params, strict=True)
        ]
        return self._run(ids, use_tqdm)

    # ------------------------------------------------ step-level API (vLLM's LLMEngine)
    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, priority: int = 0) -> str:
        """Queue one request; it joins the running batch at the next `step()`."""
        return self._add(*self._request(prompt, self._params_list(params, 1)[0], priority))

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step (multi-process: what the engine produced since the last call); returns
        the outputs of requests that made progress, with this step's `text_delta`s."""
        changed: dict[str, RequestOutput] = {}
        for d in self.engine.step():
            out = self._outputs.get(d.request_id)
            if out is None:
                continue  # not ours, or already finished
            if d.request_id not in changed:
                for s in out.outputs:
                    s.text_delta, s.new_token_ids = "", []
                changed[d.request_id] = out
            apply_delta(out, d)
            if out.finished:
                del self._outputs[d.request_id]
        return list(changed.values())

    def shutdown(self) -> None:
        """Stop the engine (the engine processes, with multiprocess=True)."""
        self.engine.shutdown()

    # ------------------------------------------------------------------ internals
    def _params_list(
        self, sp: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sp is None:
            sp = SamplingParams()
        params = [sp] * n if isinstance(sp, SamplingParams) else list(sp)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        for p in params:
            check_sampling_params(p, self.engine.info.vocab_size)
        return params

    def _request(
        self, prompt: PromptType, params: SamplingParams, priority: int, final_only: bool = False
    ) -> tuple[str | None, GenerateRequest]:
        """(prompt text if known, the request). Text is tokenized by the engine; token ids (a
        list, or a dict's, whose "prompt" is kept as the text) pass as they are. final_only:
        only the finished output is read (generate), not the text deltas of each step."""
        rid, now = str(next(self._ids)), time.time()
        if isinstance(prompt, str):
            req = GenerateRequest(
                request_id=rid, params=params, prompt=prompt, priority=priority, arrival_time=now,
                final_only=final_only,
            )  # fmt: skip
            return prompt, req
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        ids = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else list(prompt)
        req = GenerateRequest(
            request_id=rid, params=params, prompt_token_ids=ids, priority=priority, arrival_time=now,
            final_only=final_only,
        )  # fmt: skip
        return text, req

    def _add(self, text: str | None, req: GenerateRequest) -> str:
        self._outputs[req.request_id] = new_output(req.request_id, text, req.params)
        try:
            self.engine.add(req)
        except BaseException:
            del self._outputs[req.request_id]
            raise
        return req.request_id

    def _run(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        outs = {rid: self._outputs[rid] for rid in ids}
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req", file=sys.stderr)
        left = len(ids)
        while left:
            if not self.engine.has_unfinished():
                raise RuntimeError(f"engine went idle with {left} requests unfinished")
            for out in self.step():
                if out.finished and out.request_id in outs:
                    left -= 1
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [outs[rid] for rid in ids]
