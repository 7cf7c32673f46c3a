"""Device, dtype and KV-cache sizing decisions, made once at worker start."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from pagebus.bus.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from pagebus.workers.model_config import ModelConfig

log = logging.getLogger(__name__)
GiB = 1 << 30

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(cfg: EngineConfig, rank: int = 0) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device; use --device cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", rank)  # set_device and memory queries want an index
    return dev


@functools.cache
def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(cfg: EngineConfig, device: torch.device, held: str = "none") -> torch.dtype:
    """auto: bfloat16 on GPUs and on CPUs with native bf16 (AVX-512 BF16/AMX), float32 elsewhere;
    and float32 on CPUs for weights held quantized (`held`, quant/select.py resolve), whose CPU
    kernels take float32 activations (as llama.cpp's do): in bf16 every matmul would convert."""
    if cfg.dtype != "auto":
        return _DTYPES[cfg.dtype]
    if device.type == "cuda":
        return torch.bfloat16
    if cpu_has_bf16() and held == "none":
        return torch.bfloat16
    return torch.float32


def kv_bytes_per_block(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * elem


@dataclass(frozen=True)
class MemoryProfile:
    """What a CUDA worker measured before sizing its KV cache (bytes)."""

    weights: int  # allocated by loading the model
    peak_activations: int  # peak above the weights during a maximal step (and its sampling)
    graph_bytes: int  # what capturing the decode graphs took from the device, measured by a trial capture


def profiled_kv_budget(cfg: EngineConfig, device: torch.device, prof: MemoryProfile) -> int:
    """gpu_memory_utilization * total, less everything in use now (weights, CUDA context, other
    processes), the activation peak and the graphs still to be captured. Call after
    empty_cache(), so memory in use is what stays in use."""
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    budget = int(cfg.gpu_memory_utilization * total) - in_use - prof.peak_activations - prof.graph_bytes
    log.info(
        "KV budget on %s: %.2f GiB = %.2f x %.2f GiB total - %.2f GiB in use (weights %.2f GiB, "
        "other %.2f GiB) - %.2f GiB peak activations - %.2f GiB CUDA graphs (measured)",
        device, budget / GiB, cfg.gpu_memory_utilization, total / GiB, in_use / GiB, prof.weights / GiB,
        (in_use - prof.weights) / GiB, prof.peak_activations / GiB, prof.graph_bytes / GiB,
    )  # fmt: skip
    return budget


def num_kv_blocks(
    cfg: EngineConfig,
    mc: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    cuda_budget: int | None = None,
) -> int:
    """Blocks that fit the budget: --num-kv-blocks, else --kv-cache-memory bytes, else on CUDA
    the profiled budget (`profiled_kv_budget`), else 1 GiB."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    per_block = kv_bytes_per_block(mc, cfg.block_size, dtype)
    if cfg.kv_cache_memory is not None:
        budget = cfg.kv_cache_memory
    elif device.type == "cuda":
        if cuda_budget is None:
            raise ValueError("a CUDA worker sizes its KV cache from a memory profile; none was taken")
        budget = cuda_budget
    else:
        budget = DEFAULT_KV_CACHE_MEMORY
    blocks = budget // per_block
    if blocks < 2:
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds {blocks} blocks of {per_block} bytes; "
            "raise --kv-cache-memory (or --gpu-memory-utilization)"
        )
    return int(blocks)


def needs_memory_profile(cfg: EngineConfig, device: torch.device) -> bool:
    return device.type == "cuda" and cfg.num_kv_blocks is None and cfg.kv_cache_memory is None
