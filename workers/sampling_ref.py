"""The sampler's spec, one row at a time: what `sampling.Sampler` must equal token for token.

Readable over fast; tests use it as the oracle. It shares the noise function and the row keys
with the batched sampler, and does each step the plain way: a set of seen ids, a bincount, a
full sort for top_k / top_p, a boolean mask for the cutoff.
"""

from __future__ import annotations

import math

import torch
from pagebus.bus.messages import TokenLogprobs
from pagebus.workers.sampling import SampleRow, log_exp_noise


def _f32(v: float) -> torch.Tensor:
    """Parameters as float32 tensors: the batched sampler's arithmetic, not Python doubles."""
    return torch.tensor(v, dtype=torch.float32)


def penalised(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """Penalties, then the min_tokens mask, on a copy of one row of logits [vocab]."""
    p = row.params
    x = logits.float().clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long)
        vals, r = x[seen], _f32(p.repetition_penalty)
        x[seen] = torch.where(vals > 0, vals / r, vals * r)
    if row.output_ids and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
        counts = torch.bincount(torch.tensor(row.output_ids), minlength=x.shape[0]).float()
        x -= _f32(p.frequency_penalty) * counts + _f32(p.presence_penalty) * (counts > 0)
    if len(row.output_ids) < p.min_tokens and row.stop_ids:
        x[torch.tensor(row.stop_ids)] = -math.inf
    return x


def cutoff(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> float:
    """The smallest logit a random row keeps, x being its logits over temperature."""
    vocab = x.shape[0]
    k = top_k if 0 < top_k < vocab else vocab
    cut = -math.inf
    if k < vocab or top_p < 1.0:
        vals = x.sort(descending=True).values
        e = (vals - vals[0]).exp()
        e[k:] = 0.0  # top_k first; top_p applies to the renormalised top_k
        cs = e.cumsum(0)
        total = cs[k - 1] if k < vocab else (x - vals[0]).exp().sum()
        # keep a token while the mass ranked above it is below top_p; the first always stays
        kept = min(k, 1 + int((cs[:-1] < _f32(top_p) * total).sum()))
        cut = float(vals[kept - 1])
    if min_p > 0.0:  # p < min_p * p_max  <=>  logit/T < max logit/T + log(min_p)
        cut = max(cut, float(x.max() + _f32(math.log(min_p))))
    return cut


def sample_row(logits: torch.Tensor, row: SampleRow, key: tuple[int, int]) -> int:
    """One row's token. key: its (mul, add) noise key (sampling.seeded_key for seeded rows)."""
    p = row.params
    x = penalised(logits, row)
    if p.greedy:
        return int(x.argmax())
    x = x / _f32(p.temperature)
    ids = torch.arange(x.shape[0], dtype=torch.int32)
    score = (
        x
        - log_exp_noise(
            torch.tensor([[key[0]]], dtype=torch.int32), torch.tensor([[key[1]]], dtype=torch.int32), ids
        )[0]
    )
    score[x < cutoff(x, p.top_k, p.top_p, p.min_p)] = -math.inf
    return int(score.argmax())


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprobs:
    """Of the raw distribution: the chosen token's logprob, its 1-based rank, the top N."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top_vals, top_ids = lp.topk(top_n)
    return TokenLogprobs(
        token_id=token,
        logprob=float(lp[token]),
        rank=int((lp > lp[token]).sum()) + 1,
        top_token_ids=top_ids.tolist(),
        top_logprobs=top_vals.tolist(),
    )
