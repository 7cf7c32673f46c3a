"""The compute backend: which implementation of each fused op the model calls.

`torch` runs the `*_cpu` functions of `kernels/`: the `*_ref` specs' results with fewer passes
and copies (attention reads the paged cache in place; the KV write is the ref). `triton` runs the
Triton launchers (CUDA, or the interpreter in tests). The model only sees an `Ops`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


def torch_ops() -> Ops:
    from pagebus.kernels.activation import silu_and_mul_cpu
    from pagebus.kernels.kv_cache_write import write_kv_cache_ref
    from pagebus.kernels.paged_attention_cpu import paged_attention_cpu
    from pagebus.kernels.rms_norm import rms_norm_cpu
    from pagebus.kernels.rotary import rotary_embedding_cpu

    return Ops(
        "torch", rms_norm_cpu, rotary_embedding_cpu, silu_and_mul_cpu, write_kv_cache_ref, paged_attention_cpu
    )


def triton_ops() -> Ops:
    from pagebus.kernels.activation import silu_and_mul
    from pagebus.kernels.kv_cache_write import write_kv_cache
    from pagebus.kernels.paged_attention import paged_attention
    from pagebus.kernels.rms_norm import rms_norm
    from pagebus.kernels.rotary import rotary_embedding

    return Ops("triton", rms_norm, rotary_embedding, silu_and_mul, write_kv_cache, paged_attention)


def select_ops(backend: str, device: torch.device) -> Ops:
    """auto: Triton on CUDA, torch elsewhere. The choice is logged once at start-up."""
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    ops = triton_ops() if backend == "triton" else torch_ops()
    log.info("attention backend: %s (device %s)", ops.name, device)
    return ops
