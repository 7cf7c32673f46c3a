"""Verifying drafts against the target model's logits, exactly in distribution.

Both proposers draft deterministically (n-gram lookup; the draft model's argmax), so the draft
distribution q is a point mass on each draft d. Rejection sampling then accepts d with
probability min(1, p(d) / q(d)) = p(d) and on rejection draws from the residual
max(p - q, 0), which is p with d removed, renormalised. Drawing x ~ p at that position and
accepting iff x == d does exactly that: P(x == d) = p(d), and x given x != d is the residual.
So each position is sampled by the ordinary sampler, with the ordinary per-position noise (a
seeded request draws the very tokens it would draw without speculation), and the first
mismatch is the correction token; when every draft matches, the last row's token is the bonus.
Greedy rows reduce to a prefix match against the argmax.
"""

from __future__ import annotations

from pagebus.bus.messages import SamplingParams
from pagebus.workers.sampling import SampleRow


def verify_rows(
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    drafts: list[int],
    sample_index: int,
    stop_ids: tuple[int, ...],
) -> list[SampleRow]:
    """One sampling row per verified position: row j samples the token after drafts[:j], with
    those drafts counted as output (penalties, min_tokens and the seeded noise's position)."""
    return [
        SampleRow(params, prompt_ids, output_ids + drafts[:j], sample_index, stop_ids)
        for j in range(len(drafts) + 1)
    ]


def accepted_tokens(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens a verification yields: the drafts matching the tokens sampled at their
    positions, then the first sampled token that did not match (or the bonus token)."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(sampled)} sampled tokens for {len(drafts)} drafts")
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return sampled[: a + 1]
