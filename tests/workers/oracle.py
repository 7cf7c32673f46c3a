"""Helpers that compare pagebus with HF transformers (the correctness oracle)."""

from __future__ import annotations

import torch
from pagebus.workers.runner import ModelRunner

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colours:",
    "Translate to French: good morning",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, astronauts",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]


@torch.no_grad()
def hf_greedy(
    model: torch.nn.Module, ids: list[int], steps: int, top: int = 2
) -> tuple[list[int], list[list[int]]]:
    """Greedy tokens and the `top` highest ids at every step, with HF's own KV cache."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens: list[int] = []
    top2: list[list[int]] = []
    for _ in range(steps):
        logits = out.logits[0, -1]
        top2.append(logits.topk(top).indices.tolist())
        tok = int(logits.argmax())
        tokens.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, top2


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def prefill_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one prefill through our runner: [len(ids), vocab]."""
    bs = runner.cfg.block_size
    nblocks = (len(ids) + bs - 1) // bs
    return runner.prompt_logits(ids, list(range(1, nblocks + 1)))
