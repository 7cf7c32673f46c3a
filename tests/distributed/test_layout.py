"""How heads, layers and vocabulary rows divide over ranks, and what is refused."""

from __future__ import annotations

import pytest
from pagebus.workers.distributed.layout import (
    HeadSplit,
    Layout,
    UnsplittableModelError,
    balanced_split,
    split_heads,
)


def test_balanced_split_covers_every_item_once() -> None:
    for n, parts in [(9, 2), (1536, 2), (30, 4), (3, 3)]:
        spans = [balanced_split(n, parts, i) for i in range(parts)]
        assert [s for s, _ in spans] == [sum(z for _, z in spans[:i]) for i in range(parts)]
        assert sum(z for _, z in spans) == n
        assert max(z for _, z in spans) - min(z for _, z in spans) <= 1


def test_smollm2_heads_split_by_whole_kv_groups_over_two_ranks() -> None:
    # 9 query heads in 3 GQA groups of 3: rank 0 takes groups 0-1, rank 1 group 2.
    assert [split_heads(9, 3, 2, r) for r in range(2)] == [HeadSplit(0, 6, 0, 2), HeadSplit(6, 3, 2, 1)]


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    s = [split_heads(4, 1, 2, r) for r in range(2)]
    assert [(h.q_start, h.num_q, h.kv_start, h.num_kv) for h in s] == [(0, 2, 0, 1), (2, 2, 0, 1)]
    s = [split_heads(8, 2, 4, r) for r in range(4)]
    assert [(h.q_start, h.num_q, h.kv_start) for h in s] == [(0, 2, 0), (2, 2, 0), (4, 2, 1), (6, 2, 1)]


@pytest.mark.parametrize(("heads", "kv", "tp"), [(3, 1, 2), (6, 2, 3), (4, 2, 8)])
def test_unsplittable_heads_are_refused_naming_the_numbers(heads: int, kv: int, tp: int) -> None:
    with pytest.raises(UnsplittableModelError) as e:
        split_heads(heads, kv, tp, 0)
    assert f"tensor_parallel_size {tp}" in str(e.value)
    assert f"{heads} attention heads" in str(e.value) and f"{kv} KV heads" in str(e.value)


def test_ranks_are_stage_major_and_layers_contiguous() -> None:
    lay = [Layout(2, 2, r) for r in range(4)]
    assert [(x.tp_rank, x.pp_rank) for x in lay] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [x.layers(30) for x in lay] == [range(0, 15)] * 2 + [range(15, 30)] * 2
    assert {x.result_rank for x in lay} == {2}
    with pytest.raises(UnsplittableModelError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        Layout(1, 3, 0).layers(2)
