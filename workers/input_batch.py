"""Persistent step inputs: filled in place each step, copied to the device in two transfers.

All integer inputs of a step live in two flat buffers, one int64 and one int32, laid out as

    int64: [input_ids T][positions T][slot_mapping T][table rows S][logits_indices L][delta slots D]
    int32: [seq_lens S][query_start_loc S + 1][delta block ids D]

with T tokens, S sequences, L sampling rows and D new block-table entries this step. On CUDA
the host side is pinned and each buffer goes over in one non-blocking copy; on CPU the device
buffers are the host buffers. A decode step padded to a CUDA-graph size B has T = S = B, so
its inputs land at the same addresses every replay of that graph reads.

The block table is persistent and per slot: each live sequence owns a row of a device table
[max_seqs + 1, max_blocks] for its lifetime; new block ids travel as (flat index, id) deltas
scattered on the device, and a step gathers the rows it runs. The last row is all zeros (the
reserved null block 0): padding rows point there.

The host buffers are rewritten only after the previous step's sampled ids came back, which
waits for the stream, so an in-flight copy never reads a half-written buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def _align(n: int) -> int:
    """Sections start on 16-element boundaries: aligned pointers keep Triton from compiling a
    second, unaligned specialization of each kernel, whatever the step's sizes."""
    return (n + 15) & ~15


class _Layout:
    """Offsets of each section in the two flat buffers (see the module docstring)."""

    def __init__(self, t: int, s: int, n_logits: int) -> None:
        self.pos = _align(t)
        self.slots = 2 * _align(t)
        self.rows = 3 * _align(t)
        self.logits = self.rows + _align(s)
        self.delta64 = self.logits + _align(n_logits)
        self.qsl = _align(s)
        self.delta32 = self.qsl + _align(s + 1)


@dataclass
class StepTensors:
    """Device views of one step's inputs (valid until the next `load`)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    rows: torch.Tensor  # [S] int64 block-table rows
    logits_indices: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


class InputBuffers:
    def __init__(self, max_seqs: int, max_tokens: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        self.max_blocks = max_blocks_per_seq
        # Deltas per step: at most a full row for every live sequence.
        self.max_deltas = max_seqs * max_blocks_per_seq
        self.size64 = 4 * _align(max_tokens) + _align(max_seqs) + self.max_deltas
        self.size32 = _align(max_seqs) + _align(max_seqs + 1) + self.max_deltas
        on_cuda = device.type == "cuda"
        self.host64 = torch.zeros(self.size64, dtype=torch.int64, pin_memory=on_cuda)
        self.host32 = torch.zeros(self.size32, dtype=torch.int32, pin_memory=on_cuda)
        self.np64: np.ndarray = self.host64.numpy()
        self.np32: np.ndarray = self.host32.numpy()
        if on_cuda:
            self.dev64 = torch.zeros(self.size64, dtype=torch.int64, device=device)
            self.dev32 = torch.zeros(self.size32, dtype=torch.int32, device=device)
        else:
            self.dev64, self.dev32 = self.host64, self.host32
        self.block_table = torch.zeros(max_seqs + 1, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.pad_row = max_seqs
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self._delta_index: list[int] = []
        self._delta_block: list[int] = []
        self._decode_views: dict[int, StepTensors] = {}  # views(t, t, t), by t

    # ------------------------------------------------------------------ block-table rows
    def assign_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError(f"more than max_num_seqs={self.max_seqs} sequences held at once")
        return self._free_rows.pop()

    def release_row(self, row: int) -> None:
        # Stale ids stay in the row: they are valid block ids, and nothing reads past seq_len.
        self._free_rows.append(row)

    def add_blocks(self, row: int, first_col: int, block_ids: list[int]) -> None:
        """Queue block ids for columns first_col.. of a row; applied by the next `load`."""
        if first_col + len(block_ids) > self.max_blocks:
            raise ValueError(
                f"a sequence holds {first_col + len(block_ids)} blocks; max_model_len allows {self.max_blocks}"
            )
        base = row * self.max_blocks + first_col
        self._delta_index.extend(range(base, base + len(block_ids)))
        self._delta_block.extend(block_ids)

    # ------------------------------------------------------------------ one step
    def load(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        rows: list[int],
        seq_lens: list[int],
        query_start_loc: list[int],
        logits_indices: list[int],
    ) -> StepTensors:
        """Write a step into the host buffers, copy them over, apply queued block-table deltas."""
        t, s, n_logits, d = len(input_ids), len(rows), len(logits_indices), len(self._delta_index)
        if t > self.max_tokens or s > self.max_seqs or n_logits > t:
            raise ValueError(
                f"step of {t} tokens / {s} sequences / {n_logits} logits rows exceeds "
                f"{self.max_tokens} / {self.max_seqs} / {t}"
            )
        lay = _Layout(t, s, n_logits)
        a, b = self.np64, self.np32
        a[0:t] = input_ids
        a[lay.pos : lay.pos + t] = positions
        a[lay.slots : lay.slots + t] = slot_mapping
        a[lay.rows : lay.rows + s] = rows
        a[lay.logits : lay.logits + n_logits] = logits_indices
        a[lay.delta64 : lay.delta64 + d] = self._delta_index
        b[0:s] = seq_lens
        b[lay.qsl : lay.qsl + s + 1] = query_start_loc
        b[lay.delta32 : lay.delta32 + d] = self._delta_block
        end64, end32 = lay.delta64 + d, lay.delta32 + d
        if self.dev64 is not self.host64:
            self.dev64[:end64].copy_(self.host64[:end64], non_blocking=True)
            self.dev32[:end32].copy_(self.host32[:end32], non_blocking=True)
        if d:
            flat = self.block_table.view(-1)
            flat.index_copy_(0, self.dev64[lay.delta64 : end64], self.dev32[lay.delta32 : end32])
            self._delta_index.clear()
            self._delta_block.clear()
        return self.views(t, s, n_logits)

    def views(self, t: int, s: int, n_logits: int) -> StepTensors:
        """The device views of a step of t tokens, s sequences and n_logits sampling rows: the
        same addresses for the same sizes, which is what a CUDA graph replays against. A decode
        step's (t == s == n_logits: at most max_seqs of them) are kept: the seven slices took
        ~40 us of a single-stream step, on code the weight stream had flushed."""
        if t == s == n_logits:
            kept = self._decode_views.get(t)
            if kept is None:
                kept = self._decode_views[t] = self._views(t, s, n_logits)
            return kept
        return self._views(t, s, n_logits)

    def _views(self, t: int, s: int, n_logits: int) -> StepTensors:
        lay = _Layout(t, s, n_logits)
        d64, d32 = self.dev64, self.dev32
        return StepTensors(
            input_ids=d64[0:t],
            positions=d64[lay.pos : lay.pos + t],
            slot_mapping=d64[lay.slots : lay.slots + t],
            rows=d64[lay.rows : lay.rows + s],
            logits_indices=d64[lay.logits : lay.logits + n_logits],
            seq_lens=d32[0:s],
            query_start_loc=d32[lay.qsl : lay.qsl + s + 1],
        )

    def gather_block_tables(self, rows: torch.Tensor) -> torch.Tensor:
        """[S, max_blocks] int32: the rows this step runs, in batch order (on the device)."""
        return self.block_table.index_select(0, rows)
