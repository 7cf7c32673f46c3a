"""The paged KV block pool: ref counts, an LRU free queue and the prefix-cache hash map.

Layout (num_blocks = 6 here)::

    blocks      [0 null][1][2][3][4][5]
    ref_count       -    1  0  2  0  0
    free queue  head -> 4 -> 2 -> 5 -> tail      (evict from the head, free to the tail)
    hash map    h(a) -> 1, h(b) -> 3, h(c) -> 2  (2 is free but still cached: a hit revives it)

Block states::

    state          ref_count  in free queue  block_hash   how it gets there
    -------------  ---------  -------------  -----------  ---------------------------------------
    free, empty    0          yes            None         start, or freed before it was ever full
    in use         >= 1       no             None or h    allocate() / acquire() on a cache hit
    free, cached   0          yes            h            free() of a registered block
    null (0)       -          never          never        reserved; padding for block tables

Transitions: `allocate` pops the head (dropping its hash: that is the eviction) and sets
ref 1; `acquire` (a cache hit) adds a ref and pulls the block out of the queue if it was
free; `free` drops a ref and appends the block to the tail at 0; `register` gives a full
block its hash. Callers free a sequence's blocks in reverse so its tail blocks, the least
likely to be shared, are evicted first.

The queue is an OrderedDict keyed by block id: popping the head, appending and removing
from the middle are all O(1), like vLLM's intrusive `FreeKVCacheBlockQueue`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pagebus.scheduler.hashing import BlockHash, BlockKey

NULL_BLOCK_ID = 0


class KVBlock:
    """One block's bookkeeping; the KV itself lives in the worker."""

    __slots__ = ("block_hash", "block_id", "key", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None  # set once full and registered
        self.key: BlockKey | None = None  # what was hashed; compared on every hit

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out, cached ones included (they are evictable)."""
        return len(self.free_queue)

    def allocate(self, n: int) -> list[KVBlock]:
        """Pop n blocks from the head of the free queue, evicting their cached hashes."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks but only {len(self.free_queue)} are free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # eviction: the cached KV is about to be overwritten
                del self.cached[block.block_hash]
                block.block_hash = None
                block.key = None
            block.ref_count = 1
            out.append(block)
        return out

    def lookup(self, block_hash: BlockHash, key: BlockKey) -> KVBlock | None:
        """The cached block for this hash, only if its stored key matches (no refs taken)."""
        block = self.cached.get(block_hash)
        if block is None or block.key != key:
            return None
        return block

    def acquire(self, blocks: Iterable[KVBlock]) -> None:
        """Take a ref on cache hits, reviving free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a ref on each block in order; blocks reaching 0 go to the tail (evicted last)."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than it was held")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block

    def register(self, block: KVBlock, block_hash: BlockHash, key: BlockKey) -> bool:
        """Make a full block findable. If another block already holds this hash, keep that one
        (it may be shared already) and leave this block uncached; returns whether it registered."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.key = key
        self.cached[block_hash] = block
        return True

    def free_block_ids(self) -> list[int]:
        """The free queue from head (next evicted) to tail, for tests and debugging."""
        return list(self.free_queue)
