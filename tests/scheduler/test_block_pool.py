"""Hand-written block pool scenarios: exact block ids, ref counts and eviction order."""

from __future__ import annotations

import pytest
from pagebus.scheduler import hashing
from pagebus.scheduler.block_pool import BlockPool
from pagebus.scheduler.hashing import BlockHash, BlockKey

ROOT = hashing.root_hash(b"seed")


def key_of(tokens: tuple[int, ...], parent: BlockHash = ROOT) -> tuple[BlockHash, BlockKey]:
    key: BlockKey = (parent, tokens, (None,))
    return hashing.hash_block(key), key


def ids(blocks: list) -> list[int]:
    return [b.block_id for b in blocks]


def test_fresh_pool_hands_out_blocks_in_order_never_the_null_block() -> None:
    pool = BlockPool(6)
    assert pool.num_usable == 5 and pool.num_free == 5
    assert pool.free_block_ids() == [1, 2, 3, 4, 5]
    blocks = pool.allocate(3)
    assert ids(blocks) == [1, 2, 3]
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert pool.free_block_ids() == [4, 5]
    assert ids(pool.allocate(2)) == [4, 5]
    with pytest.raises(RuntimeError, match="only 0 are free"):
        pool.allocate(1)
    assert pool.blocks[0].ref_count == 0 and 0 not in pool.free_block_ids()


def test_free_in_reverse_puts_the_tail_block_first_in_line_for_eviction() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    pool.free(reversed(blocks))
    assert pool.free_block_ids() == [4, 5, 3, 2, 1]
    # Never-used blocks go first, then the freed sequence from its tail to its head.
    assert ids(pool.allocate(4)) == [4, 5, 3, 2]


def test_cache_hit_revives_a_free_block_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(6)
    a, b = pool.allocate(2)
    h, key = key_of((1, 2, 3, 4))
    assert pool.register(a, h, key)
    pool.free([b, a])
    assert pool.free_block_ids() == [3, 4, 5, 2, 1]
    hit = pool.lookup(h, key)
    assert hit is a and hit.ref_count == 0  # lookup takes no ref
    pool.acquire([hit])
    assert a.ref_count == 1
    assert pool.free_block_ids() == [3, 4, 5, 2]
    pool.acquire([hit])  # a second holder (another sample) only bumps the count
    assert a.ref_count == 2 and pool.num_free == 4
    pool.free([a])
    assert a.ref_count == 1 and 1 not in pool.free_block_ids()
    pool.free([a])
    assert pool.free_block_ids() == [3, 4, 5, 2, 1]
    assert pool.lookup(h, key) is a  # a freed block keeps its hash until evicted


def test_lru_eviction_takes_the_oldest_freed_block_and_drops_its_hash() -> None:
    pool = BlockPool(4)
    first, second, third = pool.allocate(3)
    hashes = []
    for block, tok in ((first, 10), (second, 20), (third, 30)):
        h, key = key_of((tok,))
        pool.register(block, h, key)
        hashes.append((h, key))
    pool.free([second])
    pool.free([first])
    pool.free([third])
    assert pool.free_block_ids() == [2, 1, 3]
    (evicted,) = pool.allocate(1)
    assert evicted is second and evicted.block_hash is None and evicted.key is None
    assert pool.lookup(*hashes[1]) is None and hashes[1][0] not in pool.cached
    assert pool.lookup(*hashes[0]) is first and pool.lookup(*hashes[2]) is third
    assert ids(pool.allocate(2)) == [1, 3]
    assert not pool.cached


def test_a_colliding_hash_with_different_tokens_is_a_miss() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    same = BlockHash(b"\x00" * 16)
    pool.register(a, same, (ROOT, (1, 2), (None,)))
    assert pool.lookup(same, (ROOT, (9, 9), (None,))) is None  # tokens differ
    assert pool.lookup(same, (BlockHash(b"p"), (1, 2), (None,))) is None  # parent differs
    assert pool.lookup(same, (ROOT, (1, 2), ("salt",))) is None  # extra keys differ
    assert pool.lookup(same, (ROOT, (1, 2), (None,))) is a


def test_registering_a_hash_twice_keeps_the_first_block() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    h, key = key_of((5, 6))
    assert pool.register(a, h, key)
    assert not pool.register(b, h, key)
    assert b.block_hash is None and pool.lookup(h, key) is a
    assert not pool.register(a, *key_of((7, 8)))  # a block's hash never changes while cached


def test_freeing_more_than_held_is_an_error() -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([a])
    assert pool.free_block_ids() == [2, 1]


def test_pool_needs_a_usable_block() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)
