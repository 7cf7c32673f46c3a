"""Structured outputs: the per-row cost of the grammar mask, and a constrained batch's throughput
against an unconstrained one in the same run.

    python -m bench.structured [--batch-sizes 1 32] [--num-requests 32] [--max-tokens 64] [--repeats 2]

mask: `GrammarStates.mask` (matcher catch-up, bitmask fill, apply on the logits rows) along a
real JSON document of the bench schema, tokenized; microseconds per constrained row per step,
the median over the document's tokens, for each batch size. compile: the schema's first compile
(the worker's background thread) and a cached lookup. throughput: `LLM.generate` of
--num-requests greedy requests, constrained by the schema or free (ignore_eos, each row as many
tokens as its constrained twin; prompts prefix-cached beforehand, so neither pays prefills),
interleaved A/B/A/B; output tokens per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from pagebus.bus.messages import SamplingParams, StructuredOutputsParams

from bench.common import emit, log, setup_logging

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "tags", "address", "score"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Alice Smith",
    "age": 42,
    "tags": ["a", "ccc"],
    "address": {"city": "Paris", "zip": "75001"},
    "score": 0.75,
}


def mask_cost(model: str, batch_sizes: list[int]) -> tuple[dict[str, Any], dict[str, float]]:
    from pagebus.frontends.tokenizer import Tokenizer
    from pagebus.workers.structured import GrammarStates

    tok = Tokenizer.from_model(model)
    vocab = len(tok)
    ids = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    c = StructuredOutputsParams(json=SCHEMA)
    t0 = time.perf_counter()
    gs = GrammarStates(model, vocab, [tok.eos_token_id or 0])
    gs.prefetch(StructuredOutputsParams(regex="a")).result()  # xgrammar and the vocabulary
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gs.prefetch(c).result()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gs.prefetch(c).result()
    cached_s = time.perf_counter() - t0
    out: dict[str, Any] = {}
    for b in batch_sizes:
        logits = torch.randn(b, vocab)
        per_row: list[float] = []
        for step in range(len(ids) + 1):
            rows = [(i, f"s{i}", c, ids[:step]) for i in range(b)]
            work = logits.clone()
            t0 = time.perf_counter()
            gs.mask(work, rows)
            per_row.append((time.perf_counter() - t0) / b * 1e6)
            assert step == len(ids) or bool(work[0, ids[step]] > -torch.inf)  # the document stays allowed
        for i in range(b):
            gs.forget(f"s{i}")
        out[str(b)] = {
            "median_us_per_row": statistics.median(per_row),
            "mean_us_per_row": statistics.mean(per_row),
        }
        log.info("mask, batch %d: %.1f us/row (median)", b, out[str(b)]["median_us_per_row"])
    return out, {
        "xgrammar_init_s": init_s,
        "schema_compile_ms": compile_s * 1e3,
        "cached_lookup_ms": cached_s * 1e3,
    }


def throughput(model: str, num: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    from pagebus import LLM

    llm = LLM(model, seed=0)
    prompts = [f"Write a JSON record for person number {i}." for i in range(num)]
    constrained = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    llm.generate(prompts[:2], constrained, use_tqdm=False)  # compile and warm up
    # every prompt in the prefix cache and one full-batch decode first: otherwise the first kind
    # measured pays the prefills and the first decode at this batch size
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    runs: dict[str, list[float]] = {"constrained": [], "free": []}
    lengths: list[int] = []
    for _ in range(repeats):
        for kind in ("constrained", "free"):
            # free rows run exactly as many tokens as their constrained twins (ignore_eos), so
            # both batches shrink the same way and only the constraint's cost differs
            params: list[SamplingParams] = (
                [constrained] * num
                if kind == "constrained"
                else [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
            )
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            if kind == "constrained":
                lengths = [len(o.outputs[0].token_ids) for o in outs]
            runs[kind].append(n / dt)
            log.info("%s: %.1f tok/s", kind, n / dt)
    c, f = statistics.median(runs["constrained"]), statistics.median(runs["free"])
    return {
        "constrained_tok_s": c,
        "free_tok_s": f,
        "constrained_over_free": c / f,
        "constrained_output_tokens": lengths,
        "runs": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    setup_logging()
    from pagebus.frontends.model_files import resolve_model

    model = resolve_model(args.model)
    masks, compile_times = mask_cost(model, args.batch_sizes)
    result: dict[str, Any] = {"bench": "structured", "engine": "xgrammar", "mask": masks, **compile_times}
    if not args.skip_throughput:
        result["throughput"] = throughput(model, args.num_requests, args.max_tokens, args.repeats)
    emit(result)


if __name__ == "__main__":
    main()
