"""The model runner: one step plan in, sampled token ids out.

It owns the model, the paged KV cache and the sampler, and caches each sequence's tokens
and block table so the scheduler only sends deltas. It knows tensors, never queues.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import BatchResult, ExecuteBatch, SamplingParams
from pagebus.workers.device import num_kv_blocks, pick_device, pick_dtype
from pagebus.workers.forward_batch import ForwardBatch
from pagebus.workers.loader import is_gguf, iter_gguf, iter_safetensors, load_weights, read_config
from pagebus.workers.model_config import ModelConfig
from pagebus.workers.models import model_class
from pagebus.workers.ops import select_ops
from pagebus.workers.sampling import Sampler, SampleRow

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    block_ids: list[int]
    sample_index: int


def load_model(path: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, ModelConfig]:
    mc = read_config(path)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(mc)(mc)
    finally:
        torch.set_default_dtype(prev)
    weights = iter_gguf(path, mc) if is_gguf(path) else iter_safetensors(path)
    with torch.no_grad():
        load_weights(model, weights)
    return model.eval(), mc


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_path: str, rank: int = 0) -> None:
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        t0 = time.monotonic()
        self.cfg = cfg
        self.device = pick_device(cfg, rank)
        self.dtype = pick_dtype(cfg, self.device)
        self.model, self.model_config = load_model(model_path, self.dtype, self.device)
        mc = self.model_config
        self.max_model_len = cfg.max_model_len or mc.max_position
        if self.max_model_len > mc.max_position:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context length {mc.max_position}"
            )
        self.num_blocks = num_kv_blocks(cfg, mc, self.dtype, self.device)
        shape = (self.num_blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(mc.num_layers)
        ]  # fmt: skip
        self.ops = select_ops(cfg.attention_backend, self.device)
        self.sampler = Sampler(cfg.seed)
        self.eos_token_id = mc.eos_token_ids[0] if mc.eos_token_ids else None
        self.seqs: dict[str, _Seq] = {}
        log.info(
            "model loaded in %.1fs: %s, %s on %s, %d KV blocks of %d tokens",
            time.monotonic() - t0, mc.family, self.dtype, self.device, self.num_blocks, cfg.block_size,
        )  # fmt: skip

    def execute(self, batch: ExecuteBatch) -> BatchResult:
        for seq_id in batch.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        scheduled: list[tuple[str, int, int]] = []  # (seq_id, num_computed, num_scheduled)
        for ns in batch.new_seqs:
            self.seqs[ns.seq_id] = _Seq(
                list(ns.token_ids), ns.prompt_len, ns.params, list(ns.block_ids), ns.sample_index
            )
            scheduled.append((ns.seq_id, ns.num_computed_tokens, ns.num_scheduled_tokens))
        for cs in batch.cached_seqs:
            self.seqs[cs.seq_id].block_ids.extend(cs.new_block_ids)
            scheduled.append((cs.seq_id, cs.num_computed_tokens, cs.num_scheduled_tokens))
        if not scheduled:
            return BatchResult(step_id=batch.step_id, seq_ids=[], token_ids=[])
        fb, sampling = self._prepare(scheduled)
        logits = self.model(fb)
        rows = [self._sample_row(seq_id) for seq_id in sampling]
        tokens, logprobs = self.sampler(logits, rows)
        for seq_id, tok in zip(sampling, tokens, strict=True):
            self.seqs[seq_id].token_ids.append(tok)
        any_lp = any(lp is not None for lp in logprobs)
        return BatchResult(
            step_id=batch.step_id, seq_ids=sampling, token_ids=tokens, logprobs=logprobs if any_lp else []
        )

    def _sample_row(self, seq_id: str) -> SampleRow:
        s = self.seqs[seq_id]
        stop_ids = tuple(s.params.stop_token_ids)
        if self.eos_token_id is not None and not s.params.ignore_eos:
            stop_ids += (self.eos_token_id,)
        return SampleRow(
            s.params, s.token_ids[: s.prompt_len], s.token_ids[s.prompt_len :], s.sample_index, stop_ids
        )

    def _prepare(self, scheduled: list[tuple[str, int, int]]) -> tuple[ForwardBatch, list[str]]:
        bs = self.cfg.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        logits_rows: list[int] = []
        sampling: list[str] = []
        tables: list[list[int]] = []
        for seq_id, computed, n in scheduled:
            s = self.seqs[seq_id]
            end = computed + n
            input_ids.extend(s.token_ids[computed:end])
            positions.extend(range(computed, end))
            blocks = s.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(computed, end))
            seq_lens.append(end)
            starts.append(starts[-1] + n)
            tables.append(blocks)
            if end == len(s.token_ids):  # caught up: this step yields its next token
                logits_rows.append(starts[-1] - 1)
                sampling.append(seq_id)
        width = max(len(t) for t in tables)
        table = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device

        def as_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        fb = ForwardBatch(
            input_ids=as_tensor(input_ids, torch.long),
            positions=as_tensor(positions, torch.long),
            slot_mapping=as_tensor(slots, torch.long),
            block_tables=table.to(dev, non_blocking=True),
            seq_lens=as_tensor(seq_lens, torch.int32),
            query_start_loc=as_tensor(starts, torch.int32),
            logits_indices=as_tensor(logits_rows, torch.long),
            kv_caches=self.kv_caches,
            ops=self.ops,
        )
        return fb, sampling
