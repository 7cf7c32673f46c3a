"""A hypothesis state machine over the block pool: holders allocate, append, fill (register),
share via cache hits and free, while invariants are checked after every step."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pagebus.scheduler import hashing
from pagebus.scheduler.block_pool import BlockPool, KVBlock
from pagebus.scheduler.hashing import BlockHash, BlockKey

ROOT = hashing.root_hash(b"state-machine")
NUM_BLOCKS = 9


@dataclass
class Holder:
    """What a sequence holds: its blocks, and the keys of its leading full blocks."""

    blocks: list[KVBlock]
    keys: list[tuple[BlockHash, BlockKey]] = field(default_factory=list)


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.holders: list[Holder] = []
        self.content: dict[int, BlockKey] = {}  # what each block's KV really holds
        self.chains: list[list[tuple[BlockHash, BlockKey]]] = []  # every filled prefix seen

    def _pick(self, i: int) -> Holder:
        return self.holders[i % len(self.holders)]

    def _allocate(self, n: int) -> list[KVBlock]:
        blocks = self.pool.allocate(n)
        for b in blocks:
            self.content.pop(b.block_id, None)  # about to be overwritten
        return blocks

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        if n <= self.pool.num_free:
            self.holders.append(Holder(self._allocate(n)))

    @rule()
    def drain(self) -> None:
        """Take every free block: evicts all cached free blocks at once."""
        if self.pool.num_free:
            self.holders.append(Holder(self._allocate(self.pool.num_free)))

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 99))
    def append(self, i: int) -> None:
        if self.pool.num_free:
            self._pick(i).blocks.extend(self._allocate(1))

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 99), tokens=st.tuples(st.integers(0, 2), st.integers(0, 2)))
    def fill(self, i: int, tokens: tuple[int, int]) -> None:
        """The holder's next block becomes full with these tokens and is registered."""
        h = self._pick(i)
        if len(h.keys) == len(h.blocks):
            return
        block = h.blocks[len(h.keys)]
        assert block.ref_count == 1, "only full (registered) blocks are ever shared"
        parent = h.keys[-1][0] if h.keys else ROOT
        key: BlockKey = (parent, tokens, ())
        block_hash = hashing.hash_block(key)
        self.content[block.block_id] = key
        self.pool.register(block, block_hash, key)
        h.keys.append((block_hash, key))
        self.chains.append(list(h.keys))

    @precondition(lambda self: self.chains)
    @rule(i=st.integers(0, 99), extra=st.integers(0, 2))
    def hit(self, i: int, extra: int) -> None:
        """A new holder finds a known chain's cached prefix, then allocates `extra` blocks."""
        chain = self.chains[i % len(self.chains)]
        hits = []
        for block_hash, key in chain:
            block = self.pool.lookup(block_hash, key)
            if block is None:
                break
            assert self.content[block.block_id] == key, "a hit returned a block holding other tokens"
            hits.append(block)
        revived = sum(1 for b in hits if b.ref_count == 0)
        if not hits or revived + extra > self.pool.num_free:
            return
        self.pool.acquire(hits)
        self.holders.append(Holder(hits + self._allocate(extra), chain[: len(hits)]))

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        h = self._pick(i)
        self.holders.remove(h)
        self.pool.free(reversed(h.blocks))

    @invariant()
    def free_xor_held_and_refs_match(self) -> None:
        held = Counter(b.block_id for h in self.holders for b in h.blocks)
        free = self.pool.free_block_ids()
        assert len(free) == len(set(free)) and 0 not in free and 0 not in held
        assert not set(free) & set(held)
        assert set(free) | set(held) == set(range(1, NUM_BLOCKS))
        for block in self.pool.blocks[1:]:
            assert block.ref_count == held[block.block_id], block

    @invariant()
    def cached_hashes_point_at_their_tokens(self) -> None:
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash and block.key is not None
            assert hashing.hash_block(block.key) == block_hash
            assert self.content.get(block.block_id) == block.key

    def teardown(self) -> None:
        for h in self.holders:
            self.pool.free(reversed(h.blocks))
        assert self.pool.num_free == self.pool.num_usable
        assert all(b.ref_count == 0 for b in self.pool.blocks)


BlockPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockPool = BlockPoolMachine.TestCase
