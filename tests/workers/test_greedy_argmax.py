"""A greedy step on CPU column tiles takes its tokens from the LM head's fused argmax
(kernels/csrc/cpu_ops.cpp argmax_tiles), never storing the logits: the tokens must be those the
logits' argmax gives, and a step with any row that needs the logits (logprobs here) must get
them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import AddRequest, SamplingParams
from pagebus.kernels import cpu_native as native
from pagebus.scheduler.scheduler import Scheduler
from pagebus.workers.layers.parallel import ParallelLMHead
from pagebus.workers.runner import ModelRunner

from tests.workers.drive import drive_greedy, drive_greedy_seen

BF16_TILES = pytest.mark.skipif(
    native.available() is not None or not native.native_ops().bf16_tiles_built(),
    reason="bfloat16 tiles need the compiled ops on an AVX-512 BF16 CPU",
)
PROMPTS = {f"p{i}": ([200 + 11 * i + j for j in range(9 + 13 * i)], 12) for i in range(5)}


def _runner(model: str, dtype: str, quantization: str) -> ModelRunner:
    cfg = EngineConfig(dtype=dtype, num_kv_blocks=64, max_num_seqs=8, quantization=quantization)
    return ModelRunner(cfg, model)


def _outputs_of_forward(runner: ModelRunner) -> list[torch.Tensor]:
    outs: list[torch.Tensor] = []
    forward = runner.model.forward

    def spy(fb: object) -> torch.Tensor:
        out = forward(fb)
        outs.append(out)
        return out

    runner.model.forward = spy  # type: ignore[method-assign]
    return outs


def _outputs_of_decoder(runner: ModelRunner) -> list[list[int]]:
    """What the model's greedy decoder (one native call a decode step) returns, step by step."""
    outs: list[list[int]] = []
    build = runner.model.greedy_decoder

    def spied_build(*args: Any) -> Any:
        decoder = build(*args)
        if decoder is None:
            return None

        def spy(*inputs: torch.Tensor) -> list[int]:
            outs.append(decoder(*inputs))
            return outs[-1]

        return spy

    runner.model.greedy_decoder = spied_build
    return outs


@pytest.mark.parametrize(
    ("quantization", "dtype"),
    [
        ("none", "float32"),  # float32 tiles
        pytest.param("none", "bfloat16", marks=BF16_TILES),
    ],
)
def test_greedy_tokens_come_from_the_fused_argmax(default_model: str, quantization: str, dtype: str) -> None:
    """Prefill steps take the head's argmax after `forward`'s layers; decode steps run whole in
    the decode stack (the runner's greedy decoder: embedding to argmax). Both give the ids of
    the logits' argmax."""
    if native.available() is not None:
        pytest.skip("the compiled CPU ops did not build: no column tiles")
    runner = _runner(default_model, dtype, quantization)
    outs, steps = _outputs_of_forward(runner), _outputs_of_decoder(runner)
    fused, _ = drive_greedy(runner, PROMPTS)
    assert outs and all(o.dtype is torch.int64 for o in outs)  # every prefill: ids, no logits
    assert steps and all(o and all(isinstance(i, int) for i in o) for o in steps)  # the decode steps
    # a token each
    assert sum(o.numel() for o in outs) + sum(map(len, steps)) == sum(n for _, n in PROMPTS.values())
    outs.clear()
    steps.clear()
    from_logits = drive_greedy_seen(runner, PROMPTS, lambda fb, logits: None)  # fused_greedy off
    assert outs and all(o.dtype is torch.float32 for o in outs) and not steps
    assert fused == from_logits


def test_the_head_outside_the_stack_gives_the_same_ids(
    default_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stack without the head's tiles (`argmax_weight` None) has no greedy decoder and ends at
    the final norm; the head's own fused argmax (`greedy_ids`) then takes the ids: the same."""
    if native.available() is not None:
        pytest.skip("the compiled CPU ops did not build: no column tiles")
    in_stack, _ = drive_greedy(_runner(default_model, "float32", "none"), PROMPTS)
    monkeypatch.setattr(ParallelLMHead, "argmax_weight", lambda self, dtype: None)
    runner = _runner(default_model, "float32", "none")
    outs, steps = _outputs_of_forward(runner), _outputs_of_decoder(runner)
    outside, _ = drive_greedy(runner, PROMPTS)
    assert runner.model.model._stack is not None and not runner.model.model._stack_argmax
    assert outs and all(o.dtype is torch.int64 for o in outs) and not steps
    assert in_stack == outside


def test_a_row_that_needs_logits_gets_them(default_model: str) -> None:
    """One request asks for logprobs: every step it samples in runs on logits (the greedy
    request beside it too, with the same tokens as alone)."""
    runner = _runner(default_model, "float32", "none")
    outs = _outputs_of_forward(runner)
    sched = Scheduler(runner.cfg, runner.num_blocks, runner.max_model_len, None, hash_seed=b"t")
    ids = [300 + j for j in range(20)]
    for rid, lp in (("greedy", None), ("logprobs", 2)):
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=lp)
        assert not sched.add_request(AddRequest(request_id=rid, prompt_token_ids=ids, params=params))
    got: dict[str, list[int]] = {"greedy": [], "logprobs": []}
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch is not None
        result = runner.execute(batch)
        assert len(result.seq_ids) == 2 and sum(lp is not None for lp in result.logprobs) == 1
        for u in sched.update(batch, result):
            got[u.request_id].extend(u.new_token_ids)
    assert outs and all(o.dtype is torch.float32 for o in outs)
    alone, _ = drive_greedy(_runner(default_model, "float32", "none"), {"greedy": (ids, 6)})
    assert got["greedy"] == got["logprobs"] == alone["greedy"]
