"""The whole model on the Triton backend (the interpreter on CPU) and on the compiled CPU ops
gives the torch backend's greedy tokens, through the real scheduler: prefill chunks, decodes
and a prefix-cache hit."""

from __future__ import annotations

import pytest
from pagebus.bus.config import EngineConfig
from pagebus.workers.runner import ModelRunner

from tests.workers.drive import drive_greedy
from tests.workers.test_architectures import _save


def _greedy_tokens(path: str, backend: str, dtype: str) -> dict[str, list[int]]:
    cfg = EngineConfig(
        dtype=dtype, num_kv_blocks=48, block_size=4, attention_backend=backend, max_num_batched_tokens=12
    )
    runner = ModelRunner(cfg, path)
    assert runner.ops.name == backend
    prompts = {"a": [5, 9, 17, 3, 99, 4, 1, 8, 60, 2, 33], "b": [5, 9, 17, 3, 99, 4, 1, 8, 7], "c": [42]}
    out, sched = drive_greedy(runner, {rid: (ids, 4) for rid, ids in prompts.items()})
    assert sched.stats().prefix_cache_hits > 0
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_backend_matches_torch(tmp_path, backend: str, dtype: str) -> None:
    _save("qwen3", str(tmp_path), shard=False)
    assert _greedy_tokens(str(tmp_path), backend, dtype) == _greedy_tokens(str(tmp_path), "torch", dtype)
