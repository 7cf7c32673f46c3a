"""Draft-model speculation on the default model gives the plain greedy tokens: drafting for
itself (nearly every draft accepted) and with a tiny random draft of the same vocabulary (nearly
every draft rejected), with prefix caching and through preemption."""

from __future__ import annotations

import msgspec
import pytest
import torch
from pagebus.bus.config import SpeculativeConfig
from pagebus.workers.spec.draft import DraftModel

from tests.workers.oracle import PROMPTS
from tests.workers.test_spec_decode import COPY, run


@pytest.fixture(scope="module")
def runner(llm_fp32):
    return llm_fp32.engine.runner


@pytest.fixture(scope="module")
def prompts(llm_fp32) -> list[list[int]]:
    return [llm_fp32.tokenizer.encode(p) for p in [PROMPTS[2], PROMPTS[4], COPY[1]]]


@pytest.fixture(scope="module")
def reference(runner, prompts) -> list[list[int]]:
    return run(runner, prompts, runner.cfg)[0]


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory, runner) -> str:
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=runner.model_config.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=runner.max_model_len,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = str(tmp_path_factory.mktemp("tiny-draft"))
    model.save_pretrained(path)
    return path


def _with_draft(runner, path: str, k: int, **cfg):
    spec = SpeculativeConfig(
        method="draft_model", model=path, num_speculative_tokens=k, disable_by_batch_size=64
    )
    runner.drafter = DraftModel(runner, path)
    return msgspec.structs.replace(runner.cfg, speculative_config=spec, **cfg)


@pytest.fixture(autouse=True)
def _detach(runner):
    yield
    runner.drafter = None  # the shared runner goes back to plain


def test_self_draft_accepts_nearly_everything(runner, prompts, reference, default_model: str) -> None:
    cfg = _with_draft(runner, default_model, 3)
    got, _, st = run(runner, prompts, cfg)
    assert got == reference
    assert st.spec_num_accepted_tokens >= 0.9 * st.spec_num_draft_tokens > 0


def test_tiny_random_draft_changes_nothing(runner, prompts, reference, tiny_draft: str) -> None:
    cfg = _with_draft(runner, tiny_draft, 2, enable_prefix_caching=False)
    got, _, st = run(runner, prompts, cfg)
    assert got == reference and st.spec_num_draft_tokens > 0
    cfg = _with_draft(runner, tiny_draft, 4)
    got, _, st = run(runner, prompts, cfg, num_blocks=8)  # 7 blocks for sequences needing 8
    assert st.num_preemptions > 0
    assert got == reference
