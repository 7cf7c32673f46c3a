"""--kv-cache-dtype float16 on the default model in float32: the same memory holds twice the
blocks; the compiled CPU ops (decode stack included) give the torch backend's greedy tokens over
the same float16 cache, and those stay the float32 cache's."""

from __future__ import annotations

import pytest
import torch
from pagebus.bus.config import EngineConfig
from pagebus.kernels import cpu_native as native
from pagebus.workers.runner import ModelRunner

from tests.workers.drive import drive_greedy

KV_MEMORY = 16 << 20
# 3 prompts, one sharing the first's prefix (a prefix-cache hit), through prefill chunks of 24
PROMPTS = {
    "a": ([100 + 7 * j for j in range(40)], 12),
    "b": ([100 + 7 * j for j in range(34)] + [5, 6, 7], 12),
    "c": ([900 + 3 * j for j in range(9)], 12),
}

pytestmark = pytest.mark.skipif(
    native.available() is not None or not native.native_ops().f16_built(),
    reason="float16 caches need the compiled ops with F16C or AVX-512",
)


def _runner(model: str, kv: str, backend: str) -> ModelRunner:
    cfg = EngineConfig(
        dtype="float32", kv_cache_memory=KV_MEMORY, max_num_seqs=4, kv_cache_dtype=kv,
        attention_backend=backend, max_num_batched_tokens=24,
    )  # fmt: skip
    return ModelRunner(cfg, model)


def test_float16_cache_runs_compiled_and_gives_the_torch_backends_tokens(default_model: str) -> None:
    f32, f16 = _runner(default_model, "auto", "cpu"), _runner(default_model, "float16", "cpu")
    assert f16.kv_caches[0][0].dtype == torch.float16 and f32.kv_caches[0][0].dtype == torch.float32
    assert f16.num_blocks // 2 == f32.num_blocks  # a block: half the bytes, the same budget (floored)
    got, sched = drive_greedy(f16, PROMPTS)
    assert sched.stats().prefix_cache_hits > 0
    stack = f16.model.model._stack
    assert stack is not None and stack[1] is not None  # decode steps ran in the compiled stack
    want, _ = drive_greedy(_runner(default_model, "float16", "torch"), PROMPTS)
    assert got == want
    # float16 K/V (10 mantissa bits) moves logits by ~1e-3: these prompts keep the float32 tokens
    assert got == drive_greedy(f32, PROMPTS)[0]
