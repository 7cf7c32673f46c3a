"""Which linear method a checkpoint gets, from `--quantization` and the checkpoint itself."""

from __future__ import annotations

from pagebus.workers.layers.quant.base import LinearMethodFactory


def resolve(quantization: str | None, is_gguf: bool) -> str:
    """The format the weights are held in: "gguf" (packed blocks), "int8" or "none" (float)."""
    if quantization is None:
        return "none"
    if quantization == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf needs a .gguf file; this checkpoint is not one")
    if quantization not in ("gguf", "int8", "none"):
        raise ValueError(f"--quantization {quantization!r} is not supported (gguf, int8, none)")
    return quantization


def factory(resolved: str) -> LinearMethodFactory | None:
    if resolved == "gguf":
        from pagebus.workers.layers.quant.gguf import GGUFLinearMethod

        return lambda layer: GGUFLinearMethod()
    if resolved == "int8":
        from pagebus.workers.layers.quant.gguf import Int8LinearMethod

        return lambda layer: Int8LinearMethod()
    return None
