"""The model runner: one step plan in, sampled token ids out.

It owns the model, the paged KV cache, the persistent input buffers and the sampler, and caches
each sequence's tokens and block-table row so the scheduler only sends deltas. It knows
tensors, never queues.

A step never reads the device back except for its result: inputs go over in two non-blocking
copies from pinned memory (input_batch.py), the host-side integers the ops need (query and
sequence lengths) travel in the ForwardBatch, and greedy sampling takes the argmax on the device
and brings back only the ids. On CUDA, pure-decode steps replay CUDA graphs (cuda_graphs.py);
steps with a prefill chunk run eagerly. Before the KV cache is allocated on CUDA, a maximal
dummy step measures peak activation memory, and the cache gets what the
gpu_memory_utilization share leaves.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from pagebus.bus.config import EngineConfig, cuda_graph_batch_sizes, steps_in_flight
from pagebus.bus.messages import BatchResult, ExecuteBatch, SamplingParams, TokenLogprobs
from pagebus.kernels.fp8 import check_kv_cache_support, is_fp8, kv_cache_dtype
from pagebus.workers.cuda_graphs import DecodeGraphs
from pagebus.workers.device import (
    GiB,
    MemoryProfile,
    needs_memory_profile,
    num_kv_blocks,
    pick_device,
    pick_dtype,
    profiled_kv_budget,
)
from pagebus.workers.distributed.layout import local_kv_config
from pagebus.workers.distributed.state import SINGLE, Parallel, building
from pagebus.workers.forward_batch import ForwardBatch, GreedyDecoder, KVCaches
from pagebus.workers.host_memory import huge_page_zeros, into_huge_pages, keep_freed_memory
from pagebus.workers.input_batch import InputBuffers, StepTensors
from pagebus.workers.kv_scales import KVScales, calibrate_kv_scales
from pagebus.workers.layers.quant import select as quant_select
from pagebus.workers.layers.quant.base import linear_methods
from pagebus.workers.loader import (
    init_dummy_weights,
    is_gguf,
    iter_gguf,
    iter_safetensors,
    load_weights,
    read_config,
    resident_weight_bytes,
)
from pagebus.workers.model_config import ModelConfig
from pagebus.workers.models import model_class
from pagebus.workers.ops import select_ops
from pagebus.workers.sampling import Sampler, SampleRow, greedy_ids
from pagebus.workers.sampling import _plain_greedy as _plain_greedy_row
from pagebus.workers.spec.draft import DraftModel
from pagebus.workers.spec.verify import accepted_tokens, verify_rows
from pagebus.workers.structured import GrammarStates
from pagebus.workers.threads import CoreShare
from pagebus.workers.weight_cache import (
    WeightCache,
    cache_key,
    held_tensors,
    rebind_held_weights,
    weight_cache_applies,
)

log = logging.getLogger(__name__)

SampleOut = tuple[list[int], list[TokenLogprobs | None]]


@dataclass
class _Seq:
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    block_ids: list[int]
    sample_index: int
    row: int  # its block-table row


@dataclass
class StepMeta:
    """Host-side integers of a step (see ForwardBatch)."""

    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_prefills: int
    seq_lens: list[int] | None
    query_start_loc: list[int] | None


@dataclass
class _Step:
    tensors: StepTensors
    meta: StepMeta
    sampling: list[str]  # seq ids that sample, in logits-row order
    graph_size: int | None  # the CUDA graph to replay, or None: eager
    num_seqs: int
    every_row_samples: bool  # a replay's first num_seqs rows are the logits, in order
    greedy: bool = False  # every sampling row is _plain_greedy: the forward may return argmax ids


def held_format(path: str, load_format: str, quantization: str | None) -> tuple[dict[str, Any] | None, str]:
    """(the checkpoint's declared quantization_config, the format its weights are held in)."""
    # dummy weights are random floats whatever the checkpoint declares
    declared = None if load_format == "dummy" else quant_select.checkpoint_quant_config(path)
    return declared, quant_select.resolve(quantization, is_gguf(path) and load_format != "dummy", declared)


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    weight_cache: bool = False,
) -> tuple[torch.nn.Module, ModelConfig]:
    """weight_cache: read the weights as held from workers/weight_cache.py's cache when an entry
    fits, else load the checkpoint and save them there."""
    mc = read_config(path)
    declared, held = held_format(path, load_format, quantization)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), linear_methods(quant_select.factory(held, declared)):
            model = model_class(mc)(mc)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        if load_format == "dummy":
            init_dummy_weights(model, seed)
        else:
            cache = (
                WeightCache(cache_key(path, held, dtype))
                if weight_cache and weight_cache_applies(model, device)
                else None
            )
            if cache is None or not cache.restore(model):
                keep = held == "gguf"
                load_weights(model, iter_gguf(path, mc, keep) if is_gguf(path) else iter_safetensors(path))
                if cache is not None:
                    cache.store(model)
    log.info("weights: %s held as %s, %.1f MiB resident", path, held, resident_weight_bytes(model) / 2**20)
    return model.eval(), mc


def _plain_greedy(s: _Seq) -> bool:
    """Greedy with nothing that needs the full logits on the host: the argmax is the token."""
    p = s.params
    return (
        p.greedy
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and len(s.token_ids) - s.prompt_len >= p.min_tokens
        and p.structured_outputs is None
    )


class ModelRunner:
    # A step whose every sampling row is plain greedy takes the ids without the logits (the
    # model's fused argmax, `_Step.greedy`); tests turn it off to see every step's logits.
    fused_greedy = True

    def __init__(
        self, cfg: EngineConfig, model_path: str, rank: int = 0, parallel: Parallel | None = None
    ) -> None:
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        t0 = time.monotonic()
        self.cfg = cfg
        self.parallel = parallel or SINGLE  # this rank's share of the model and its groups
        self.device = pick_device(cfg, rank)
        self.dtype = pick_dtype(
            cfg, self.device, held_format(model_path, cfg.load_format, cfg.quantization)[1]
        )
        # Several steps in flight (scheduler/virtual.py): a stage before the last returns once its
        # activations are sent and learns the sampled tokens from later plans (CachedSeq.new_token_ids).
        self.tokens_from_plan = steps_in_flight(cfg, self.device.type) > 1
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.set_device(self.device)
        else:  # a step's freed activations are reused, not faulted in again (host_memory.py)
            keep_freed_memory()
        allocated_before = torch.cuda.memory_allocated(self.device) if on_cuda else 0
        with building(self.parallel):  # parallel layers take this rank's slices
            self.model, self.model_config = load_model(
                model_path,
                self.dtype,
                self.device,
                cfg.load_format,
                cfg.seed,
                cfg.quantization,
                cfg.weight_cache,
            )
        if not on_cuda and weight_cache_applies(self.model, self.device):
            # the weights a decode step streams, in 2 MiB pages (host_memory.py into_huge_pages)
            moved = into_huge_pages(list(held_tensors(self.model).values()))
            rebind_held_weights(self.model)
            log.info("weights: %.1f MiB moved into huge pages", moved / 2**20)
        t_weights = time.monotonic()
        weight_bytes = torch.cuda.memory_allocated(self.device) - allocated_before if on_cuda else 0
        mc = self.model_config
        self.max_model_len = cfg.max_model_len or mc.max_position
        if self.max_model_len > mc.max_position:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context length {mc.max_position}"
            )
        self.ops = select_ops(cfg.attention_backend, self.device)
        self.kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, self.dtype)
        check_kv_cache_support(self.kv_dtype, self.device, self.ops.name)
        self.kv_scales: KVScales | None = None  # an fp8 cache's, measured once it exists
        # _greedy_decoder's: (the caches it runs on, the decoder or None), once asked
        self._decoder: tuple[KVCaches, GreedyDecoder | None] | None = None
        self.sampler = Sampler(cfg.seed)
        # Unless the user fixed the thread count, matmuls use fewer cores while others need them.
        self.core_share = (
            CoreShare(torch.get_num_threads()) if cfg.num_threads is None and not on_cuda else None
        )
        self.eos_token_id = mc.eos_token_ids[0] if mc.eos_token_ids else None
        # Structured outputs: xgrammar loads lazily, on the first constrained request.
        self.grammars = GrammarStates(cfg.tokenizer or model_path, mc.vocab_size, list(mc.eos_token_ids))
        self.sampler.grammars = self.grammars
        self.seqs: dict[str, _Seq] = {}
        self._drafts: dict[str, list[int]] = {}  # this step's drafts per verifying seq
        self.block_size = cfg.block_size
        graph_sizes = self._graph_sizes()
        max_tokens = max(cfg.max_num_batched_tokens, *graph_sizes, 1)
        max_blocks = -(-self.max_model_len // cfg.block_size)
        self.inputs = InputBuffers(cfg.max_num_seqs, max_tokens, max_blocks, self.device)
        self._ids_host = torch.zeros(max_tokens, dtype=torch.int64, pin_memory=on_cuda)
        self._ids_ready = torch.cuda.Event() if on_cuda else None
        self._all_rows = torch.arange(max_tokens, device=self.device)
        # The profile's trial capture and the real one share a stream (and its cuBLAS workspace).
        self._capture_stream = torch.cuda.Stream(self.device) if graph_sizes else None

        budget = None
        if needs_memory_profile(cfg, self.device):
            profile = self._profile(weight_bytes, graph_sizes)
            torch.cuda.empty_cache()  # the stand-in cache and activations go back before measuring
            budget = profiled_kv_budget(cfg, self.device, profile)
        t_profile = time.monotonic()
        kv_mc = local_kv_config(mc, self.parallel)  # this rank's KV heads and layers
        # The block count follows the cache's element size: an e4m3 cache fits 2x (4x vs fp32) the blocks.
        self.num_blocks = num_kv_blocks(cfg, kv_mc, self.kv_dtype, self.device, budget)
        shape = (self.num_blocks, cfg.block_size, kv_mc.num_kv_heads, mc.head_dim)
        k_shape = self.ops.k_cache_shape(*shape, self.kv_dtype) if self.ops.k_cache_shape else shape
        held = self.parallel.layout.layers(mc.num_layers)
        # CPU caches in huge pages (host_memory.py): decode attention's block reads miss the TLB less
        zeros = huge_page_zeros if self.device.type == "cpu" else None

        def new(s: tuple[int, ...]) -> torch.Tensor:
            if self.ops.new_kv_cache is not None:
                return self.ops.new_kv_cache(s, self.kv_dtype, self.device, zeros)
            if zeros is not None:
                return zeros(s, self.kv_dtype)
            return torch.zeros(s, dtype=self.kv_dtype, device=self.device)

        self.kv_caches: KVCaches = [
            (new(k_shape if i in held else (0,)), new(shape if i in held else (0,)))
            for i in range(mc.num_layers)
        ]
        log.info(
            "KV cache: %d blocks of %d tokens, %s%s (%.2f GiB); %.1f sequences of max_model_len %d fit at once",
            self.num_blocks, cfg.block_size, self.kv_dtype, ", K in token pairs" if len(k_shape) == 5 else "",
            2 * sum(k.numel() * k.element_size() for k, _ in self.kv_caches) / GiB,
            (self.num_blocks - 1) * cfg.block_size / self.max_model_len, self.max_model_len,
        )  # fmt: skip
        if is_fp8(self.kv_dtype):
            self.kv_scales = calibrate_kv_scales(self, cfg.seed)
        t_kv = time.monotonic()
        if self.device.type == "cpu" and self.parallel.layout.world_size == 1:
            self._warm_up()
        sc = cfg.speculative_config
        self.drafter: DraftModel | None = None
        if sc is not None and sc.method == "draft_model" and sc.model is not None:
            self.drafter = DraftModel(self, sc.model)
        self.graphs: DecodeGraphs | None = None
        if graph_sizes:
            self.graphs = DecodeGraphs(graph_sizes, mc.vocab_size, self.device, self._capture_stream)
            self.graphs.capture(self._graph_forward)
        log.info(
            "model ready in %.1fs: %s, %s on %s, %d KV blocks of %d tokens",
            time.monotonic() - t0, mc.family, self.dtype, self.device, self.num_blocks, cfg.block_size,
        )  # fmt: skip
        # Seconds by phase for the server's start-up report; warm-up is the profile and graph capture.
        self.startup_phases = {
            "weights": t_weights - t0,
            "kv_cache": t_kv - t_profile,
            "warmup": (t_profile - t_weights) + (time.monotonic() - t_kv),
        }

    # ------------------------------------------------------------------ start-up
    WARM_UP_TOKENS = 512

    def _warm_up(self) -> None:
        """One prefill of up to WARM_UP_TOKENS tokens before Ready, on CPUs, so that the engine's
        first request does not pay for first use (the compiled ops' and allocator's first calls
        at prefill sizes). Served, six 1,024-token prompts one after another: the first's TTFT
        603 ms against 515-562 for the rest without it, 534 against 476-513 with it; 0.19 s of
        start-up (bf16, this model). It writes K/V into blocks no sequence owns yet (each block
        is written by its owner's prefill before it is read) and zeroes them again."""
        bs = self.block_size
        n = min(
            self.WARM_UP_TOKENS,
            self.cfg.max_num_batched_tokens,
            self.max_model_len,
            (self.num_blocks - 1) * bs,
        )
        if n < 1:
            return
        blocks = list(range(1, 1 + -(-n // bs)))
        with torch.inference_mode():
            self.prompt_logits([(7 * p) % self.model_config.vocab_size for p in range(n)], blocks, [n - 1])
            for k, v in self.kv_caches:
                if k.numel():
                    k[blocks] = 0
                    v[blocks] = 0

    def _graph_sizes(self) -> list[int]:
        cfg = self.cfg
        if self.device.type != "cuda":
            if cfg.enforce_eager or cfg.cuda_graph_sizes:
                log.info(
                    "enforce_eager / cuda_graph_sizes: not applicable on %s (no CUDA graphs)", self.device
                )
            return []
        if cfg.enforce_eager:
            log.info("CUDA graphs off: enforce_eager")
            return []
        if self.parallel.layout.world_size > 1:  # collectives inside a capture: not validated yet
            log.info("CUDA graphs off: tensor/pipeline parallelism")
            return []
        if self.ops.name != "triton":
            log.info("CUDA graphs off: the %s attention backend is not capturable", self.ops.name)
            return []
        return [n for n in cuda_graph_batch_sizes(cfg) if n <= cfg.max_num_batched_tokens]

    def _profile(self, weight_bytes: int, graph_sizes: list[int]) -> MemoryProfile:
        """Peak memory of a maximal eager step (max_num_batched_tokens tokens over up to
        max_num_seqs sequences, all sampling) and of a decode step at the largest graph size,
        run against a one-block stand-in KV cache: activations do not depend on its size."""
        mc, cfg, dev = self.model_config, self.cfg, self.device
        one = (1, cfg.block_size, local_kv_config(mc, self.parallel).num_kv_heads, mc.head_dim)
        k, v = (
            torch.zeros(one, dtype=self.kv_dtype, device=dev),
            torch.zeros(one, dtype=self.kv_dtype, device=dev),
        )
        dummy_kv = [(k, v)] * mc.num_layers
        tokens = cfg.max_num_batched_tokens
        num_seqs = min(cfg.max_num_seqs, tokens)
        # No sequence longer than max_model_len (its block-table row would end first).
        tokens = min(tokens, num_seqs * self.max_model_len)
        qlens = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
        peak = self._peak_bytes(lambda: self._dummy_step(qlens, dummy_kv, sample=True))
        graph_bytes = 0
        if graph_sizes:
            # Capture every graph once against the stand-in cache and measure what the device
            # lost (pool, instantiated graphs, output buffer, the capture stream's cuBLAS
            # workspace): a graph's memory does not depend on the cache it points into.
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            free_before = torch.cuda.mem_get_info(dev)[0]
            probe = DecodeGraphs(graph_sizes, mc.vocab_size, dev, self._capture_stream)
            probe.capture(lambda size: self._graph_forward(size, dummy_kv))
            graph_bytes = free_before - torch.cuda.mem_get_info(dev)[0]
            del probe
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
        return MemoryProfile(weight_bytes, peak, graph_bytes)

    def _peak_bytes(self, fn: Callable[[], None]) -> int:
        """How far fn grows the allocator's reserved memory: allocations plus the rounding and
        fragmentation they bring, i.e. what the KV cache must leave free for them."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # nothing cached to reuse: every byte fn needs shows in the peak
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_reserved(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_reserved(self.device) - base

    def _dummy_step(self, qlens: list[int], kv_caches: KVCaches, sample: bool) -> None:
        """One eager step of sequences with these query lengths and no cached context, every
        token writing slot 0 of block 0 and reading through the all-zero padding row."""
        starts = [0, *itertools.accumulate(qlens)]
        positions = [p for q in qlens for p in range(q)]
        n = starts[-1]
        t = self.inputs.load(
            [0] * n, positions, [0] * n, [self.inputs.pad_row] * len(qlens), qlens, starts,
            [s - 1 for s in starts[1:]],
        )  # fmt: skip
        meta = StepMeta(
            max(qlens), max(qlens), sum(q == 1 for q in qlens), sum(q > 1 for q in qlens), qlens, starts
        )
        logits = self.model(self._forward_batch(t, meta, t.logits_indices, kv_caches))
        if not sample or logits is None:  # None: a pipeline stage before the last
            return
        # The sampler's costliest path, on a throwaway instance (its call counter keys noise).
        p = SamplingParams(
            temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
            frequency_penalty=0.1, logprobs=5,
        )  # fmt: skip
        rows = [SampleRow(p, [0] * q, [1], i, (2,)) for i, q in enumerate(qlens)]
        try:
            Sampler(self.cfg.seed)(logits, rows)
        except Exception:  # a sampler bug should fail requests that hit it, not start-up
            log.warning("memory profile: the sampler failed; its memory is not counted", exc_info=True)

    def _graph_forward(self, size: int, kv_caches: KVCaches | None = None) -> Callable[[], torch.Tensor]:
        """Load padding inputs for a decode step of `size` rows; return the forward to capture
        (against the KV cache, or the profile's stand-in)."""
        t = self.inputs.load(
            [0] * size, [0] * size, [0] * size, [self.inputs.pad_row] * size, [1] * size,
            list(range(size + 1)), [],
        )  # fmt: skip
        # Under a graph the lengths change per replay: only upper bounds are baked in.
        meta = StepMeta(1, self.max_model_len, size, 0, None, None)
        rows = self._all_rows[:size]
        kv = self.kv_caches if kv_caches is None else kv_caches
        return lambda: self.model(self._forward_batch(t, meta, rows, kv))

    # ------------------------------------------------------------------ one step
    def execute(self, batch: ExecuteBatch) -> BatchResult:
        if self.core_share is not None:
            self.core_share.update()
        for seq_id in batch.finished_seq_ids:
            self._drop(seq_id)
        scheduled: list[tuple[str, int, int]] = []  # (seq_id, num_computed, num_scheduled)
        for ns in batch.new_seqs:
            self._drop(ns.seq_id)  # a re-sent sequence starts over
            if ns.params.structured_outputs is not None:  # compiles while this step runs
                self.grammars.prefetch(ns.params.structured_outputs)
            row = self.inputs.assign_row()
            self.inputs.add_blocks(row, 0, ns.block_ids)
            self.seqs[ns.seq_id] = _Seq(
                list(ns.token_ids), ns.prompt_len, ns.params, list(ns.block_ids), ns.sample_index, row
            )
            scheduled.append((ns.seq_id, ns.num_computed_tokens, ns.num_scheduled_tokens))
        self._drafts = {}
        want: dict[str, int] = {}
        for cs in batch.cached_seqs:
            s = self.seqs[cs.seq_id]
            if cs.new_token_ids and not self.parallel.layout.is_last_stage:
                s.token_ids.extend(cs.new_token_ids)  # sampled by the last stage (see CachedSeq)
            if 0 <= cs.block_offset < len(s.block_ids):  # blocks of rejected drafts, freed
                del s.block_ids[cs.block_offset :]
            if cs.new_block_ids:
                self.inputs.add_blocks(s.row, len(s.block_ids), cs.new_block_ids)
                s.block_ids.extend(cs.new_block_ids)
            num_drafts = cs.num_scheduled_tokens - (len(s.token_ids) - cs.num_computed_tokens)
            if num_drafts > 0 and cs.spec_token_ids:
                self._drafts[cs.seq_id] = list(cs.spec_token_ids)
            elif num_drafts > 0:
                want[cs.seq_id] = num_drafts  # the draft model proposes them
            scheduled.append((cs.seq_id, cs.num_computed_tokens, cs.num_scheduled_tokens))
        if not scheduled:
            return BatchResult(step_id=batch.step_id, seq_ids=[], token_ids=[])
        if self.drafter is not None:  # runs every step: its KV cache follows the target's
            self._drafts.update(self.drafter.propose(scheduled, want))
        if self._drafts:
            for seq_id, drafts in self._drafts.items():
                self.seqs[seq_id].token_ids.extend(drafts)  # verified below, then cut back
        step = self._prepare(scheduled)
        ids = self._greedy_step(step)
        if ids is not None:
            for seq_id, tok in zip(step.sampling, ids, strict=True):
                self.seqs[seq_id].token_ids.append(tok)
            return BatchResult(step_id=batch.step_id, seq_ids=step.sampling, token_ids=ids)
        logits = self._run(step)
        if self.tokens_from_plan and not self.parallel.layout.is_last_stage:
            # Activations went on to the next stage; the tokens come with a later step's plan, so
            # this stage is free for the next step at once.
            for seq_id, drafts in self._drafts.items():
                if drafts:
                    del self.seqs[seq_id].token_ids[-len(drafts) :]
            return BatchResult(step_id=batch.step_id, seq_ids=[], token_ids=[])
        if self._drafts:
            return self._verify(batch.step_id, logits, step.sampling)
        logprobs: list[TokenLogprobs | None]
        if logits is not None and logits.dtype is torch.int64:  # the LM head's fused argmax (step.greedy)
            tokens, logprobs = logits.tolist(), [None] * len(step.sampling)
        else:
            tokens, logprobs = self._sample(logits, step.sampling, step.greedy)
        for seq_id, tok in zip(step.sampling, tokens, strict=True):
            self.seqs[seq_id].token_ids.append(tok)
        any_lp = any(lp is not None for lp in logprobs)
        return BatchResult(
            step_id=batch.step_id,
            seq_ids=step.sampling,
            token_ids=tokens,
            logprobs=logprobs if any_lp else [],
        )

    def _drop(self, seq_id: str) -> None:
        s = self.seqs.pop(seq_id, None)
        if s is not None:
            self.inputs.release_row(s.row)
            if self.drafter is not None:
                self.drafter.forget(seq_id)
            self.grammars.forget(seq_id)

    def _prepare(self, scheduled: list[tuple[str, int, int]]) -> _Step:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        logits_rows: list[int] = []
        sampling: list[str] = []
        max_q = 0
        for seq_id, computed, n in scheduled:
            s = self.seqs[seq_id]
            end = computed + n
            input_ids.extend(s.token_ids[computed:end])
            positions.extend(range(computed, end))
            blocks = s.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(computed, end))
            rows.append(s.row)
            seq_lens.append(end)
            starts.append(starts[-1] + n)
            max_q = max(max_q, n)
            if end == len(s.token_ids):  # caught up: this step yields its next token
                k = len(self._drafts.get(seq_id, ()))  # and verifies its drafts: one row each
                logits_rows.extend(range(starts[-1] - 1 - k, starts[-1]))
                sampling.append(seq_id)
        num_seqs = len(rows)
        num_decodes = sum(1 for a, b in itertools.pairwise(starts) if b - a == 1)
        meta = StepMeta(max_q, max(seq_lens), num_decodes, num_seqs - num_decodes, seq_lens, starts)
        size = self.graphs.size_for(num_seqs) if self.graphs is not None and max_q == 1 else None
        if size is None:
            t = self.inputs.load(input_ids, positions, slots, rows, seq_lens, starts, logits_rows)
            greedy = (
                self.fused_greedy
                and not self._drafts
                and self.parallel.layout.pp_size == 1
                and all(_plain_greedy(self.seqs[i]) for i in sampling)
            )
            return _Step(t, meta, sampling, None, num_seqs, False, greedy)
        pad = size - num_seqs
        every_row_samples = len(logits_rows) == num_seqs
        if every_row_samples:
            logits_rows = []  # sliced, not gathered
        t = self.inputs.load(
            input_ids + [0] * pad,
            positions + [0] * pad,
            slots + [0] * pad,  # slot 0 of the null block: no sequence owns it
            rows + [self.inputs.pad_row] * pad,
            seq_lens + [1] * pad,
            starts + list(range(starts[-1] + 1, starts[-1] + 1 + pad)),
            logits_rows,
        )
        return _Step(t, meta, sampling, size, num_seqs, every_row_samples)

    def _forward_batch(
        self,
        t: StepTensors,
        meta: StepMeta,
        logits_indices: torch.Tensor,
        kv_caches: KVCaches,
        greedy: bool = False,
    ) -> ForwardBatch:
        return ForwardBatch(
            input_ids=t.input_ids,
            positions=t.positions,
            slot_mapping=t.slot_mapping,
            block_tables=self.inputs.gather_block_tables(t.rows),
            seq_lens=t.seq_lens,
            query_start_loc=t.query_start_loc,
            logits_indices=logits_indices,
            kv_caches=kv_caches,
            ops=self.ops,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            num_decodes=meta.num_decodes,
            num_prefills=meta.num_prefills,
            seq_lens_host=meta.seq_lens,
            query_start_loc_host=meta.query_start_loc,
            kv_scales=self.kv_scales if kv_caches is self.kv_caches else None,
            greedy=greedy,
        )

    def _run(self, step: _Step) -> torch.Tensor:
        """Logits [num_sampling, vocab] float32, on the device; or, for a step.greedy step where
        the model computes them without the logits, the argmax ids int64 [num_sampling]."""
        if step.graph_size is None:
            return self.model(
                self._forward_batch(
                    step.tensors,
                    step.meta,
                    step.tensors.logits_indices,
                    self.kv_caches,
                    step.greedy,
                )
            )
        assert self.graphs is not None
        out = self.graphs.replay(step.graph_size)
        if step.every_row_samples:
            return out[: step.num_seqs]
        return out.index_select(0, step.tensors.logits_indices)

    def _greedy_step(self, step: _Step) -> list[int] | None:
        """The next ids of a plain-greedy decode step in which every row samples, from the
        model's greedy decoder (one native call from the ids to the ids); None where the step
        takes `_run`."""
        if not step.greedy or step.meta.max_query_len != 1 or len(step.sampling) != step.num_seqs:
            return None
        decoder = self._greedy_decoder()
        if decoder is None:
            return None
        t = step.tensors
        return decoder(
            t.input_ids, t.positions, t.slot_mapping, self.inputs.block_table, t.rows, t.seq_lens,
            t.query_start_loc,
        )  # fmt: skip

    def _greedy_decoder(self) -> GreedyDecoder | None:
        """The model's whole greedy decode step for this runner's caches (built on first use),
        or None: eager steps only, no fp8 scales (see LlamaForCausalLM.greedy_decoder)."""
        if self._decoder is None or self._decoder[0] is not self.kv_caches:
            build = getattr(self.model, "greedy_decoder", None)
            ok = self.graphs is None and self.kv_scales is None
            decoder = build(self.ops, self.kv_caches) if ok and build is not None else None
            self._decoder = (self.kv_caches, decoder)
        return self._decoder[1]

    def prompt_logits(
        self, token_ids: list[int], block_ids: list[int], logits_at: list[int] | None = None
    ) -> torch.Tensor:
        """Logits [len(logits_at), vocab] at the positions `logits_at` (default: every one) of
        one prompt, prefilled alone into block_ids (the caller's to overwrite). For oracle tests
        (a step samples only the last), the fp8 scales' calibration and the CPU warm-up."""
        row = self.inputs.assign_row()
        try:
            self.inputs.add_blocks(row, 0, block_ids)
            n, bs = len(token_ids), self.block_size
            slots = [block_ids[p // bs] * bs + p % bs for p in range(n)]
            at = list(range(n)) if logits_at is None else logits_at
            t = self.inputs.load(token_ids, list(range(n)), slots, [row], [n], [0, n], at)
            meta = StepMeta(n, n, int(n == 1), int(n > 1), [n], [0, n])
            return self.model(self._forward_batch(t, meta, t.logits_indices, self.kv_caches))
        finally:
            self.inputs.release_row(row)

    # ------------------------------------------------------------------ sampling
    def _sample(
        self, logits: torch.Tensor, sampling: list[str], plain_greedy: bool = False
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """plain_greedy: every row is already known to be _plain_greedy (_Step.greedy)."""
        if plain_greedy or all(_plain_greedy(self.seqs[i]) for i in sampling):
            return self._from_last_stage(lambda: (self._greedy_ids(logits), [None] * len(sampling)))
        return self._from_last_stage(lambda: self.sampler(logits, [self._sample_row(i) for i in sampling]))

    def _from_last_stage(self, sample: Callable[[], SampleOut]) -> SampleOut:
        """What the last pipeline stage sampled, on every rank (each keeps its sequences' tokens
        for the next step's inputs). Tensor-parallel ranks of one stage all hold the gathered
        logits and sample them alike, so without stages there is nothing to send; with several
        steps in flight only the last stage gets here, and earlier ones learn the tokens later."""
        if self.parallel.layout.pp_size == 1 or self.tokens_from_plan:
            return sample()
        out: SampleOut = self.parallel.broadcast_object(
            sample() if self.parallel.layout.is_last_stage else None
        )
        return out

    def _verify(self, step_id: int, logits: torch.Tensor, sampling: list[str]) -> BatchResult:
        """Sample every verified position (1 + k logits rows per drafting seq) and keep each
        seq's accepted drafts plus one sampled token (see spec/verify.py)."""
        rows: list[SampleRow] = []
        for seq_id in sampling:
            s, drafts = self.seqs[seq_id], self._drafts.get(seq_id, [])
            base = self._sample_row(seq_id)
            base.output_ids = base.output_ids[: len(base.output_ids) - len(drafts)]
            rows += verify_rows(
                s.params, base.prompt_ids, base.output_ids, drafts, s.sample_index, base.stop_ids
            )
        lps: list[TokenLogprobs | None]
        if all(_plain_greedy_row(r) for r in rows):
            sampled, lps = self._from_last_stage(lambda: (self._greedy_ids(logits), [None] * len(rows)))
        else:
            sampled, lps = self._from_last_stage(lambda: self.sampler(logits, rows))
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        counts: list[int] = []
        at = 0
        for seq_id in sampling:
            s, drafts = self.seqs[seq_id], self._drafts.get(seq_id, [])
            k = len(drafts)
            out = accepted_tokens(sampled[at : at + k + 1], drafts)
            if self.drafter is not None and k:
                self.drafter.settle(seq_id, len(s.token_ids) - k - 1, k, len(out) - 1)
            del s.token_ids[len(s.token_ids) - k :]
            s.token_ids.extend(out)
            token_ids += out
            logprobs += lps[at : at + len(out)]
            counts.append(len(out))
            at += k + 1
        any_lp = any(lp is not None for lp in logprobs)
        return BatchResult(
            step_id=step_id,
            seq_ids=sampling,
            token_ids=token_ids,
            logprobs=logprobs if any_lp else [],
            num_tokens=counts,
        )

    def _greedy_ids(self, logits: torch.Tensor) -> list[int]:
        """Argmax on the device; only the ids come back (through pinned memory on CUDA, waiting
        on an event rather than the stream, which sync-debug mode would flag)."""
        ids = greedy_ids(logits)
        if self._ids_ready is None:
            return ids.tolist()
        host = self._ids_host[: ids.shape[0]]
        host.copy_(ids, non_blocking=True)
        self._ids_ready.record()
        self._ids_ready.synchronize()
        return host.tolist()

    def _sample_row(self, seq_id: str) -> SampleRow:
        s = self.seqs[seq_id]
        stop_ids = tuple(s.params.stop_token_ids)
        if self.eos_token_id is not None and not s.params.ignore_eos:
            stop_ids += (self.eos_token_id,)
        return SampleRow(
            s.params,
            s.token_ids[: s.prompt_len],
            s.token_ids[s.prompt_len :],
            s.sample_index,
            stop_ids,
            seq_id,
        )
