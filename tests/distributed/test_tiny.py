"""Tensor and pipeline parallelism on a tiny random Qwen2 (the Llama decoder plus a QKV bias; HF
safetensors, tied embeddings, one KV head, a vocabulary of 251 that pads to 2 x 126 rows): every
layout's greedy tokens and prefill logits equal one rank's, over gloo on this CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagebus.bus.config import EngineConfig
from pagebus.workers.distributed.layout import Layout, UnsplittableModelError
from pagebus.workers.distributed.state import Parallel
from pagebus.workers.runner import ModelRunner

from bench.gpu_e2e import write_llama_config
from tests.distributed.ranks import run_ranks
from tests.workers.drive import drive_greedy

PROMPTS = {f"r{i}": ([(11 * i + 5 * j) % 240 + 3 for j in range(2 + 7 * i)], 6) for i in range(3)}
# Float32 over 4 layers: the split changes only the order of the sums (all-reduce, row blocks).
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    import transformers as tf
    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("tiny_qwen2_gqa1"))
    cfg = tf.Qwen2Config(  # the Llama decoder with a QKV bias, which is cut like its weight
        vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # wide weights: greedy tokens far from ties
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def single(tiny: str) -> tuple[dict[str, list[int]], np.ndarray, int]:
    """One rank, in this process: tokens, the first prompt's logits, weight bytes."""
    runner = ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=64), tiny)
    tokens = drive_greedy(runner, PROMPTS)[0]
    first = PROMPTS["r0"][0]
    logits = runner.prompt_logits(first, [1]).numpy()
    return tokens, logits, sum(p.numel() * p.element_size() for p in runner.model.parameters())


def test_tp2_with_one_kv_head_equals_one_rank(tiny: str, single) -> None:
    tokens, logits, nbytes = single
    ranks = run_ranks(tiny, 2, 1, PROMPTS)
    for r in ranks:
        assert r.error is None, r.error
        assert r.tokens == tokens  # every rank samples the gathered logits alike
        np.testing.assert_allclose(r.logits, logits, atol=LOGITS_ATOL, rtol=0)
        assert r.kv_heads == 1  # the one KV head, replicated
        # Half of every split matrix, the whole norms: about half the bytes.
        assert 0.45 < r.weight_bytes / nbytes < 0.56, (r.weight_bytes, nbytes)


@pytest.mark.parametrize("depth", [1, 2], ids=["one_step", "steps_in_flight"])
def test_tp2_x_pp2_equals_one_rank(tiny: str, single, depth: int) -> None:
    tokens, logits, _ = single
    ranks = run_ranks(tiny, 2, 2, PROMPTS, pipeline_steps_in_flight=depth)
    assert [r.error for r in ranks] == [None] * 4, [r.error for r in ranks]
    assert [r.layers for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for r in ranks:
        assert r.tokens == tokens  # earlier stages learn the tokens from the last, or from the plan
    for r in ranks[2:]:
        np.testing.assert_allclose(r.logits, logits, atol=LOGITS_ATOL, rtol=0)
    assert ranks[0].logits is None and ranks[1].logits is None


def test_heads_that_do_not_split_are_refused_at_start_up(tmp_path) -> None:
    shape = dict(
        vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    write_llama_config(str(tmp_path), shape)
    cfg = EngineConfig(load_format="dummy", dtype="float32", num_kv_blocks=8, tensor_parallel_size=2)
    # The refusal comes from building the layers, before any collective: no peer is needed.
    with pytest.raises(UnsplittableModelError) as e:
        ModelRunner(cfg, str(tmp_path), 0, Parallel(Layout(2, 1, 0)))
    msg = str(e.value)
    assert "tensor_parallel_size 2" in msg and "3 attention heads" in msg and "1 KV heads" in msg, msg
