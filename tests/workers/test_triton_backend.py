"""The whole model on the Triton backend (the interpreter on CPU) gives the torch backend's
greedy tokens, through the real scheduler: prefill chunks, decodes and a prefix-cache hit."""

from __future__ import annotations

import pytest
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import AddRequest, SamplingParams
from pagebus.scheduler.scheduler import Scheduler
from pagebus.workers.runner import ModelRunner

from tests.workers.test_architectures import _save


def _greedy_tokens(path: str, backend: str, dtype: str) -> dict[str, list[int]]:
    cfg = EngineConfig(
        dtype=dtype, num_kv_blocks=48, block_size=4, attention_backend=backend, max_num_batched_tokens=12
    )
    runner = ModelRunner(cfg, path)
    assert runner.ops.name == backend
    sched = Scheduler(cfg, runner.num_blocks, runner.max_model_len, None, hash_seed=b"t")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = {"a": [5, 9, 17, 3, 99, 4, 1, 8, 60, 2, 33], "b": [5, 9, 17, 3, 99, 4, 1, 8, 7], "c": [42]}
    for rid, ids in prompts.items():
        sched.add_request(AddRequest(request_id=rid, prompt_token_ids=ids, params=params))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch is not None
        for u in sched.update(batch, runner.execute(batch)):
            out[u.request_id].extend(u.new_token_ids)
    assert sched.stats().prefix_cache_hits > 0
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_backend_matches_torch(tmp_path, dtype: str) -> None:
    _save("qwen3", str(tmp_path), shard=False)
    assert _greedy_tokens(str(tmp_path), "triton", dtype) == _greedy_tokens(str(tmp_path), "torch", dtype)
