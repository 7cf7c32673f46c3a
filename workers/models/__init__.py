"""One file per architecture family; `model_class` picks it from the config."""

from __future__ import annotations

from pagebus.workers.model_config import ModelConfig
from torch import nn


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    from pagebus.workers.models.llama import LlamaForCausalLM
    from pagebus.workers.models.qwen2 import Qwen2ForCausalLM
    from pagebus.workers.models.qwen3 import Qwen3ForCausalLM

    return {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}[cfg.family]
