"""Tiny random-weight models of each supported architecture, saved as safetensors by HF,
give the same logits through our runner as through HF, for a prefill and several decodes."""

from __future__ import annotations

import pytest
import torch
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import CachedSeq, ExecuteBatch, NewSeq, SamplingParams
from pagebus.workers.runner import ModelRunner

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def _config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=False)
    if arch == "llama3-scaled-tied":
        scaling = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        return tf.LlamaConfig(**COMMON, rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=True)
    if arch == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=None)
    if arch == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)
    raise AssertionError(arch)


def _save(arch: str, path: str, shard: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32).eval()
    with torch.no_grad():  # random init is tiny; widen it so logits differ meaningfully
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(path, max_shard_size="100KB" if shard else "1GB")
    return model


def _run_ours(path: str, prompt: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    runner = ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=32, block_size=4), path)
    captured: list[torch.Tensor] = []
    forward = runner.model.forward
    runner.model.forward = lambda fb: captured.append(forward(fb)) or captured[-1]  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    blocks = list(range(1, 17))
    res = runner.execute(
        ExecuteBatch(0, [NewSeq("s", prompt, len(prompt), params, blocks, 0, len(prompt))], [], [])
    )
    tokens = list(res.token_ids)
    for step in range(1, steps):
        n = len(prompt) + len(tokens)
        res = runner.execute(ExecuteBatch(step, [], [CachedSeq("s", [], n - 1, 1)], []))
        tokens.extend(res.token_ids)
    return [c[0] for c in captured], tokens


@pytest.mark.parametrize("arch", ["llama", "llama3-scaled-tied", "mistral", "qwen2", "qwen3"])
def test_logits_match_hf(arch: str, tmp_path) -> None:
    hf = _save(arch, str(tmp_path), shard=arch == "llama")
    prompt = [3, 17, 99, 4, 250, 8, 8, 61, 7]
    steps = 5
    logits, tokens = _run_ours(str(tmp_path), prompt, steps)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0]
    for i, got in enumerate(logits):
        torch.testing.assert_close(got, ref[len(prompt) - 1 + i], atol=2e-4, rtol=1e-4)


def test_sharded_checkpoint_uses_index(tmp_path) -> None:
    _save("llama", str(tmp_path), shard=True)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1


def test_unsupported_architecture_is_a_clear_error(tmp_path) -> None:
    import json

    from pagebus.workers.model_config import UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        ModelRunner(EngineConfig(dtype="float32"), str(tmp_path))
