"""The compute backend: which implementation of each fused op the model calls.

`torch` runs the `*_cpu` functions of `kernels/`: the `*_ref` specs' results with fewer passes
and copies (attention reads the paged cache in place). `cpu` runs those ops compiled, one call
each (kernels/cpu_native.py), wherever the tensors are float32, and the torch ones elsewhere.
What depends on the batch alone (rotary's cos/sin rows, the KV slots, attention's sparse
pattern) goes in the step's scratch (ForwardBatch.step_cache, passed as `memo=`): the first
layer builds it, the rest reuse it. `triton` runs the Triton launchers (CUDA, or the
interpreter in tests). The model only sees an `Ops`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pagebus.workers.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


_NO_SCALES: dict[str, float] = {}
_SCALE_NAMES = ("k_scale", "v_scale")


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    # rotary + cache write + attention in one call, for steps of decodes only; None: none
    qkv_decode_attention: Callable[..., torch.Tensor | None] | None = None
    # (heads, kv_heads, scale, eps) -> an empty compiled decode stack; None: the backend has none
    decode_stack: Callable[[int, int, float, float], Any] | None = None
    # (blocks, block_size, kv_heads, head_dim, dtype) -> the K cache's shape; None: the rows
    # layout every backend reads, [blocks, block_size, kv_heads, head_dim] (V's always)
    k_cache_shape: Callable[[int, int, int, int, torch.dtype], tuple[int, ...]] | None = None
    # (shape, dtype, device, zeros) -> a zeroed cache in the storage the backend reads best, its
    # memory from zeros(shape, dtype) on CPUs; None: torch.zeros
    new_kv_cache: Callable[..., torch.Tensor] | None = None
    # (x, a gate_up Linear's native_mm) -> silu(gate) * up without the matmul's output in memory,
    # or None where it does not apply; None: the backend has none (matmul, then silu_and_mul)
    gate_up_silu: Callable[[torch.Tensor, tuple[int, list[torch.Tensor]]], torch.Tensor | None] | None = None

    def fused_decode_attention(
        self,
        qkv: torch.Tensor,
        fb: ForwardBatch,
        layer: int,
        heads: tuple[int, int],
        cos_sin: torch.Tensor,
        scale: float,
    ) -> torch.Tensor | None:
        """`attention` of a step whose every sequence decodes one token, straight from the fused
        QKV output [T, (h + 2 kvh) d] -> [T, h d]; None where the backend has no such call for
        this step (prefill tokens, an fp8 cache, a layout it does not take)."""
        if self.qkv_decode_attention is None or fb.max_query_len != 1 or fb.kv_scales is not None:
            return None
        k_cache, v_cache = fb.kv_caches[layer]
        return self.qkv_decode_attention(
            qkv, heads[0], heads[1], fb.positions, cos_sin, k_cache, v_cache, fb.slot_mapping,
            fb.block_tables, fb.seq_lens, fb.query_start_loc, scale,
        )  # fmt: skip

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, layer: int, scale: float
    ) -> torch.Tensor:
        """One layer's attention over the paged cache: this step's K/V are written first, so a
        sequence may attend to blocks another sequence fills in this very step (every layer's
        write precedes its reads). q [T, h, d], k/v [T, kv_h, d] -> [T, h, d]."""
        k_cache, v_cache = fb.kv_caches[layer]
        memo = fb.step_cache
        # An fp8 cache's scales travel only when there are any: other caches' calls are unchanged.
        fp8 = (
            _NO_SCALES if fb.kv_scales is None else dict(zip(_SCALE_NAMES, fb.kv_scales[layer], strict=True))
        )
        self.write_kv_cache(k, v, k_cache, v_cache, fb.slot_mapping, memo=memo, **fp8)
        return self.paged_attention(
            q, k_cache, v_cache, fb.block_tables, fb.seq_lens, fb.query_start_loc, scale,
            max_query_len=fb.max_query_len, max_seq_len=fb.max_seq_len,
            seq_lens_host=fb.seq_lens_host, query_start_loc_host=fb.query_start_loc_host, memo=memo, **fp8,
        )  # fmt: skip


def torch_ops() -> Ops:
    from pagebus.kernels.activation import silu_and_mul_cpu
    from pagebus.kernels.kv_cache_write import write_kv_cache_cpu
    from pagebus.kernels.paged_attention_cpu import paged_attention_cpu
    from pagebus.kernels.rms_norm import rms_norm_cpu
    from pagebus.kernels.rotary import rotary_embedding_cpu

    return Ops(
        "torch", rms_norm_cpu, rotary_embedding_cpu, silu_and_mul_cpu, write_kv_cache_cpu, paged_attention_cpu
    )


def cpu_ops() -> Ops:
    from pagebus.kernels import cpu_native as n

    return Ops(
        "cpu", n.rms_norm, n.rotary_embedding, n.silu_and_mul, n.write_kv_cache, n.paged_attention,
        n.qkv_decode_attention, n.decode_stack, n.k_cache_shape, n.new_kv_cache, n.gate_up_silu,
    )  # fmt: skip


def _without_memo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The model passes every op the step's scratch (`memo=`); Triton launchers take what they
    need from the device tensors and have no use for it."""

    @functools.wraps(fn)
    def call(*args: Any, memo: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return call


def triton_ops() -> Ops:
    from pagebus.kernels.activation import silu_and_mul
    from pagebus.kernels.kv_cache_write import write_kv_cache
    from pagebus.kernels.paged_attention import paged_attention
    from pagebus.kernels.rms_norm import rms_norm
    from pagebus.kernels.rotary import rotary_embedding

    return Ops(
        "triton", rms_norm, _without_memo(rotary_embedding), silu_and_mul, _without_memo(write_kv_cache),
        _without_memo(paged_attention),
    )  # fmt: skip


def select_ops(backend: str, device: torch.device) -> Ops:
    """auto: Triton on CUDA; on CPUs the compiled ops, or torch's when they cannot be built
    (a warning says why). The choice is logged once at start-up."""
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "cpu"
    if backend == "cpu":
        from pagebus.kernels.cpu_native import available

        why = available()
        if why is not None:
            log.warning("compiled CPU ops unavailable (%s): running the torch backend", why)
            backend = "torch"
    ops = {"triton": triton_ops, "cpu": cpu_ops}.get(backend, torch_ops)()
    log.info("attention backend: %s (device %s)", ops.name, device)
    return ops
