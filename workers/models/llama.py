"""The Llama family (Llama 2/3/3.1, Mistral, SmolLM2), in call order.

Qwen2 (QKV bias) and Qwen3 (per-head q/k RMSNorm) are the same decoder with a flag each;
their files only name the flags. QKV and gate/up are fused; `checkpoint_name_map` routes
the checkpoint's separate matrices into the fused parameters.

Tensor parallelism lives in the layers (layers/parallel.py): each keeps its rank's slice, so
this file never asks for a rank. Pipeline parallelism is the one split made here: a stage
builds only its contiguous layers (plus the embedding on the first stage, the norm and head on
the last), receives the hidden state and residual from the previous stage and sends them on.
"""

from __future__ import annotations

from typing import Any

import torch
from pagebus.kernels.cpu_native import native_attention_caches
from pagebus.workers.distributed.state import current
from pagebus.workers.forward_batch import ForwardBatch, GreedyDecoder, KVCaches
from pagebus.workers.layers.direct_call import DirectCall
from pagebus.workers.layers.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagebus.workers.layers.rotary import build_cos_sin_cache
from pagebus.workers.model_config import ModelConfig
from pagebus.workers.ops import Ops
from torch import nn

_FUSED: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(DirectCall):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(
        self, x: torch.Tensor, fb: ForwardBatch, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return fb.ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(DirectCall):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bias=cfg.qkv_bias
        )
        heads = self.qkv_proj.heads  # this rank's
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_q, heads.num_kv, cfg.head_dim
        self.heads = (heads.num_q, heads.num_kv)
        self.q_size = heads.num_q * cfg.head_dim
        self.kv_size = heads.num_kv * cfg.head_dim
        q_cols = (heads.q_start * cfg.head_dim, self.q_size)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, in_split=q_cols)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, fb: ForwardBatch, cos_sin: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """rows: the output rows wanted (every row's K/V still goes into the cache); None: all."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is None and rows is None:
            o = fb.ops.fused_decode_attention(qkv, fb, self.layer_idx, self.heads, cos_sin, self.scale)
            if o is not None:
                return self.o_proj(o)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim), fb).reshape(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim), fb).reshape(k.shape)
        q, k = fb.ops.rotary_embedding(fb.positions, q, k, cos_sin, memo=fb.step_cache)
        o = fb.ops.attention(q, k, v, fb, self.layer_idx, self.scale).reshape(t, self.q_size)
        return self.o_proj(o if rows is None else o.index_select(0, rows))


class MLP(DirectCall):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        fused, mm = fb.ops.gate_up_silu, self.gate_up_proj.native_mm
        if fused is not None and mm is not None and (act := fused(x, mm)) is not None:
            return self.down_proj(act)
        return self.down_proj(fb.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(DirectCall):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
        cos_sin: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: as for Attention; the outputs are then those rows alone."""
        if residual is None:
            residual, h = x, self.input_layernorm(x, fb)
        else:
            h, residual = self.input_layernorm(x, fb, residual)
        h = self.self_attn(h, fb, cos_sin, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
        h, residual = self.post_attention_layernorm(h, fb, residual)
        return self.mlp(h, fb), residual


class Model(DirectCall):
    held_layers: list[DecoderLayer]
    use_decode_stack = True  # tests turn it off to compare with the layers' own forward
    prune_last_layer = True  # tests turn it off to compare with every row through every layer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.parallel = current()
        stage = self.parallel.layout
        self.held = stage.layers(cfg.num_layers)
        self.hidden_size = cfg.hidden_size
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if stage.is_first_stage else None
        )
        # Other stages' layers are empty placeholders, so layer i keeps its name and KV cache index.
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i) if i in self.held else nn.Identity() for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.is_last_stage else None
        # The held layers as a plain list (not registered again): indexing the ModuleList costs
        # more than the rest of the loop.
        self.__dict__["held_layers"] = [self.layers[i] for i in self.held]
        self._stack: tuple[object, Any] | None = None  # (the caches it was built for, the stack or None)
        # the stack holds the final norm, and the LM head's tiles too (see _stack_tail)
        self._stack_final = self._stack_argmax = False

    def forward(
        self, fb: ForwardBatch, cos_sin: torch.Tensor, head: ParallelLMHead | None = None
    ) -> torch.Tensor | None:
        """The final hidden states of the rows `fb.logits_indices` names, on the last stage; None
        on the others (all rows' hidden states and residuals are sent on instead). For a
        `fb.greedy` step that the decode stack ends with `head`'s argmax (`_stack_tail`), the
        rows' ids instead, int64 [rows].

        A prompt token's K/V in the last layer come from that layer's input; its attention output,
        MLP and final norm matter only where logits are taken. So on the last stage, in a step
        where fewer rows are sampled than run (a prefill's tokens but its last; a chunk that
        ends mid-prompt: none), the last layer writes every row's K/V and computes attention,
        then carries on (o_proj, MLP, norm) with the sampled rows alone: ~5/6 of a layer's
        matmuls per prompt token, 1/30 of the default model's prefill. Each row's arithmetic is
        unchanged, so logits are bitwise those of the full computation."""
        residual: torch.Tensor | None
        if self.embed_tokens is not None:
            x, residual = self.embed_tokens(fb.input_ids), None
        else:
            first = next(self.layers[self.held[0]].parameters())  # the activations' dtype and device
            shape = (fb.input_ids.shape[0], self.hidden_size)
            x, residual = self.parallel.recv_prev(
                [torch.empty(shape, dtype=first.dtype, device=first.device) for _ in range(2)]
            )
        stack = self._decode_stack(fb, x, cos_sin, head)
        rows = fb.logits_indices
        tail = self._stack_tail(fb, x, stack)
        if tail:
            assert stack is not None
            (out,) = stack.run(
                x, residual, fb.positions, cos_sin, fb.slot_mapping, fb.block_tables, fb.seq_lens,
                fb.query_start_loc, tail,
            )  # fmt: skip
            return out
        pruned = self.norm is not None and self.prune_last_layer and rows.shape[0] < x.shape[0]
        if stack is not None:
            x, residual = stack.run(
                x, residual, fb.positions, cos_sin, fb.slot_mapping, fb.block_tables, fb.seq_lens,
                fb.query_start_loc, 0,
            )  # fmt: skip
        elif pruned:
            *layers, last = self.held_layers
            for layer in layers:
                x, residual = layer(x, residual, fb, cos_sin)
            x, residual = last(x, residual, fb, cos_sin, rows)
        else:
            for layer in self.held_layers:
                x, residual = layer(x, residual, fb, cos_sin)
        if self.norm is None:
            assert residual is not None  # every stage holds at least one layer
            self.parallel.send_next([x, residual])
            return None
        assert residual is not None
        if stack is not None or not pruned:
            x, residual = x[rows], residual[rows]
        x, _ = self.norm(x, fb, residual)
        return x

    def _stack_tail(self, fb: ForwardBatch, x: torch.Tensor, stack: Any | None) -> int:
        """What the decode stack runs after the layers: 0 nothing (it returns the last layer's
        hidden states and residual), 1 the final norm, 2 that and the LM head's argmax (a greedy
        step, where the stack holds the head). Only where every row samples, as in a decode
        step: `logits_indices` is then every row in order, so no rows are picked."""
        if stack is None or not self._stack_final or fb.logits_indices.shape[0] != x.shape[0]:
            return 0
        return 2 if fb.greedy and self._stack_argmax else 1

    def _decode_stack(
        self, fb: ForwardBatch, x: torch.Tensor, cos_sin: torch.Tensor, head: ParallelLMHead | None
    ) -> Any | None:
        """The backend's compiled decode stack for this step, or None where the layers run one by
        one: steps with prefill tokens, fp8 caches, other dtypes, tensor parallelism (its
        all-reduces), qk-norm, and layers whose matmuls only Python can run (a bias, mixed GGUF
        types, bf16 without AVX-512 BF16 tiles). The same ops in the same order either way:
        results are bitwise equal."""
        if (
            not self.use_decode_stack
            or fb.max_query_len != 1
            or fb.kv_scales is not None
            or fb.ops.decode_stack is None
            or x.dtype not in (torch.float32, torch.bfloat16)
            or cos_sin.dtype is not torch.float32
            or fb.block_tables.dtype is not torch.int32
            or fb.seq_lens.dtype is not torch.int32
            or fb.query_start_loc.dtype is not torch.int32
        ):
            return None
        return self._stack_for(fb.ops, fb.kv_caches, x.dtype, head)

    def greedy_stack(
        self, ops: Ops, kv_caches: KVCaches, cos_sin: torch.Tensor, head: ParallelLMHead
    ) -> Any | None:
        """The decode stack with the embedding's rows set (`DecodeStack.greedy_step`: a greedy
        decode step from the ids to the LM head's argmax, in which every row samples), or None
        where such a step takes another path: `_decode_stack`'s conditions that do not depend on
        the step, an embedding the stack cannot look up (tensor parallelism, a quantized tied
        head), pipeline stages, a head without argmax tiles."""
        lookup = None if self.embed_tokens is None else self.embed_tokens.stack_lookup()
        if (
            lookup is None
            or self.norm is None
            or not self.use_decode_stack
            or ops.decode_stack is None
            or cos_sin.dtype is not torch.float32
        ):
            return None
        weight, tiled = lookup
        # the lookup's rows: embed_rows widens float16 tiles to float32
        dtype = torch.float32 if tiled and weight.dtype is torch.float16 else weight.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            return None
        stack = self._stack_for(ops, kv_caches, dtype, head)
        if stack is None or not self._stack_argmax:
            return None
        stack.set_embedding(weight, tiled)
        return stack

    def _stack_for(
        self, ops: Ops, kv_caches: KVCaches, dtype: torch.dtype, head: ParallelLMHead | None
    ) -> Any | None:
        """The stack for these caches (built on first use), or None where the layers cannot run in one."""
        if self._stack is None or self._stack[0] is not kv_caches:
            self._stack = (kv_caches, self._build_stack(ops, kv_caches, dtype, head))
        return self._stack[1]

    def _build_stack(
        self, ops: Ops, kv_caches: KVCaches, dtype: torch.dtype, head: ParallelLMHead | None
    ) -> Any | None:
        assert ops.decode_stack is not None
        if self.parallel.tp_size != 1 or not self.held_layers:
            return None
        first, eps = self.held_layers[0].self_attn, self.held_layers[0].input_layernorm.eps
        stack = ops.decode_stack(first.num_heads, first.num_kv_heads, first.scale, eps)
        for layer in self.held_layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            mms = [lin.native_mm for lin in linears]
            k_cache, v_cache = kv_caches[attn.layer_idx]
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if (
                attn.q_norm is not None
                or {layer.input_layernorm.eps, layer.post_attention_layernorm.eps} != {eps}
                or any(mm is None for mm in mms)
                or any(w.dtype is not dtype for w in norms)
                or not native_attention_caches(norms[0], k_cache, v_cache)
            ):
                return None
            stack.add_layer(
                *norms, [mm[0] for mm in mms if mm], [mm[1] for mm in mms if mm], k_cache, v_cache
            )
        self._stack_final = self.norm is not None and self.norm.weight.dtype is dtype
        head_tiles = head.argmax_weight(dtype) if head is not None and self._stack_final else None
        self._stack_argmax = head_tiles is not None
        if self.norm is not None and self._stack_final:
            stack.set_final(self.norm.weight, self.norm.eps, head_tiles)
        return stack


class LlamaForCausalLM(nn.Module):
    cos_sin_cache: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Model(cfg)
        self.stage = current().layout
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size) if self.stage.is_last_stage else None
        self.tied_parameter_names: set[str] = set()
        if cfg.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            # One matrix for both, in the head's layout: on CPUs that is the fast one for the
            # vocabulary-wide matmul (see layers/linear.py); the lookup of a few rows reads it strided.
            self.model.embed_tokens.tie_to(self.lm_head)
        max_pos = cfg.max_position
        self.register_buffer(
            "cos_sin_cache",
            build_cos_sin_cache(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling),
            persistent=False,
        )

    def checkpoint_name_map(self, name: str) -> tuple[str | None, str | int | None]:
        """Checkpoint tensor name -> (our parameter name, shard of a fused parameter); None for a
        tensor this pipeline stage does not hold."""
        first, last = self.stage.is_first_stage, self.stage.is_last_stage
        if name == "lm_head.weight":
            # tied: the embedding is the head (on a last stage without the embedding, the
            # checkpoint's embedding loads into the head instead)
            return (None, None) if self.config.tie_word_embeddings or not last else (name, None)
        if name == "model.embed_tokens.weight":
            if first:
                return name, None
            return ("lm_head.weight", None) if last and self.config.tie_word_embeddings else (None, None)
        if name.startswith("model.norm.") and not last:
            return None, None
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) not in self.model.held:
            return None, None
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), shard
        return name, None

    def greedy_decoder(self, ops: Ops, kv_caches: KVCaches) -> GreedyDecoder | None:
        """A greedy decode step in one native call, for steps in which every row samples and
        every sampling row is plain greedy (what `forward` of a `fb.greedy` decode step returns,
        the same ops in the same order: the same ids); None where this model's steps take
        `forward`'s path."""
        if self.lm_head is None:
            return None
        cos_sin = self.cos_sin_cache
        stack = self.model.greedy_stack(ops, kv_caches, cos_sin, self.lm_head)
        if stack is None:
            return None

        def step(
            input_ids: torch.Tensor,
            positions: torch.Tensor,
            slot_mapping: torch.Tensor,
            block_table: torch.Tensor,
            rows: torch.Tensor,
            seq_lens: torch.Tensor,
            query_start_loc: torch.Tensor,
        ) -> list[int]:
            return stack.greedy_step(  # type: ignore[no-any-return,unused-ignore]
                input_ids, positions, cos_sin, slot_mapping, block_table, rows, seq_lens, query_start_loc
            )

        return step

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor | None:
        """Logits [num_sampling_seqs, vocab] in float32, only for the rows that sample (None on
        a pipeline stage before the last); for a `fb.greedy` step, where the LM head computes
        them without the logits, those rows' argmax ids, int64 [num_sampling_seqs]."""
        hidden = self.model(fb, self.cos_sin_cache, self.lm_head)
        if hidden is None or self.lm_head is None:
            return None
        if hidden.dtype is torch.int64:  # the decode stack ran the head's argmax (fb.greedy)
            return hidden
        if fb.greedy:
            ids = self.lm_head.greedy_ids(hidden)
            if ids is not None:
                return ids
        return self.lm_head(hidden).float()
