"""llama.cpp peer (llama-cpp-python, low-level API). Run with the llamacpp peer's python.

    echo JOB | python bench/peer_runners/llamacpp_runner.py      (job format: _harness.py)

model: a GGUF (an F32/F16/BF16/Q8_0 rewrite of the default model, or the Q4_1 original). options:
threads, n_batch (tokens per llama_decode call), n_ubatch (tokens per compute graph, <= n_batch),
ctx_per_seq. Several sequences are
decoded together through `llama_batch`, one KV cache per sequence (kv_unified=False: a unified
cache halves throughput on 2 cores), which is how llama-server batches. Greedy argmax over the
logits in numpy. Single stream is the same path with one sequence.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp
import numpy as np
from _harness import Generate, run_driver


class BatchedGreedy:
    def __init__(self, path: str, options: dict[str, Any]) -> None:
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_mmap = False  # mmap reads stall on this VM; hold the weights in RAM
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_batch = int(options.get("n_batch", 2048))
        self.n_ubatch = min(self.n_batch, int(options.get("n_ubatch", self.n_batch)))
        self.threads = int(options.get("threads", 2))
        self.ctx_per_seq = int(options.get("ctx_per_seq", 512))
        self.contexts: dict[int, Any] = {}  # n_seq -> context, made once (in the warm-up)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)

    def context(self, n_seq: int) -> Any:
        if n_seq not in self.contexts:
            p = llama_cpp.llama_context_default_params()
            p.n_seq_max = n_seq
            p.n_ctx = n_seq * self.ctx_per_seq  # split evenly between sequences when not unified
            p.n_batch, p.n_ubatch = self.n_batch, self.n_ubatch
            p.n_threads = p.n_threads_batch = self.threads
            p.kv_unified = False
            ctx = llama_cpp.llama_init_from_model(self.model, p)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context for {n_seq} sequences")
            self.contexts[n_seq] = ctx
        ctx = self.contexts[n_seq]
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        return ctx

    def _decode(self, ctx: Any, items: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """Decode (seq, pos, token, want_logits) items; return argmax of the rows that want logits."""
        b = self.batch
        for i, (seq, pos, tok, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        if (rc := llama_cpp.llama_decode(ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(1 for it in items if it[3])
        ptr = llama_cpp.llama_get_logits(ctx)
        logits = np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (n_out, self.n_vocab)
        )
        return logits.argmax(axis=1)  # rows follow the order of the items that want logits

    def __call__(self, prompts: list[list[int]], n: int) -> list[int]:
        if max(len(p) for p in prompts) + n > self.ctx_per_seq:
            raise ValueError(f"prompt + {n} tokens exceeds ctx_per_seq={self.ctx_per_seq}")
        ctx = self.context(len(prompts))
        # Prefill every prompt, packed into batches of up to n_batch tokens.
        items = [(s, i, t, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
        last: list[int] = []
        for start in range(0, len(items), self.n_batch):
            last += self._decode(ctx, items[start : start + self.n_batch]).tolist()
        counts = [1] * len(prompts)
        for _ in range(n - 1):  # one token per sequence per step; ignore EOS, as the job asks
            step = [(s, len(p) + counts[s] - 1, last[s], True) for s, p in enumerate(prompts)]
            last = self._decode(ctx, step).tolist()
            counts = [c + 1 for c in counts]
        return counts


def load(job: dict[str, Any]) -> Generate:
    return BatchedGreedy(job["model"], job.get("options", {}))


if __name__ == "__main__":
    run_driver("llamacpp", llama_cpp.__version__, load)
