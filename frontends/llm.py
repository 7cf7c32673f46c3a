"""The in-process Python API, as vLLM users know it:

from pagebus import LLM, SamplingParams
llm = LLM()  # default model: SmolLM2-135M-Instruct
outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from pagebus.bus.config import EngineConfig, make_engine_config
from pagebus.bus.messages import AbortRequest, AddRequest, SamplingParams
from pagebus.bus.validation import check_sampling_params
from pagebus.frontends.model_files import resolve_model, tokenizer_dir
from pagebus.frontends.output_processor import OutputProcessor
from pagebus.frontends.outputs import RequestOutput
from pagebus.frontends.tokenizer import Tokenizer

if TYPE_CHECKING:  # both engines are imported where they are built: the in-process one needs torch
    from pagebus.frontends.engine.inproc import InprocEngine
    from pagebus.frontends.mp_llm import MultiprocessBackend

PromptType = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt_token_ids": [...]}


class LLM:
    def __init__(
        self, model: str | None = None, multiprocess: bool = False, tokenizer_workers: int = 1, **kwargs: Any
    ) -> None:
        """`multiprocess=True` runs the engine in its own processes (tokenizer pool, scheduler,
        worker) behind `AsyncEngineClient`; generate() returns the same outputs."""
        cfg = make_engine_config(model=model, **kwargs)
        path = resolve_model(cfg.model)
        self.config: EngineConfig = msgspec_replace(cfg, model=path)
        self.tokenizer = Tokenizer(tokenizer_dir(cfg.tokenizer or path))
        self._mp: MultiprocessBackend | None = None
        self.engine: InprocEngine | MultiprocessBackend
        if multiprocess:
            from pagebus.frontends.mp_llm import MultiprocessBackend

            self.engine = self._mp = MultiprocessBackend(self.config, tokenizer_workers)
        else:
            from pagebus.frontends.engine.inproc import InprocEngine

            self.engine = InprocEngine(self.config, path)
        self.outputs = OutputProcessor(self.tokenizer)
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
        if self._mp is not None:
            return self._generate_mp(self._mp, batch, params, priority)
        ids = []
        for i, (prompt, p) in enumerate(zip(batch, params, strict=True)):
            text, token_ids = self._tokenize(prompt)
            ids.append(self._add(text, token_ids, p, priority[i] if priority else 0))
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        one = bool(messages) and isinstance(messages[0], dict)  # one conversation, or a list of them
        convs = [cast(list[dict[str, str]], messages)] if one else cast(list[list[dict[str, str]]], messages)
        texts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in convs
        ]
        prompts: list[PromptType] = [
            {"prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False), "prompt": t}
            for t in texts
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    # ------------------------------------------------ step-level API (vLLM's LLMEngine)
    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, priority: int = 0) -> str:
        """Queue one request; it joins the running batch at the next `step()`."""
        params = self._params_list(params, 1)[0]
        text, token_ids = self._tokenize(prompt)
        return self._add(text, token_ids, params, priority)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine.abort(AbortRequest(request_ids=request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the outputs of requests that made progress."""
        outs, to_abort = self.outputs.process(self.engine.step())
        if to_abort:
            self.engine.abort(AbortRequest(request_ids=[], samples=to_abort))
        return outs

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
            check_sampling_params(p, self.engine.vocab_size)
        return params

    def _generate_mp(
        self,
        mp: MultiprocessBackend,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priority: Sequence[int] | None,
    ) -> list[RequestOutput]:
        from pagebus.bus.messages import GenerateRequest

        reqs: list[tuple[GenerateRequest, str | None]] = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            rid, prio, now = str(next(self._ids)), priority[i] if priority else 0, time.time()
            if isinstance(prompt, str):  # the pool tokenizes text, exactly as _tokenize would
                req = GenerateRequest(
                    request_id=rid, params=p, prompt=prompt, priority=prio, arrival_time=now
                )
                reqs.append((req, prompt))
                continue
            text, ids = self._tokenize(prompt)
            req = GenerateRequest(
                request_id=rid, params=p, prompt_token_ids=ids, priority=prio, arrival_time=now
            )
            reqs.append((req, text))
        return mp.generate(reqs)

    def shutdown(self) -> None:
        """Stop the engine processes (multiprocess=True); a no-op in-process."""
        if self._mp is not None:
            self._mp.close()

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        return None, list(prompt)

    def _add(self, text: str | None, token_ids: list[int], p: SamplingParams, priority: int) -> str:
        rid = str(next(self._ids))
        self.outputs.add(rid, text, token_ids, p)
        self.engine.add(
            AddRequest(
                request_id=rid,
                prompt_token_ids=token_ids,
                params=p,
                arrival_time=time.time(),
                priority=priority,
            )
        )
        return rid

    def _run(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req", file=sys.stderr)
        while len(done) < len(ids):
            if not self.engine.has_unfinished():
                raise RuntimeError(f"engine went idle with {len(ids) - len(done)} requests unfinished")
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]


def msgspec_replace(cfg: EngineConfig, **changes: Any) -> EngineConfig:
    import msgspec

    return msgspec.structs.replace(cfg, **changes)
