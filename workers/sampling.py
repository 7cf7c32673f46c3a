"""Batched sampling over requests with different parameters.

Order, as vLLM applies it: penalties -> min_tokens mask -> greedy rows take the argmax;
random rows divide by temperature, mask with top_k / top_p / min_p and draw by the
exponential race (argmax of p / Exp(1) noise), which needs no cumulative sum and lets every
row use its own noise source. Logprobs are of the raw model distribution (vLLM's default).
A seeded row draws its noise from a generator keyed by (seed, sample index, output
position), so its output depends on nothing else in the batch and survives preemption.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from pagebus.bus.messages import SamplingParams, TokenLogprobs


@dataclass
class SampleRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    sample_index: int
    stop_ids: tuple[int, ...]  # ids masked while fewer than min_tokens were generated


def _noise_seed(seed: int, sample_index: int, position: int) -> int:
    key = f"{seed}:{sample_index}:{position}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded random rows

    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRow]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [num_rows, vocab] float32 on any device. Returns token ids and logprobs."""
        logits = logits.float().cpu()
        raw = logits
        if any(_has_penalty(r.params) or len(r.output_ids) < r.params.min_tokens for r in rows):
            logits = logits.clone()
            for i, r in enumerate(rows):
                _apply_penalties(logits[i], r)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows)
            picked = self._sample_random(logits[idx], [rows[i] for i in random_rows])
            tokens[idx] = picked
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            lp = torch.log_softmax(raw[torch.tensor(want)], dim=-1)
            for j, i in enumerate(want):
                logprobs[i] = _token_logprobs(lp[j], token_list[i], rows[i].params.logprobs or 0)
        return token_list, logprobs

    def _sample_random(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        temp = torch.tensor([r.params.temperature for r in rows]).unsqueeze(1)
        logits = logits / temp
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _mask_top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([r.params.min_p for r in rows]).unsqueeze(1)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        noise = torch.empty_like(probs)
        for i, r in enumerate(rows):
            if r.params.seed is None:
                noise[i].exponential_(generator=self.generator)
            else:
                g = torch.Generator().manual_seed(
                    _noise_seed(r.params.seed, r.sample_index, len(r.output_ids))
                )
                noise[i].exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _apply_penalties(row: torch.Tensor, r: SampleRow) -> None:
    """In place on one row of logits [vocab]."""
    p = r.params
    if p.repetition_penalty != 1.0:
        # Over prompt and output (vLLM/HF): shrink positive logits, push negative ones down.
        seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if r.output_ids and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
        counts = torch.bincount(torch.tensor(r.output_ids), minlength=row.shape[0]).float()
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    if len(r.output_ids) < p.min_tokens and r.stop_ids:
        row[torch.tensor(r.stop_ids)] = float("-inf")


def _mask_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.tensor([v if v > 0 else vocab for v in top_k]).clamp(max=vocab)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # drop a token when the tokens ranked above it already hold top_p of the mass
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= torch.tensor(top_p).unsqueeze(1)
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _token_logprobs(lp: torch.Tensor, token: int, top_n: int) -> TokenLogprobs:
    chosen = float(lp[token])
    rank = int((lp > lp[token]).sum()) + 1
    top_vals, top_ids = lp.topk(top_n) if top_n > 0 else (lp[:0], lp[:0].long())
    return TokenLogprobs(
        token_id=token,
        logprob=chosen,
        rank=rank,
        top_token_ids=top_ids.tolist(),
        top_logprobs=top_vals.tolist(),
    )
