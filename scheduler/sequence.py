"""Per-sequence state: one sample of one request, its tokens, progress and blocks.

A sequence has no prefill or decode phase: `num_computed_tokens` (tokens whose KV sits
in `blocks`) catches up with `len(token_ids)` (prompt + generated), a chunk per step.
It samples a token in the step where it catches up.

Between a step's plan and its result, `num_ahead` counts the tokens it computes and
`num_placeholders` the token it samples. With async scheduling the next step is planned before
that result, from `num_computed_after` and `num_tokens_after`: the workers know the sampled
token, and the scheduler learns it from the result.
"""

from __future__ import annotations

import enum

from pagebus.bus.messages import AddRequest, SamplingParams
from pagebus.scheduler import hashing
from pagebus.scheduler.block_pool import KVBlock
from pagebus.scheduler.hashing import BlockHash, BlockKey


class SeqStatus(enum.Enum):
    WAITING = enum.auto()  # queued: new, or preempted (holds no blocks)
    RUNNING = enum.auto()  # holds blocks; scheduled whenever the budget reaches it
    FINISHED = enum.auto()  # finished or aborted; gone from every queue


class Sequence:
    """One sample of one request. `seq_id` keys it between the scheduler and the workers only
    (unique: the sample index follows the last "#"); everything else addresses a sample by
    (request_id, sample_index)."""

    __slots__ = (
        "block_hashes",
        "block_size",
        "blocks",
        "extra_keys",
        "known_to_worker",
        "max_tokens",
        "num_ahead",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_placeholders",
        "num_registered_blocks",
        "num_sent_blocks",
        "num_sent_tokens",
        "num_spec_tokens",
        "params",
        "prompt_len",
        "request_id",
        "root",
        "sample_index",
        "seq_id",
        "sort_key",
        "spec_token_ids",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        req: AddRequest,
        sample_index: int,
        max_tokens: int,
        sort_key: tuple[float, ...],
        root: BlockHash,
        extra_keys: tuple[object, ...],
        block_size: int,
    ) -> None:
        self.request_id = req.request_id
        self.sample_index = sample_index
        self.seq_id = f"{req.request_id}#{sample_index}"
        self.token_ids: list[int] = list(req.prompt_token_ids)
        self.prompt_len = len(req.prompt_token_ids)
        self.params: SamplingParams = req.params
        self.max_tokens = max_tokens  # resolved: never None
        self.sort_key = sort_key  # smaller runs first, and is preempted last
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0
        self.num_ahead = 0  # scheduled in steps in flight, not yet in num_computed_tokens
        self.num_placeholders = 0  # sampled by steps in flight, not yet in token_ids
        self.num_cached_tokens: int | None = None  # prompt tokens hit at first admission
        self.blocks: list[KVBlock] = []
        # Leading blocks already in the hash map (hits, or registered by us): never re-registered.
        self.num_registered_blocks = 0
        self.known_to_worker = False  # the worker holds our state: send deltas, drop when done
        self.num_sent_blocks = 0  # block ids the worker already has
        self.num_sent_tokens = 0  # token ids every worker already has (pipeline stages: see CachedSeq)
        # Drafts scheduled this step after the one real token (n-gram ids; a draft model's
        # worker proposes its own, so only the count); reset by the step's update.
        self.num_spec_tokens = 0
        self.spec_token_ids: list[int] = []
        # Hash chain state; hashes depend only on tokens, so they survive preemption.
        self.block_hashes: list[BlockHash] = []
        self.root = root
        self.extra_keys = extra_keys
        self.block_size = block_size

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_computed_after(self) -> int:
        """Tokens whose KV sits in `blocks` once the steps in flight have run."""
        return self.num_computed_tokens + self.num_ahead

    @property
    def num_tokens_after(self) -> int:
        """Tokens once the steps in flight have sampled: what the next plan catches up with."""
        return len(self.token_ids) + self.num_placeholders

    def block_key(self, i: int) -> BlockKey:
        """The key of full block i; needs the hash of block i-1 (see `block_hash`)."""
        parent = self.block_hashes[i - 1] if i else self.root
        bs = self.block_size
        return (parent, tuple(self.token_ids[i * bs : (i + 1) * bs]), self.extra_keys)

    def block_hash(self, i: int) -> BlockHash:
        """The hash of full block i, extending the memoized chain as needed."""
        if (i + 1) * self.block_size > len(self.token_ids):
            raise ValueError(f"block {i} of {self.seq_id} is not full")
        while len(self.block_hashes) <= i:
            self.block_hashes.append(hashing.hash_block(self.block_key(len(self.block_hashes))))
        return self.block_hashes[i]

    def reset(self) -> None:
        """Forget progress and blocks (preemption by recompute); tokens and hashes stay."""
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0
        self.num_ahead = 0
        self.num_placeholders = 0
        self.blocks = []
        self.num_registered_blocks = 0
        self.known_to_worker = False
        self.num_sent_blocks = 0
        self.num_sent_tokens = 0
        self.num_spec_tokens = 0
        self.spec_token_ids = []

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.name}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, blocks={[b.block_id for b in self.blocks]})"
        )
