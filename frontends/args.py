"""CLI flags for every engine option, derived from EngineConfig so names never drift:
field `max_model_len` is flag `--max-model-len`, exactly as vLLM names it."""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

import msgspec
from pagebus.bus.config import EngineConfig, make_engine_config

_HELP = {
    "model": "a .gguf file or an HF directory (config.json + safetensors); default: SmolLM2-135M-Instruct",
    "tokenizer": "tokenizer directory or model file; default: the model's own",
    "dtype": "auto picks bfloat16 on GPUs and CPUs with AVX-512 BF16, else float32 (and float32 for quantized weights on CPUs)",
    "kv_cache_memory": "bytes for the KV cache (default 1 GiB on CPU)",
    "num_kv_blocks": "exact number of KV blocks (overrides the memory budget)",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "attention_backend": "auto: Triton on CUDA, cpu (compiled ops; torch if they cannot be built) on CPU",
    "quantization": (
        "how weights are held: gguf (a GGUF's blocks kept packed), int8/fp8/fp16 (made at load; fp16: float16 "
        "weights, float32 arithmetic, half the bytes a decode step reads), gptq/awq (as the checkpoint); "
        "none: the model dtype (default: the checkpoint's declared format, else none)"
    ),
    "kv_cache_dtype": (
        "auto: the model dtype; float16: half the bytes of a float32 cache (AVX2 CPUs run float32); "
        "fp8/fp8_e4m3: e4m3 cache, half the bytes of bf16"
    ),
    "tensor_parallel_size": "worker processes that each hold 1/N of every layer",
    "pipeline_parallel_size": "contiguous layer stages, one worker group each",
    "pipeline_steps_in_flight": "steps in the pipeline at once, 1..pipeline-parallel-size; "
    "default: pipeline-parallel-size on GPUs, 1 on CPUs (stages share the cores there)",
    "distributed_executor_backend": "mp: worker processes on this machine; ray: actors on a running Ray cluster",
    "weight_cache": "keep the weights as held after loading (dense formats on CPU) in $PAGEBUS_CACHE_DIR "
    "(default ~/.cache/pagebus)/weights, so the next start skips decoding and repacking them",
    "ray_address": "Ray cluster to join with --distributed-executor-backend ray (default: RAY_ADDRESS, else the local one)",
}
_SHORT = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp"}  # vLLM's short flags


def _scalar_type(annotation: Any) -> tuple[Any, list[str] | None]:
    """(python type, choices) of an EngineConfig annotation such as `int | None` or Literal."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return str, list(args)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _scalar_type(inner[0])
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return str, None  # a JSON object, e.g. --speculative-config '{"method": "ngram", ...}'
    return annotation, None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    defaults = EngineConfig()
    for name in EngineConfig.__struct_fields__:
        flag = "--" + name.replace("_", "-")
        flags = [flag, _SHORT[name]] if name in _SHORT else [flag]
        typ, choices = _scalar_type(hints[name])
        default = getattr(defaults, name)
        help_text = _HELP.get(name, "") + (f" (default: {default})" if default is not None else "")
        if typ is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif typing.get_origin(typ) is list:  # e.g. --cuda-graph-sizes 1 2 4 8
            (item,) = typing.get_args(typ)
            group.add_argument(flag, type=item, nargs="+", default=None, help=help_text)
        else:
            group.add_argument(*flags, type=typ, choices=choices, default=None, help=help_text)
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn prefix caching off",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Only flags the user gave override the defaults."""
    given = {
        n: getattr(args, n) for n in EngineConfig.__struct_fields__ if getattr(args, n, None) is not None
    }
    return make_engine_config(**given)
