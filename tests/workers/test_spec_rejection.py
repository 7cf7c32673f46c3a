"""The verification sampler is exact in distribution: a chi-square test on a tiny vocabulary.

A fixed toy target (p0 for the first token, p1(. | x0) for the second) and fixed drafts; each
of N seeded samples generates two tokens with speculation (one verification of two drafts, then
a plain step when the first draft was rejected), and the counts of (x0, x1) must fit
p0(x0) p1(x1 | x0) under the same temperature and top_k the sampler applies.
"""

from __future__ import annotations

import math

import torch
from pagebus.bus.messages import SamplingParams
from pagebus.workers.sampling import Sampler, SampleRow
from pagebus.workers.spec.verify import accepted_tokens, verify_rows

V = 6
N = 6000
DRAFTS = [2, 4]


def _logits(context: list[int]) -> torch.Tensor:
    """The toy model: a fixed function of the context, peaked enough that drafts often hit."""
    g = torch.Generator().manual_seed(1 + sum((i + 1) * 7**j for j, i in enumerate(context)))
    return torch.randn(V, generator=g) * 1.5


def _target(context: list[int], params: SamplingParams) -> torch.Tensor:
    x = _logits(context) / params.temperature
    keep = x >= x.topk(params.top_k).values[-1]
    return torch.softmax(x.masked_fill(~keep, -math.inf), dim=-1).double()


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at normal quantile z (3.09: p = 0.001), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_two_token_distribution_matches_the_target() -> None:
    params = [SamplingParams(temperature=0.8, top_k=5, seed=s) for s in range(N)]
    sampler = Sampler(seed=0)
    # one verification per sample: rows at positions 0, 1, 2 given the drafts before them
    rows = [r for p in params for r in verify_rows(p, [0], [], DRAFTS, 0, ())]
    per_pos = torch.stack([_logits(DRAFTS[:j]) for j in range(len(DRAFTS) + 1)])
    sampled, _ = sampler(per_pos.repeat(N, 1), rows)
    outs = [accepted_tokens(sampled[3 * i : 3 * i + 3], DRAFTS) for i in range(N)]
    # samples whose first draft was rejected take a plain step for their second token
    again = [i for i, o in enumerate(outs) if len(o) == 1]
    if again:
        rows2 = [SampleRow(params[i], [0], outs[i], 0, ()) for i in again]
        logits2 = torch.stack([_logits(outs[i]) for i in again])
        for i, tok in zip(again, sampler(logits2, rows2)[0], strict=True):
            outs[i].append(tok)
    counts = torch.zeros(V, V, dtype=torch.float64)
    for o in outs:
        counts[o[0], o[1]] += 1
    p0 = _target([], params[0])
    expected = torch.stack([p0[a] * _target([a], params[0]) for a in range(V)]) * N
    cells = expected >= 5  # pool the rare cells into one
    observed = torch.cat([counts[cells], counts[~cells].sum().view(1)])
    want = torch.cat([expected[cells], expected[~cells].sum().view(1)])
    assert counts[~(expected > 0)].sum() == 0, "a token outside top_k was drawn"
    stat = float(((observed - want) ** 2 / want.clamp(min=1e-12)).sum())
    df = int(cells.sum())  # cells + the pool - 1
    assert stat < _chi2_critical(df), f"chi-square {stat:.1f} over {df} degrees of freedom"
    # and the drafts were accepted about as often as the target makes them: p0(d1)
    hits = sum(1 for o in outs if o[0] == DRAFTS[0]) / N
    assert abs(hits - float(p0[DRAFTS[0]])) < 4 * math.sqrt(float(p0[DRAFTS[0]]) / N) + 0.01
    assert 0.05 < hits < 0.95, "the toy target should accept and reject the first draft"
