"""Device, dtype and KV-cache sizing decisions, made once at worker start."""

from __future__ import annotations

import functools

import torch
from pagebus.bus.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from pagebus.workers.model_config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(cfg: EngineConfig, rank: int = 0) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device; use --device cpu")
    return dev


@functools.cache
def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on GPUs and on CPUs with native bf16 (AVX-512 BF16/AMX), float32 elsewhere."""
    if cfg.dtype != "auto":
        return _DTYPES[cfg.dtype]
    if device.type == "cuda" or cpu_has_bf16():
        return torch.bfloat16
    return torch.float32


def kv_bytes_per_block(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * elem


def num_kv_blocks(cfg: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Blocks that fit the budget: --num-kv-blocks, else --kv-cache-memory bytes, else on CUDA
    the free share of --gpu-memory-utilization after the weights are loaded, else 1 GiB."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    per_block = kv_bytes_per_block(mc, cfg.block_size, dtype)
    if cfg.kv_cache_memory is not None:
        budget = cfg.kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - total * (1.0 - cfg.gpu_memory_utilization))
    else:
        budget = DEFAULT_KV_CACHE_MEMORY
    blocks = budget // per_block
    if blocks < 2:
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds {blocks} blocks of {per_block} bytes; "
            "raise --kv-cache-memory (or --gpu-memory-utilization)"
        )
    return int(blocks)
