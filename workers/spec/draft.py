"""The draft-model proposer: a second, smaller model of the same vocabulary, run by the worker.

Its KV cache has the target's block count and is addressed by the same block ids and the same
block-table rows (the runner's InputBuffers), so every block the scheduler hands out, shares as a
prefix-cache hit or frees on preemption holds the draft's KV as well as the target's: nothing
else needs bookkeeping. Each step the draft first catches up on every scheduled sequence (the
positions the target computes this step, plus the last draft of a fully accepted run, which it
never ran), then runs one decode step per draft position for the sequences that draft. Drafts
are the draft model's argmax: a point-mass proposal, which verify.py keeps exact.

The scheduler registers a block for prefix sharing only once the draft has computed it too
(see Scheduler._settle_drafts).
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagebus.workers.runner import KVCaches, ModelRunner

log = logging.getLogger(__name__)


class DraftModel:
    def __init__(self, runner: ModelRunner, path: str) -> None:
        from pagebus.workers.runner import load_model

        self.runner = runner
        self.model, mc = load_model(path, runner.dtype, runner.device, weight_cache=runner.cfg.weight_cache)
        target = runner.model_config
        if mc.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model {path} has a vocabulary of {mc.vocab_size} tokens, the target {target.vocab_size}; "
                "a draft model must share the target's tokenizer"
            )
        if mc.max_position < runner.max_model_len:
            raise ValueError(
                f"draft model {path} handles {mc.max_position} positions, below max_model_len {runner.max_model_len}"
            )
        shape = (runner.num_blocks, runner.block_size, mc.num_kv_heads, mc.head_dim)
        dev, dt = runner.device, runner.dtype
        self.kv_caches: KVCaches = [
            (torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
            for _ in range(mc.num_layers)
        ]
        self.computed: dict[str, int] = {}  # positions whose draft KV is written, per seq
        log.info(
            "draft model %s: %s, %d layers, KV cache %.2f GiB",
            path, mc.family, mc.num_layers, 2 * sum(k.numel() * k.element_size() for k, _ in self.kv_caches) / 2**30,
        )  # fmt: skip

    def forget(self, seq_id: str) -> None:
        self.computed.pop(seq_id, None)

    @torch.no_grad()
    def propose(self, scheduled: list[tuple[str, int, int]], want: dict[str, int]) -> dict[str, list[int]]:
        """scheduled: (seq id, computed, scheduled tokens incl. drafts) as the target runs them,
        before any draft is appended; want: seq id -> drafts to propose. Returns the drafts."""
        r = self.runner
        seqs = r.seqs
        # step 1: catch up on everything before each seq's next token; drafting seqs sample
        parts: list[tuple[str, int, int]] = []  # (seq id, first position, end)
        for seq_id, computed, n in scheduled:
            end = computed + n - want.get(seq_id, 0)
            start = min(self.computed.get(seq_id, computed), computed)
            parts.append((seq_id, start, end))
            self.computed[seq_id] = end
        drafts: dict[str, list[int]] = {seq_id: [] for seq_id in want}
        rows = [(seq_id, list(range(a, b)), seqs[seq_id].token_ids[a:b]) for seq_id, a, b in parts]
        sampling = [seq_id for seq_id, _, _ in rows if seq_id in want]
        for seq_id, tok in zip(sampling, self._step(rows, want), strict=True):
            drafts[seq_id].append(tok)
        # steps 2..k: one position per seq still drafting
        for j in range(1, max(want.values(), default=0)):
            active = [seq_id for seq_id, k in want.items() if k > j]
            rows = []
            for seq_id in active:
                pos = len(seqs[seq_id].token_ids) + j - 1
                rows.append((seq_id, [pos], [drafts[seq_id][-1]]))
                self.computed[seq_id] = pos + 1
            for seq_id, tok in zip(active, self._step(rows, set(active)), strict=True):
                drafts[seq_id].append(tok)
        return drafts

    def settle(self, seq_id: str, last_real: int, num_drafts: int, accepted: int) -> None:
        """After verification: the draft's KV is right up to the accepted drafts it ran (its
        last draft it never ran). last_real: the position of the token before the drafts."""
        self.computed[seq_id] = min(self.computed[seq_id], last_real + 1 + min(accepted, num_drafts - 1))

    def _step(
        self, rows: list[tuple[str, list[int], list[int]]], sample: dict[str, int] | set[str]
    ) -> list[int]:
        """One forward of the draft over (seq id, positions, tokens) rows; the argmax after the last
        position of each row whose seq is in `sample`, in row order."""
        from pagebus.workers.runner import StepMeta

        r = self.runner
        bs = r.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        table_rows: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        logits_rows: list[int] = []
        for seq_id, pos, toks in rows:
            s = r.seqs[seq_id]
            input_ids += toks
            positions += pos
            slots += [s.block_ids[p // bs] * bs + p % bs for p in pos]
            table_rows.append(s.row)
            seq_lens.append(pos[-1] + 1)
            starts.append(starts[-1] + len(pos))
            if seq_id in sample:
                logits_rows.append(starts[-1] - 1)
        qlens = [b - a for a, b in itertools.pairwise(starts)]
        decodes = sum(q == 1 for q in qlens)
        meta = StepMeta(max(qlens), max(seq_lens), decodes, len(qlens) - decodes, seq_lens, starts)
        t = r.inputs.load(input_ids, positions, slots, table_rows, seq_lens, starts, logits_rows)
        # greedy: proposals are the draft's argmax, from the fused LM head where it has one
        logits = self.model(r._forward_batch(t, meta, t.logits_indices, self.kv_caches, greedy=True))
        if logits_rows:
            if logits.dtype is torch.int64:
                return list(logits.tolist())
            return r._greedy_ids(logits)  # waits for the stream, as the next load needs
        if r.device.type == "cuda":  # the next load rewrites the host buffers this step reads
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
        return []
