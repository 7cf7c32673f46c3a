"""What a model file says about its architecture, read from config.json or GGUF metadata."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    # HF `architectures[0]` / GGUF `general.architecture` -> our model family
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"


def _family(arch: str, source: str) -> str:
    fam = SUPPORTED_ARCHITECTURES.get(arch)
    if fam is None:
        known = sorted(k for k in SUPPORTED_ARCHITECTURES if k[0].isupper())
        raise UnsupportedModelError(f"{source}: architecture {arch!r} is not supported; supported: {known}")
    return fam


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def config_from_hf(path: str) -> ModelConfig:
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    arch = (c.get("architectures") or [c.get("model_type", "?")])[0]
    fam = _family(arch, path)
    heads = c["num_attention_heads"]
    # transformers 5 writes rope_parameters instead of rope_theta/rope_scaling
    rope = c.get("rope_parameters") or {}
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    return ModelConfig(
        family=fam,
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position=c.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        sliding_window=c.get("sliding_window") if c.get("use_sliding_window", True) else None,
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=_eos_ids(c.get("eos_token_id")),
    )


def config_from_gguf(fields: dict[str, Any], tensor_names: set[str], source: str) -> ModelConfig:
    """`fields`: GGUF metadata key -> decoded value."""
    arch = fields["general.architecture"]
    fam = _family(arch, source)

    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    vocab = get("vocab_size") or len(fields.get("tokenizer.ggml.tokens", []))
    scaling = None
    if get("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": get("rope.scaling.type"), "factor": get("rope.scaling.factor", 1.0)}
    return ModelConfig(
        family=fam,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=heads,
        num_kv_heads=get("attention.head_count_kv") or heads,
        head_dim=get("attention.key_length") or hidden // heads,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position=get("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=scaling,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(fields.get("tokenizer.ggml.eos_token_id")),
    )
