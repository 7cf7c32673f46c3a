"""The offline timing plan of bench/peer_runners/_harness.py: every timed run gets prompts of its own."""

from __future__ import annotations

import pytest

from bench.peer_runners._harness import offline_plan

SINGLE_VARIANTS = {2, 3, 4, *range(40, 100)}  # measure_single's


@pytest.mark.parametrize("repeats", [1, 3, 15])
def test_every_run_has_its_own_prompts(repeats: int) -> None:
    plan = offline_plan([32, 64, 128], repeats)
    assert [len(timed) for _, _, timed in plan] == [repeats] * 3
    used = [v for _, warm, timed in plan for v in (warm, *timed)]
    assert len(used) == len(set(used)) and not SINGLE_VARIANTS & set(used), used
    assert [timed[0] for _, _, timed in plan] == [6, 8, 10]  # the first repeat: what one run always timed


def test_repeats_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        offline_plan([32], 0)
