"""Which linear method a checkpoint gets, from `--quantization` and the checkpoint itself."""

from __future__ import annotations

import json
import os
from typing import Any

from pagebus.workers.layers.quant.base import LinearMethodFactory

# Formats a checkpoint's config.json can declare (quantization_config.quant_method) that we serve.
CHECKPOINT_METHODS = ("gptq", "awq", "fp8")
# Formats made at load from any float checkpoint (fp8 also loads as a checkpoint ships it).
MADE_AT_LOAD = ("int8", "fp8", "fp16")


# Older AutoGPTQ / AutoAWQ directories keep the settings in a file of their own, without
# config.json's quantization_config (and often without quant_method): vLLM reads these too.
_OWN_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


def _json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        obj = json.load(f)
    return obj if isinstance(obj, dict) else None


def checkpoint_quant_config(path: str) -> dict[str, Any] | None:
    """The quantization settings of an HF directory: config.json's quantization_config, else an
    AutoGPTQ quantize_config.json or AutoAWQ quant_config.json (None for GGUF files, plain ones)."""
    cfg = _json(os.path.join(path, "config.json"))
    if cfg is None:
        return None
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict):
        return qc
    for name, method in _OWN_FILES:
        own = _json(os.path.join(path, name))
        if own is not None:
            return {"quant_method": method, **own}
    return None


def resolve(quantization: str | None, is_gguf: bool, checkpoint: dict[str, Any] | None = None) -> str:
    """The format the weights are held in: "gguf" (packed blocks), "int8", "fp8", "fp16", "gptq", "awq"
    (packed as stored) or "none" (float). `checkpoint`: its quantization_config; as in vLLM, a declared
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
    if quantization in CHECKPOINT_METHODS and quantization not in MADE_AT_LOAD:
        raise ValueError(
            f"--quantization {quantization} needs a checkpoint whose config.json has a quantization_config "
            f"with quant_method {quantization!r}; this one has none"
        )
    if quantization is None:
        return "none"
    if quantization == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf needs a .gguf file; this checkpoint is not one")
    if quantization not in ("gguf", *MADE_AT_LOAD, "none"):
        raise ValueError(
            f"--quantization {quantization!r} is not supported (gguf, int8, fp8, fp16, gptq, awq, none)"
        )
    return quantization


def factory(resolved: str, checkpoint: dict[str, Any] | None = None) -> LinearMethodFactory | None:
    if resolved == "gguf":
        from pagebus.workers.layers.quant.gguf import GGUFLinearMethod

        return lambda layer: GGUFLinearMethod()
    if resolved == "int8":
        from pagebus.workers.layers.quant.gguf import Int8LinearMethod

        return lambda layer: Int8LinearMethod()
    if resolved == "fp16":
        from pagebus.workers.layers.quant.fp16 import Fp16LinearMethod

        return lambda layer: Fp16LinearMethod()
    if resolved == "fp8":
        from pagebus.workers.layers.quant.fp8 import fp8_factory

        return fp8_factory(checkpoint)
    if resolved in CHECKPOINT_METHODS:
        from pagebus.workers.layers.quant.group_quant import method_factory

        return method_factory(checkpoint or {})
    return None
