"""A fake worker and a driver loop for scheduler tests.

The fake worker keeps what a real worker keeps per sequence (tokens, block table,
computed count), so it checks every `ExecuteBatch` delta against its own mirror. It
simulates KV as a fingerprint of the prefix ending at each position, writes the whole
batch's KV before any sequence "attends", then checks every position a sequence attends
to: a wrong cache hit, a block reused while still needed, or a bad block table all show
up as a fingerprint mismatch. Its sampled token depends only on the sequence's tokens
and sample index, so outputs must not depend on batching, caching or preemption.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import (
    AddRequest,
    BatchResult,
    CachedSeq,
    ExecuteBatch,
    FinishReason,
    NewSeq,
    SamplingParams,
    SeqUpdate,
)
from pagebus.scheduler import hashing
from pagebus.scheduler.scheduler import Scheduler
from pagebus.scheduler.sequence import SeqStatus


def fake_token(token_sum: int, sample_index: int) -> int:
    """Never 0..2, so tests can use those as EOS/stop ids that are never sampled."""
    return (token_sum + 7 * sample_index) % 97 + 3


def make_sched(
    num_blocks: int = 64,
    max_model_len: int = 256,
    eos: int | None = None,
    lookahead: bool = False,
    **cfg: object,
) -> Scheduler:
    cfg.setdefault("block_size", 4)
    cfg.setdefault("max_request_tokens", 1 << 30)  # these tests overcommit tiny caches on purpose
    return Scheduler(
        EngineConfig(**cfg), num_blocks, max_model_len, eos, hash_seed=b"test", lookahead=lookahead
    )  # type: ignore[arg-type]


def make_req(rid: str, prompt: list[int], **params: object) -> AddRequest:
    extra = {k: params.pop(k) for k in ("priority", "arrival_time", "cache_salt") if k in params}
    return AddRequest(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(**params), **extra)  # type: ignore[arg-type]


@dataclass
class _WorkerSeq:
    tokens: list[int]
    blocks: list[int]
    sample_index: int
    computed: int
    fingerprints: list[int] = field(default_factory=list)
    token_sum: int = 0

    def extend_fingerprints(self) -> None:
        for t in self.tokens[len(self.fingerprints) :]:
            prev = self.fingerprints[-1] if self.fingerprints else 0
            self.fingerprints.append(hash((prev, t)))


class FakeWorker:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seqs: dict[str, _WorkerSeq] = {}
        self.kv: dict[tuple[int, int], int] = {}  # (block id, slot) -> prefix fingerprint

    def step(self, batch: ExecuteBatch) -> BatchResult:
        for seq_id in batch.finished_seq_ids:
            del self.seqs[seq_id]  # the scheduler only drops what it sent
        work: list[tuple[str, _WorkerSeq, int, int]] = []
        for ns in batch.new_seqs:
            assert ns.seq_id not in self.seqs, f"{ns.seq_id} sent in full twice"
            w = _WorkerSeq(list(ns.token_ids), list(ns.block_ids), ns.sample_index, ns.num_computed_tokens)
            w.token_sum = sum(w.tokens)
            self.seqs[ns.seq_id] = w
            work.append((ns.seq_id, w, ns.num_computed_tokens, ns.num_scheduled_tokens))
        for cs in batch.cached_seqs:
            w = self.seqs[cs.seq_id]
            assert cs.num_computed_tokens == w.computed, f"{cs.seq_id}: computed count drifted"
            w.blocks.extend(cs.new_block_ids)
            work.append((cs.seq_id, w, cs.num_computed_tokens, cs.num_scheduled_tokens))
        bs = self.block_size
        for _, w, start, n in work:  # write this step's KV for the whole batch first
            assert n >= 1 and start + n <= len(w.tokens) and start + n <= len(w.blocks) * bs
            w.extend_fingerprints()
            for p in range(start, start + n):
                self.kv[w.blocks[p // bs], p % bs] = w.fingerprints[p]
        seq_ids, token_ids = [], []
        for seq_id, w, start, n in work:  # then attend over everything before each new token
            assert 0 not in w.blocks, "the null block was handed out"
            for p in range(start + n):
                assert self.kv.get((w.blocks[p // bs], p % bs)) == w.fingerprints[p], (
                    f"{seq_id}: wrong KV at position {p}"
                )
            w.computed = start + n
            if w.computed == len(w.tokens):
                tok = fake_token(w.token_sum, w.sample_index)
                w.tokens.append(tok)
                w.token_sum += tok
                seq_ids.append(seq_id)
                token_ids.append(tok)
        return BatchResult(step_id=batch.step_id, seq_ids=seq_ids, token_ids=token_ids)


def expected_output(
    prompt: list[int], sample_index: int, params: SamplingParams, eos: int | None, max_model_len: int
) -> tuple[list[int], FinishReason]:
    """What an unconstrained run must produce, from the spec's stop rules."""
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - len(prompt)
    total, out = sum(prompt), []
    while True:
        tok = fake_token(total, sample_index)
        total += tok
        out.append(tok)
        if len(out) >= params.min_tokens and (
            tok in params.stop_token_ids or (tok == eos and not params.ignore_eos)
        ):
            return out, FinishReason.STOP
        if len(out) >= max_tokens or len(prompt) + len(out) >= max_model_len:
            return out, FinishReason.LENGTH


@dataclass
class Outputs:
    tokens: dict[tuple[str, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    finish: dict[tuple[str, int], FinishReason] = field(default_factory=dict)
    updates: list[SeqUpdate] = field(default_factory=list)
    batches: list[ExecuteBatch] = field(default_factory=list)

    def record(self, updates: list[SeqUpdate]) -> None:
        for u in updates:
            key = (u.request_id, u.sample_index)
            assert key not in self.finish, f"update after finish for {key}"
            self.tokens[key].extend(u.new_token_ids)
            if u.finish_reason is not None:
                self.finish[key] = u.finish_reason
        self.updates.extend(updates)


def start(sched: Scheduler) -> tuple[FakeWorker, Outputs]:
    return FakeWorker(sched.block_size), Outputs()


def plan(batch: ExecuteBatch) -> dict[str, tuple[int, int]]:
    """seq id -> (num_computed_tokens, num_scheduled_tokens)."""
    seqs = [*batch.new_seqs, *batch.cached_seqs]
    return {s.seq_id: (s.num_computed_tokens, s.num_scheduled_tokens) for s in seqs}


def new_seq(batch: ExecuteBatch, seq_id: str) -> NewSeq:
    (ns,) = [s for s in batch.new_seqs if s.seq_id == seq_id]
    return ns


def cached_seq(batch: ExecuteBatch, seq_id: str) -> CachedSeq:
    (cs,) = [s for s in batch.cached_seqs if s.seq_id == seq_id]
    return cs


def step(sched: Scheduler, worker: FakeWorker, out: Outputs) -> ExecuteBatch | None:
    batch = sched.schedule()
    if batch is None:
        return None
    check_batch(sched, batch, worker)
    out.batches.append(batch)
    out.record(sched.update(batch, worker.step(batch)))
    check_invariants(sched)
    return batch


def run_to_end(sched: Scheduler, worker: FakeWorker, out: Outputs, max_steps: int = 20_000) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        assert step(sched, worker, out) is not None, "unfinished work but nothing scheduled: deadlock"
    raise AssertionError(f"not done after {max_steps} steps")


def check_batch(sched: Scheduler, batch: ExecuteBatch, worker: FakeWorker, ahead: bool = False) -> None:
    """`ahead`: planned while a step is in flight, so the worker's mirror of the block tables
    lags one step (its fingerprint checks still catch a wrong table)."""
    scheduled = [*batch.new_seqs, *batch.cached_seqs]
    assert sum(s.num_scheduled_tokens for s in scheduled) <= sched.cfg.max_num_batched_tokens
    assert len(scheduled) <= sched.cfg.max_num_seqs
    assert len({s.seq_id for s in scheduled}) == len(scheduled)
    if ahead:
        return
    for s in scheduled:
        seq = sched.live[s.seq_id]
        known = worker.seqs[s.seq_id].blocks if s.seq_id in worker.seqs else []
        sent = list(s.block_ids) if isinstance(s, NewSeq) else known + list(s.new_block_ids)
        assert sent == [b.block_id for b in seq.blocks], f"{s.seq_id}: worker block table would drift"


def check_invariants(sched: Scheduler) -> None:
    """Ref counts equal holders, free xor held, shared blocks are cached, the hash map is honest."""
    pool = sched.block_pool
    holders: dict[int, int] = defaultdict(int)
    for seq in sched.running:
        assert seq.status is SeqStatus.RUNNING
        ids = [b.block_id for b in seq.blocks]
        assert len(set(ids)) == len(ids) and 0 not in ids
        for b in ids:
            holders[b] += 1
    for seq in sched.waiting:
        assert seq.status is SeqStatus.WAITING and not seq.blocks
    assert len(sched.live) == len(sched.running) + len(sched.waiting)
    free = set(pool.free_block_ids())
    for block in pool.blocks[1:]:
        assert block.ref_count == holders[block.block_id], block
        assert (block.block_id in free) == (block.ref_count == 0), block
        if holders[block.block_id] > 1:
            assert block.block_hash is not None, f"{block} shared but not a cached full block"
    for h, block in pool.cached.items():
        assert block.block_hash == h and block.key is not None and hashing.hash_block(block.key) == h


def assert_pool_whole(sched: Scheduler) -> None:
    pool = sched.block_pool
    assert pool.num_free == pool.num_usable
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert not sched.live and not sched.requests and not sched.has_unfinished()
