"""Speculative decoding in the scheduler, against a fake worker that verifies drafts.

The fake model mostly repeats the token five positions back (so prompt lookup finds drafts that
are often, not always, right) and its tokens depend only on the sequence's tokens: outputs with
speculation must equal outputs without, whatever the batching, preemption or aborts. The KV
fingerprints of the harness catch a block table that drifts when rejected drafts' blocks are
freed; the hashed blocks are checked to hold accepted tokens only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pagebus.bus.config import SpeculativeConfig
from pagebus.bus.messages import BatchResult, ExecuteBatch, SamplingParams
from pagebus.scheduler import hashing
from pagebus.scheduler.ngram import propose_ngram
from pagebus.scheduler.scheduler import Scheduler

from tests.scheduler.harness import Outputs, assert_pool_whole, check_invariants, make_req, make_sched


def model_next(tokens: list[int], sample_index: int) -> int:
    if (len(tokens) * 7 + sample_index) % 11 == 0 or len(tokens) < 5:
        return (sum(tokens) + 7 * sample_index) % 97 + 3
    return tokens[-5]


def _fingerprints(tokens: list[int]) -> list[int]:
    out, prev = [], 0
    for t in tokens:
        prev = hash((prev, t))
        out.append(prev)
    return out


@dataclass
class _Seq:
    tokens: list[int]
    blocks: list[int]
    sample_index: int
    computed: int
    fps: list[int] = field(default_factory=list)


class SpecWorker:
    """Mirrors a real worker: appends drafts, writes KV for every scheduled position (drafts
    too), checks every attended position, then verifies drafts against model_next."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.seqs: dict[str, _Seq] = {}
        self.kv: dict[tuple[int, int], int] = {}

    def step(self, batch: ExecuteBatch) -> BatchResult:
        for seq_id in batch.finished_seq_ids:
            del self.seqs[seq_id]
        work: list[tuple[str, _Seq, int, int, list[int]]] = []
        for ns in batch.new_seqs:
            assert ns.seq_id not in self.seqs
            w = _Seq(list(ns.token_ids), list(ns.block_ids), ns.sample_index, ns.num_computed_tokens)
            self.seqs[ns.seq_id] = w
            work.append((ns.seq_id, w, ns.num_computed_tokens, ns.num_scheduled_tokens, []))
        for cs in batch.cached_seqs:
            w = self.seqs[cs.seq_id]
            assert cs.num_computed_tokens == w.computed
            if cs.block_offset >= 0:
                del w.blocks[cs.block_offset :]
            w.blocks.extend(cs.new_block_ids)
            drafts = list(cs.spec_token_ids)
            assert cs.num_scheduled_tokens == len(w.tokens) - w.computed + len(drafts)
            w.tokens.extend(drafts)
            work.append((cs.seq_id, w, cs.num_computed_tokens, cs.num_scheduled_tokens, drafts))
        bs = self.bs
        for _, w, start, n, _ in work:
            assert start + n <= min(len(w.tokens), len(w.blocks) * bs)
            w.fps = _fingerprints(w.tokens)
            for p in range(start, start + n):
                self.kv[w.blocks[p // bs], p % bs] = w.fps[p]
        seq_ids, token_ids, counts = [], [], []
        for seq_id, w, start, n, drafts in work:
            for p in range(start + n):
                assert self.kv.get((w.blocks[p // bs], p % bs)) == w.fps[p], f"{seq_id}: bad KV at {p}"
            w.computed = start + n
            if w.computed < len(w.tokens):
                continue
            base = len(w.tokens) - len(drafts)
            out: list[int] = []
            for j in range(len(drafts) + 1):
                out.append(model_next(w.tokens[: base + j], w.sample_index))
                if j == len(drafts) or out[-1] != drafts[j]:
                    break
            w.tokens[base:] = out
            w.computed = base + len(out) - 1
            seq_ids.append(seq_id)
            token_ids += out
            counts.append(len(out))
        return BatchResult(step_id=batch.step_id, seq_ids=seq_ids, token_ids=token_ids, num_tokens=counts)


SPEC = SpeculativeConfig(
    method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, disable_by_batch_size=64
)


def _requests(rng: random.Random, num: int) -> list[tuple[str, list[int], SamplingParams]]:
    reqs = []
    for i in range(num):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randrange(3, 30))]
        stop = [rng.randrange(3, 100)] if i % 3 == 0 else []
        params = SamplingParams(
            temperature=0.0, max_tokens=rng.randrange(1, 40), n=1 + i % 2, stop_token_ids=stop
        )
        reqs.append((f"r{i}", prompt, params))
    return reqs


def _run(
    sched: Scheduler, reqs, abort_at: dict[int, str] | None = None
) -> tuple[Outputs, dict[str, list[int]]]:
    """Add requests a few per step, abort some, run to the end checking invariants."""
    worker, out = SpecWorker(sched.block_size), Outputs()
    pending = list(reqs)
    prompts = {rid: prompt for rid, prompt, _ in reqs}
    for step in range(20_000):
        for rid, prompt, params in pending[:3]:
            assert not sched.add_request(
                make_req(rid, prompt, **{f: getattr(params, f) for f in params.__struct_fields__})
            )
        pending = pending[3:]
        if abort_at and step in abort_at:
            out.record(sched.abort([abort_at[step]]))
        if not sched.has_unfinished() and not pending:
            if sched.cfg.enable_prefix_caching:
                _check_hashed_blocks_accepted(sched, out, prompts)
            return out, prompts
        batch = sched.schedule()
        if batch is None:
            continue
        out.record(sched.update(batch, worker.step(batch)))
        check_invariants(sched)
        if sched.cfg.enable_prefix_caching and step % 8 == 0:
            _check_hashed_blocks_accepted(sched, out, prompts)
    raise AssertionError("no end")


def _check_hashed_blocks_accepted(sched: Scheduler, out: Outputs, prompts: dict[str, list[int]]) -> None:
    """Every hashed block is a block of some sample's accepted tokens (prompt + output so far):
    its hash is on that sample's chain. With prefix caching on, every block's extra key is (None,)."""
    bs = sched.block_size
    valid: set[hashing.BlockHash] = set()
    samples = [prompts[rid] + toks for (rid, _), toks in out.tokens.items()] + list(prompts.values())
    for seq_toks in samples:
        parent = sched.root
        for i in range(len(seq_toks) // bs):
            parent = hashing.hash_block((parent, tuple(seq_toks[i * bs : (i + 1) * bs]), (None,)))
            valid.add(parent)
    for h in sched.block_pool.cached:
        assert h in valid, f"a hashed block holds tokens no sample accepted: {sched.block_pool.cached[h]}"


def test_ngram_proposer_finds_latest_longest_match() -> None:
    toks = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    assert propose_ngram(toks, 3, 2, 4) == [8, 5, 1]  # latest occurrence of [1, 2, 3]
    assert propose_ngram([7, 1, 2, 7, 1, 2], 5, 2, 3) == [7, 1, 2]
    assert propose_ngram([1, 2, 3, 4], 3, 2, 3) == []
    assert propose_ngram([5, 5, 5, 5], 2, 2, 2) == [5]  # an overlapping run ends at the last token
    # ids above 255 span several bytes: a byte match across two ids must not count
    # (0x200, 0x100, 0x300 hold the bytes of [2, 1] at a 1-byte offset)
    assert propose_ngram([0x200, 0x100, 0x300, 2, 1], 1, 2, 2) == []
    assert propose_ngram([2, 1, 7, 0x200, 0x100, 0x300, 2, 1], 1, 2, 2) == [7]


def test_speculation_changes_no_output_and_frees_every_block() -> None:
    rng = random.Random(0)
    reqs = _requests(rng, 24)
    ref, _ = _run(make_sched(num_blocks=400, max_model_len=128), reqs)
    for caching in (True, False):
        sched = make_sched(
            num_blocks=400, max_model_len=128, speculative_config=SPEC, enable_prefix_caching=caching
        )
        got, _ = _run(sched, reqs)
        assert got.tokens == ref.tokens and got.finish == ref.finish
        for (rid, _), toks in got.tokens.items():
            params = next(p for r, _, p in reqs if r == rid)
            assert len(toks) <= params.max_tokens
        st = sched.stats()
        assert st.spec_num_accepted_tokens > 0 and st.spec_num_draft_tokens > st.spec_num_accepted_tokens
        assert st.spec_drafted_per_position[0] == st.spec_num_drafts
        assert sum(st.spec_accepted_per_position) == st.spec_num_accepted_tokens
        assert_pool_whole(sched)


def test_speculation_through_preemption_and_aborts() -> None:
    rng = random.Random(1)
    reqs = _requests(rng, 30)
    ref, _ = _run(make_sched(num_blocks=400, max_model_len=128), reqs)
    # 24 blocks of 4 tokens: sequences preempt each other constantly
    sched = make_sched(num_blocks=24, max_model_len=64, speculative_config=SPEC, max_num_batched_tokens=32)
    reqs = [(rid, p, params) for rid, p, params in reqs if len(p) + params.max_tokens <= 64]
    got, _ = _run(sched, reqs)
    assert sched.stats().num_preemptions > 0 and sched.stats().spec_num_accepted_tokens > 0
    assert got.tokens == {k: v for k, v in ref.tokens.items() if k[0] in {r for r, _, _ in reqs}}
    assert_pool_whole(sched)
    sched = make_sched(num_blocks=24, max_model_len=64, speculative_config=SPEC, max_num_batched_tokens=32)
    got, _ = _run(sched, reqs, abort_at={3 * i + 2: rid for i, (rid, _, _) in enumerate(reqs[::3])})
    assert_pool_whole(sched)


def test_speculation_switches_off_above_the_batch_size() -> None:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_batch_size=2)
    sched = make_sched(num_blocks=200, speculative_config=spec)
    reqs = [
        (f"r{i}", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(temperature=0.0, max_tokens=8)) for i in range(3)
    ]
    worker, out = SpecWorker(sched.block_size), Outputs()
    for rid, prompt, _ in reqs:
        sched.add_request(make_req(rid, prompt, temperature=0.0, max_tokens=8))
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch is not None
        if len(sched.running) > 2:
            assert all(not cs.spec_token_ids for cs in batch.cached_seqs)
        out.record(sched.update(batch, worker.step(batch)))
    assert sched.stats().spec_num_drafts == 0
    assert_pool_whole(sched)
