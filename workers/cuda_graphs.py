"""CUDA graphs of pure-decode steps: one per batch size, replayed with padded inputs.

A decode step of b sequences (one query token each) replays the graph of the smallest captured
size B >= b. Its inputs were captured as views of the runner's persistent device buffers at
the offsets a step of B tokens and B sequences uses (see input_batch.py), so filling those
buffers is all a replay needs. Rows b..B-1 are padding: token 0 at position 0, writing its KV
into slot 0 of the reserved null block 0 and attending to that one slot; their logits are
dropped. Steps with a prefill chunk, or more sequences than the largest size, run eagerly.

Graphs share one memory pool and keep nothing alive in it: each copies its logits into one
output buffer allocated outside the pool, so their scratch memory may overlap freely (they
never run concurrently).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(
        self, sizes: list[int], vocab_size: int, device: torch.device, stream: torch.cuda.Stream | None = None
    ) -> None:
        self.sizes = sorted(sizes)
        self.device = device
        # One side stream for every warm-up and capture: cuBLAS keeps a workspace per stream for
        # the life of the process, so a new stream per graph would leak one workspace each.
        self.stream = stream if stream is not None else torch.cuda.Stream(device)
        self.out = torch.empty(self.sizes[-1], vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.memory_bytes = 0
        self.capture_s = 0.0

    def capture(self, prepare: Callable[[int], Callable[[], torch.Tensor]]) -> None:
        """prepare(B) loads padding inputs for size B and returns the forward to capture, which
        returns logits [B, vocab]. Largest first, so smaller graphs fit in the pool it grew."""
        t0 = time.monotonic()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        for size in reversed(self.sizes):
            forward = prepare(size)

            def step(forward: Callable[[], torch.Tensor] = forward, size: int = size) -> None:
                self.out[:size].copy_(forward())

            # Warm up on the side stream: Triton compiles and cuBLAS picks its kernels outside capture.
            side = self.stream
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):
                step()
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-ups' side-stream blocks: no other stream can reuse them
        # Measured on the device, not in the allocator: graph instantiation and cuBLAS workspaces
        # take memory the caching allocator never sees.
        self.memory_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.capture_s = time.monotonic() - t0
        log.info(
            "captured %d CUDA graphs (decode batch sizes %d..%d) in %.1fs, using %.1f MiB of GPU memory",
            len(self.sizes), self.sizes[0], self.sizes[-1], self.capture_s, self.memory_bytes / (1 << 20),
        )  # fmt: skip

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured size >= num_seqs, or None when a step is too large."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, size: int) -> torch.Tensor:
        """Logits [size, vocab] of the inputs now in the buffers (valid until the next replay)."""
        self.graphs[size].replay()
        return self.out[:size]
