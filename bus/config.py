"""The engine configuration: one frozen tree, validated once, sent to every process.

Option names follow vLLM (`LLM(**kwargs)` and CLI flags share them). Environment
variables are read here and nowhere else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import msgspec
from pagebus.bus.validation import need

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
SchedulingPolicy = Literal["fcfs", "priority"]
AttentionBackend = Literal["auto", "triton", "torch", "cpu"]
LoadFormat = Literal["auto", "dummy"]
# How the workers start (vLLM's name): mp spawns them as processes of this machine (and of the
# --node-rank machines); ray places them as actors on an existing Ray cluster (bus/ray_executor.py).
ExecutorBackend = Literal["mp", "ray"]
# gguf: a GGUF file's blocks stay packed (Q4_0/Q4_1/Q8_0); int8: weight-only, per channel, made
# at load from any float checkpoint; gptq/awq: 4-bit (GPTQ also 8-bit) safetensors checkpoints,
# detected from config.json's quantization_config when not given; fp8: e4m3 weights with per-row
# scales, from an fp8 checkpoint (detected too) or made at load; fp16: float16 weights made at load,
# multiplied in float32 (llama.cpp's F16); none: dequantized at load
Quantization = Literal["gguf", "int8", "gptq", "awq", "fp8", "fp16", "none"]
# The paged KV cache's element type (vLLM's names): auto is the model dtype; fp8 and fp8_e4m3 store
# e4m3 with a per-layer scale for K and for V (kernels/fp8.py)
KVCacheDtype = Literal["auto", "float16", "fp8", "fp8_e4m3"]

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB on CPU when nothing is given
SpecMethod = Literal["ngram", "draft_model"]
# Running sequences above which a step does not speculate (verifying k extra positions per
# sequence stops paying once a step is compute-bound). bench/spec_decode.py on the default model
# (2-core CPU, n-gram k=4, half rewrite / half free prompts) still gained 1.2x at 8 and 16
# sequences (bench/results/spec_decode_cpu.json), so speculation stays on up to 16.
DEFAULT_SPEC_DISABLE_BATCH_SIZE = 16


class SpeculativeConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """vLLM's `--speculative-config` JSON: an n-gram (prompt lookup) or a draft-model proposer."""

    method: SpecMethod
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # n-gram: longest suffix matched against earlier tokens
    prompt_lookup_min: int = 2  # n-gram: shortest
    model: str | None = None  # draft_model: a .gguf or HF directory with the target's vocabulary
    # A step speculates only while at most this many sequences run (vLLM's name).
    disable_by_batch_size: int = DEFAULT_SPEC_DISABLE_BATCH_SIZE


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    tokenizer: str | None = None  # None: the model's own
    dtype: Dtype = "auto"
    max_model_len: int | None = None  # None: the model's context length
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: see gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # override the computed block count (tests, tuning)
    seed: int = 0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    attention_backend: AttentionBackend = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    num_threads: int | None = None  # torch intra-op threads in the worker; None: torch's default
    tensor_parallel_size: int = 1  # ranks that split every layer (one worker process each)
    pipeline_parallel_size: int = 1  # contiguous layer stages; workers = tensor x pipeline
    # Steps in the pipeline at once, one per virtual engine (scheduler/virtual.py), 1..pipeline_
    # parallel_size. None: pipeline_parallel_size on GPUs, 1 on CPUs (see steps_in_flight).
    pipeline_steps_in_flight: int | None = None
    # Plan step N+1 while the workers run step N (vLLM's name): that plan counts on the token each
    # sequence samples in step N, which the workers keep, so they never wait for the scheduler
    # between steps. None: on, but off with speculative decoding (drafts follow the last token)
    # and with several pipeline steps in flight (each virtual engine keeps one in flight already).
    async_scheduling: bool | None = None
    # Several machines (vLLM's names): node 0 serves, the others run only their share of the
    # workers; all derive the rendezvous and bus endpoints from master_addr:master_port (bus/nodes.py).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    distributed_executor_backend: ExecutorBackend = "mp"
    # The Ray cluster to join with the ray backend (vLLM reads RAY_ADDRESS; so does Ray when this
    # is None); neither set: the cluster `ray start --head` left running on this machine.
    ray_address: str | None = None
    load_format: LoadFormat = "auto"  # dummy: config.json only, small random weights (benchmarks)
    # Weight format (vLLM's name); None: as stored, a GGUF file's blocks dequantized at load.
    quantization: Quantization | None = None
    kv_cache_dtype: KVCacheDtype = "auto"
    # Decode batch sizes captured as CUDA graphs (vLLM's name): [] is 1, 2, 4, then multiples of
    # 8 up to 512; one value N is that pattern up to N; several are used as given. Sizes above
    # max_num_seqs are dropped. CUDA only.
    cuda_graph_sizes: list[int] = []
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    # A JSON object (or dict) as vLLM spells it, e.g. {"method": "ngram", "num_speculative_tokens": 4}
    speculative_config: SpeculativeConfig | None = None
    # Per-request bounds: n x prompts x (prompt + max_tokens) tokens at most (None: the KV cache's
    # token capacity), and at most this many prompts in one completions request.
    max_request_tokens: int | None = None
    max_prompts_per_request: int = 256
    # Keep the weights as held after loading (the dense formats on CPU: float32 / float16 column
    # tiles) under cache_root()/weights, so the next start with the same model file, options and
    # code reads them instead of decoding and repacking the checkpoint (workers/weight_cache.py).
    weight_cache: bool = True


def check_engine_config(cfg: EngineConfig) -> EngineConfig:
    """Raise ValueError with a message a user can act on; return cfg unchanged."""
    bs = cfg.block_size
    need(bs > 0 and bs & (bs - 1) == 0, f"block_size must be a power of two, got {bs}")
    need(cfg.max_model_len is None or cfg.max_model_len > 0, "max_model_len must be positive")
    need(
        cfg.kv_cache_memory is None or cfg.kv_cache_memory > 0,
        "kv_cache_memory must be a positive number of bytes",
    )
    need(
        0.0 < cfg.gpu_memory_utilization <= 1.0,
        f"gpu_memory_utilization must be in (0, 1], got {cfg.gpu_memory_utilization}",
    )
    need(cfg.num_kv_blocks is None or cfg.num_kv_blocks >= 2, "num_kv_blocks must be >= 2")
    need(cfg.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive")
    need(cfg.max_num_seqs > 0, "max_num_seqs must be positive")
    need(cfg.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
    need(cfg.pipeline_parallel_size >= 1, "pipeline_parallel_size must be >= 1")
    depth, pp = cfg.pipeline_steps_in_flight, cfg.pipeline_parallel_size
    need(
        depth is None or 1 <= depth <= pp,
        f"pipeline_steps_in_flight must be in 1..pipeline_parallel_size ({pp}), got {depth}; "
        "leave it unset for the device's default",
    )
    world = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    need(cfg.nnodes >= 1 and 0 <= cfg.node_rank < cfg.nnodes, "need nnodes >= 1 and 0 <= node_rank < nnodes")
    need(
        world % cfg.nnodes == 0,
        f"tensor_parallel_size x pipeline_parallel_size ({world}) must be a multiple of nnodes ({cfg.nnodes})",
    )
    need(
        cfg.distributed_executor_backend == "mp" or cfg.nnodes == 1,
        "distributed_executor_backend ray places every worker on the Ray cluster's nodes itself: "
        "start only the head, without --nnodes/--node-rank",
    )
    need(1 <= cfg.master_port <= 65531, "master_port must be in 1..65531 (the next 4 ports are used too)")
    sc = cfg.speculative_config
    need(
        sc is None or sc.method != "draft_model" or world == 1,
        "speculative_config: a draft model runs on one worker only; use tensor/pipeline_parallel_size 1",
    )
    need(cfg.num_threads is None or cfg.num_threads >= 1, "num_threads must be >= 1")
    need(all(n > 0 for n in cfg.cuda_graph_sizes), "cuda_graph_sizes must be positive")
    need(cfg.max_request_tokens is None or cfg.max_request_tokens > 0, "max_request_tokens must be positive")
    need(cfg.max_prompts_per_request >= 1, "max_prompts_per_request must be >= 1")
    if cfg.speculative_config is not None:
        _check_spec(cfg.speculative_config)
        need(
            cfg.async_scheduling is not True,
            "async_scheduling does not combine with speculative_config (each step's drafts follow "
            "the token the step before sampled); drop one of the two",
        )
    return cfg


def _check_spec(sc: SpeculativeConfig) -> None:
    k = sc.num_speculative_tokens
    need(1 <= k <= 16, f"speculative_config: num_speculative_tokens must be in 1..16, got {k}")
    lo, hi = sc.prompt_lookup_min, sc.prompt_lookup_max
    need(1 <= lo <= hi, f"speculative_config: need 1 <= prompt_lookup_min ({lo}) <= prompt_lookup_max ({hi})")
    need(sc.disable_by_batch_size >= 1, "speculative_config: disable_by_batch_size must be >= 1")
    need(
        (sc.method == "draft_model") == (sc.model is not None),
        'speculative_config: "model" is needed by method "draft_model" and by no other',
    )


MAX_N = 128  # OpenAI's cap on `n`


class RequestLimits(msgspec.Struct, frozen=True):
    """What one request may ask for; frontends check the cheap parts, the scheduler the rest."""

    max_n: int  # min(MAX_N, max_num_seqs): one request never asks for more seats than exist
    max_prompts: int
    max_tokens: int  # n x prompts x (prompt + max_tokens)


def request_limits(cfg: EngineConfig, num_kv_blocks: int) -> RequestLimits:
    """The bounds in force; the token default is the KV cache's capacity (block 0 is reserved)."""
    cache_tokens = max(num_kv_blocks - 1, 1) * cfg.block_size
    return RequestLimits(
        max_n=min(MAX_N, cfg.max_num_seqs),
        max_prompts=cfg.max_prompts_per_request,
        max_tokens=cfg.max_request_tokens or cache_tokens,
    )


def steps_in_flight(cfg: EngineConfig, device: str) -> int:
    """The pipeline depth in force on workers of `device` ("cpu", "cuda", "cuda:1"); the scheduler
    and every worker derive it alike. Auto is one step per stage only on GPUs: on the CPU the
    stages share the cores, and two busy stages were measured slower than one step at a time
    (README, Tensor and pipeline parallelism)."""
    if cfg.pipeline_steps_in_flight is not None:
        return cfg.pipeline_steps_in_flight
    return cfg.pipeline_parallel_size if device.startswith("cuda") else 1


def async_scheduling(cfg: EngineConfig, depth: int) -> bool:
    """Whether the scheduler plans a step ahead, given the pipeline depth in force."""
    if cfg.async_scheduling is False or cfg.speculative_config is not None:
        return False
    return depth == 1


def cuda_graph_batch_sizes(cfg: EngineConfig) -> list[int]:
    """The decode batch sizes to capture, ascending, none above max_num_seqs."""
    sizes = cfg.cuda_graph_sizes
    if len(sizes) <= 1:
        top = sizes[0] if sizes else 512
        sizes = [n for n in (1, 2, 4) if n <= top] + list(range(8, top + 1, 8))
    return sorted({n for n in sizes if n <= cfg.max_num_seqs})


def cache_root() -> Path:
    """Where pagebus keeps what it derives from model files (converted tokenizers, weights as
    held): $PAGEBUS_CACHE_DIR, else $XDG_CACHE_HOME/pagebus, else ~/.cache/pagebus."""
    own = os.environ.get("PAGEBUS_CACHE_DIR")
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pagebus"


def make_engine_config(**kwargs: object) -> EngineConfig:
    """Build a config from vLLM-style keyword arguments; unknown names are an error."""
    known = set(EngineConfig.__struct_fields__)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
    env_model = os.environ.get("PAGEBUS_MODEL")
    if kwargs.get("model") is None and env_model:
        kwargs["model"] = env_model
    spec = kwargs.get("speculative_config")
    if isinstance(spec, str):  # the CLI flag's JSON
        try:
            kwargs["speculative_config"] = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    try:
        cfg = msgspec.convert(kwargs, EngineConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid engine option: {e}") from None
    return check_engine_config(cfg)
