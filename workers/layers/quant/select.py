"""Which linear method a checkpoint gets, from `--quantization` and the checkpoint itself."""

from __future__ import annotations

import json
import os
from typing import Any

from pagebus.workers.layers.quant.base import LinearMethodFactory

# Formats a checkpoint's config.json can declare (quantization_config.quant_method) that we serve.
CHECKPOINT_METHODS = ("gptq", "awq")


def checkpoint_quant_config(path: str) -> dict[str, Any] | None:
    """config.json's quantization_config of an HF directory (None for GGUF files and plain ones)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path) as f:
        qc = json.load(f).get("quantization_config")
    return qc if isinstance(qc, dict) else None


def resolve(quantization: str | None, is_gguf: bool, checkpoint: dict[str, Any] | None = None) -> str:
    """The format the weights are held in: "gguf" (packed blocks), "int8", "gptq", "awq" (packed
    as stored) or "none" (float). `checkpoint`: its quantization_config; as in vLLM, a declared
    format is used when the flag is absent, and the flag must name it when given."""
    found = checkpoint.get("quant_method") if checkpoint else None
    if found is not None:
        if found not in CHECKPOINT_METHODS:
            raise ValueError(
                f"the checkpoint's config.json declares quant_method {found!r}, which is not supported "
                f"(supported: {', '.join(CHECKPOINT_METHODS)})"
            )
        if quantization not in (None, found):
            raise ValueError(
                f"--quantization {quantization} asked for, but the checkpoint is {found}-quantized "
                f"(config.json quantization_config): pass --quantization {found} or leave it out"
            )
        return str(found)
    if quantization in CHECKPOINT_METHODS:
        raise ValueError(
            f"--quantization {quantization} needs a checkpoint whose config.json has a quantization_config "
            f"with quant_method {quantization!r}; this one has none"
        )
    if quantization is None:
        return "none"
    if quantization == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf needs a .gguf file; this checkpoint is not one")
    if quantization not in ("gguf", "int8", "none"):
        raise ValueError(f"--quantization {quantization!r} is not supported (gguf, int8, gptq, awq, none)")
    return quantization


def factory(resolved: str, checkpoint: dict[str, Any] | None = None) -> LinearMethodFactory | None:
    if resolved == "gguf":
        from pagebus.workers.layers.quant.gguf import GGUFLinearMethod

        return lambda layer: GGUFLinearMethod()
    if resolved == "int8":
        from pagebus.workers.layers.quant.gguf import Int8LinearMethod

        return lambda layer: Int8LinearMethod()
    if resolved in CHECKPOINT_METHODS:
        from pagebus.workers.layers.quant.group_quant import method_factory

        return method_factory(checkpoint or {})
    return None
