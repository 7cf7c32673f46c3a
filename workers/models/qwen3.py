"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before rotary
(ModelConfig.qk_norm is true for the qwen3 family) and no QKV bias."""

from pagebus.workers.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
