"""Speculative decoding's Prometheus series, from the scheduler's cumulative stats."""

from __future__ import annotations

from pagebus.bus.messages import SchedulerStats
from pagebus.frontends.http.metrics import Metrics


def test_spec_decode_counters_and_rates() -> None:
    stats = SchedulerStats(
        spec_num_drafts=4,
        spec_num_draft_tokens=10,
        spec_num_accepted_tokens=6,
        spec_drafted_per_position=[4, 3, 3],
        spec_accepted_per_position=[3, 2, 1],
    )
    get = Metrics(lambda: stats).registry.get_sample_value
    assert get("pagebus:spec_decode_num_drafts_total") == 4
    assert get("pagebus:spec_decode_num_draft_tokens_total") == 10
    assert get("pagebus:spec_decode_num_accepted_tokens_total") == 6
    assert get("pagebus:spec_decode_num_accepted_tokens_per_pos_total", {"position": "1"}) == 2
    assert get("pagebus:spec_decode_num_drafted_tokens_per_pos_total", {"position": "2"}) == 3
    assert get("pagebus:spec_decode_acceptance_rate") == 0.6
    assert get("pagebus:spec_decode_mean_accepted_length") == 2.5


def test_no_speculation_reads_zero() -> None:
    get = Metrics(lambda: None).registry.get_sample_value
    assert get("pagebus:spec_decode_num_draft_tokens_total") == 0
    assert get("pagebus:spec_decode_mean_accepted_length") == 0
