"""Prefix-cache block hashes: a chain over full blocks, seeded per scheduler.

Block i of a sequence hashes the key (hash of block i-1, its token ids, extra keys),
so two sequences share block i only when everything before it matches too. The chain
starts from a root derived from a seed; a random seed (the default) means nobody can
precompute colliding prompts. The idea follows vLLM's `hash_block_tokens` and
nano-vllm's chained xxhash; the hash here is blake2b over a msgpack encoding, which is
deterministic for a given seed across processes and Python versions.

Hashes only locate candidates: the pool compares the stored key on every hit, so a
collision costs a cache miss, never wrong KV.
"""

from __future__ import annotations

import hashlib
from typing import NewType

import msgspec

BlockHash = NewType("BlockHash", bytes)
# (parent block hash, the block's token ids, extra keys such as the cache salt)
BlockKey = tuple[BlockHash, tuple[int, ...], tuple[object, ...]]

_DIGEST_SIZE = 16  # 128 bits: accidental collisions are negligible, and hits are verified anyway
_encode = msgspec.msgpack.Encoder().encode


def root_hash(seed: bytes) -> BlockHash:
    """The parent of every sequence's first block."""
    return BlockHash(hashlib.blake2b(seed, digest_size=_DIGEST_SIZE, person=b"pagebus-root").digest())


def hash_block(key: BlockKey) -> BlockHash:
    """Hash one full block's key. Tests monkeypatch this (module attribute) to force collisions."""
    return BlockHash(hashlib.blake2b(_encode(key), digest_size=_DIGEST_SIZE).digest())
