"""The per-step inputs every layer needs, passed explicitly down the model (no globals)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pagebus.workers.ops import Ops

# per layer (K, V) caches
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
# A model's whole greedy decode step (LlamaForCausalLM.greedy_decoder): (input_ids, positions,
# slot_mapping, the persistent block table, the step's rows of it, seq_lens, query_start_loc) ->
# each row's next token id.
GreedyDecoder = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    list[int],
]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64, sequences concatenated
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    logits_indices: torch.Tensor  # [num_sampling_seqs] int64: rows whose logits are sampled
    # per layer (K, V): [num_blocks, bs, kv_heads, d] each, or K in token pairs on CPUs (Ops.k_cache_shape)
    kv_caches: KVCaches
    ops: Ops
    # Host-side facts of the step, so no op reads a device tensor back to learn them (None:
    # unknown, an op that needs one reads it back).
    max_query_len: int | None = None  # an upper bound on the query lengths
    max_seq_len: int | None = None  # an upper bound on seq_lens
    num_decodes: int = 0  # sequences with one query token
    num_prefills: int = 0  # sequences with more
    seq_lens_host: list[int] | None = None  # None under a CUDA graph (values change per replay)
    query_start_loc_host: list[int] | None = None
    # An fp8 cache's (k_scale, v_scale) per layer (workers/kv_scales.py); None: scale 1.0.
    kv_scales: list[tuple[float, float]] | None = None
    # The step's scratch for the ops (`memo=`): values derived from the batch alone, built by the
    # first layer and reused by the others. New with every ForwardBatch, so never stale.
    step_cache: dict[str, Any] = field(default_factory=dict)
    # Every sampled row takes the argmax of its logits and nothing else from them: the model may
    # return the ids (int64 [rows]) in place of the logits (the LM head's fused argmax).
    greedy: bool = False
