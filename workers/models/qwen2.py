"""Qwen2 / Qwen2.5: the Llama decoder with a bias on the fused QKV projection
(ModelConfig.qkv_bias is true for the qwen2 family)."""

from pagebus.workers.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
