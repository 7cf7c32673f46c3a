"""The last layer of a step with prefill tokens carries on past attention with the sampled rows
alone (workers/models/llama.py Model.forward): its logits must equal, bit for bit, those of every
row through every layer, with chunked prompts (chunks that end mid-prompt sample no row) beside
decodes, and the last layer must really have run on fewer rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from pagebus.bus.config import EngineConfig
from pagebus.workers.models.llama import DecoderLayer
from pagebus.workers.runner import ModelRunner

from tests.workers.drive import drive_greedy_seen

# 40, 49 and 58 tokens in steps of 32: chunks ending mid-prompt, prompts finishing beside decodes
PROMPTS = {f"p{i}": ([100 + 11 * i + j for j in range(40 + 9 * i)], 6) for i in range(3)}


def _run(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, list[int]], list[Any]]:
    """Each step's (logits, rows into the model, rows out of its last layer), and the tokens."""
    steps: list[Any] = []
    last = runner.model.model.held_layers[-1]
    layer_call: Callable[..., Any] = DecoderLayer.__call__
    out_rows: list[int] = []  # the last layer's output rows, this step

    def spy_layer(self, x, *args):  # type: ignore[no-untyped-def]
        out = layer_call(self, x, *args)
        if self is last:
            out_rows.append(out[0].shape[0])
        return out

    def seen(fb: Any, logits: torch.Tensor) -> None:
        steps.append((logits.clone(), fb.input_ids.shape[0], list(out_rows)))
        out_rows.clear()

    monkeypatch.setattr(DecoderLayer, "__call__", spy_layer)
    return drive_greedy_seen(runner, PROMPTS, seen), steps


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_pruned_last_layer_equals_all_rows(
    default_model: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = EngineConfig(
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        attention_backend=backend,
    )
    runner = ModelRunner(cfg, default_model)
    model = runner.model.model
    pruned_tokens, pruned = _run(runner, monkeypatch)
    model.prune_last_layer = False
    full_tokens, full = _run(runner, monkeypatch)
    assert pruned_tokens == full_tokens
    assert len(pruned) == len(full)
    saw_mid_chunk = saw_mixed = False
    for (a, rows, last_rows), (b, rows_b, last_full) in zip(pruned, full, strict=True):
        assert rows == rows_b
        assert torch.equal(a, b)
        if rows > 1 and last_rows:  # steps through the layers one by one (not the decode stack)
            # the last layer put out the sampled rows alone; without pruning, every row
            assert last_rows == [a.shape[0]] and last_full == [rows]
            saw_mid_chunk |= a.shape[0] == 0
            saw_mixed |= 0 < a.shape[0] < rows
    assert saw_mid_chunk and saw_mixed
