"""The scheduler: queues, the per-step token budget, prefix caching and preemption.

Pure Python: bus messages in (`AddRequest`, abort ids, `BatchResult`), bus messages out
(`ExecuteBatch`, `SeqUpdate`). Calls alternate: `schedule()` -> worker runs the batch ->
`update(batch, result)` -> `schedule()` ... With `lookahead` (async scheduling) a second
`schedule()` may come before the first step's `update()`: it plans from where the step in flight
leaves every sequence (scheduler/sequence.py), and the updates come in plan order.

Each step, running sequences go first (decodes and continuing prefill chunks, in queue
order), then waiting ones are admitted from the head while budget, seats and blocks last.
A sequence that cannot get a block preempts the tail of `running` (recompute: it frees
its blocks and rejoins `waiting`). Both queues are sorted by `Sequence.sort_key`:

    fcfs      (arrival counter, sample index)
    priority  (priority, arrival_time, arrival counter, sample index)   lower runs first

so the running tail is always the right victim, and under fcfs a preempted sequence
sorts back in at the front of `waiting`. The shape follows nano-vllm's scheduler; the
"computed tokens catch up" model (no prefill/decode phases) follows vLLM v1.
"""

from __future__ import annotations

import bisect
import operator
import os
from collections import deque

from pagebus.bus.config import EngineConfig, request_limits
from pagebus.bus.messages import (
    AddRequest,
    BatchResult,
    CachedSeq,
    ExecuteBatch,
    FinishReason,
    NewSeq,
    SampleKey,
    SchedulerStats,
    SeqUpdate,
    TokenLogprobs,
)
from pagebus.scheduler.block_pool import BlockPool, KVBlock
from pagebus.scheduler.hashing import root_hash
from pagebus.scheduler.ngram import propose_ngram
from pagebus.scheduler.sequence import SeqStatus, Sequence

_sort_key = operator.attrgetter("sort_key")


class Scheduler:
    """One engine's queues and KV blocks. `num_blocks` comes from the workers (block 0 is
    reserved); `hash_seed` None draws a random prefix-hash root per start."""

    def __init__(
        self,
        cfg: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_id: int | None,
        hash_seed: bytes | None = None,
        block_pool: BlockPool | None = None,
        virtual_engine: tuple[int, int] = (0, 1),
        lookahead: bool = False,
    ) -> None:
        """`block_pool` and `virtual_engine` (index, count): one of several schedulers that share
        the KV blocks and keep a step each in flight through a pipeline (scheduler/virtual.py);
        step ids interleave so they stay unique. `lookahead`: plan a step while one is in flight."""
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.block_pool = block_pool or BlockPool(num_blocks)
        self._engine, self._num_engines = virtual_engine
        self._send_tokens = self._num_engines > 1  # CachedSeq.new_token_ids (one step: none)
        self.max_request_tokens = request_limits(cfg, num_blocks).max_tokens
        # A random root per start: nobody can precompute prompts that collide in our cache.
        self.root = root_hash(os.urandom(32) if hash_seed is None else hash_seed)
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key; victims come off the tail
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its unfinished samples
        self.live: dict[str, Sequence] = {}  # seq id -> every unfinished sequence
        self._dropped: list[str] = []  # seq ids the worker must forget; ride the next batch
        # Planned and not yet updated, oldest first, each with the sequences it ran: a request id
        # may be reused while its old sequence's last step is in flight.
        self._in_flight: deque[tuple[ExecuteBatch, list[tuple[Sequence, int]]]] = deque()
        self.max_in_flight = 2 if lookahead else 1
        self._num_arrivals = 0
        self._num_steps = 0
        self._num_preemptions = 0
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0
        self.spec = cfg.speculative_config
        k = self.spec.num_speculative_tokens if self.spec is not None else 0
        self._spec_num_drafts = 0
        self._spec_num_draft_tokens = 0
        self._spec_num_accepted = 0
        self._spec_drafted = [0] * k  # per draft position
        self._spec_accepted = [0] * k

    # ------------------------------------------------------------------ requests in
    def add_request(self, req: AddRequest) -> list[SeqUpdate]:
        """Queue `params.n` samples; [] when admitted, else one ERROR update per sample."""
        error = self._admission_error(req)
        if error is not None:
            return [
                SeqUpdate(
                    request_id=req.request_id,
                    sample_index=i,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    num_prompt_tokens=len(req.prompt_token_ids),
                    error=error,
                )
                for i in range(max(req.params.n, 1))
            ]
        self._num_arrivals += 1
        if self.cfg.scheduling_policy == "priority":
            base: tuple[float, ...] = (req.priority, req.arrival_time, self._num_arrivals)
        else:
            base = (self._num_arrivals,)
        # Without prefix caching, a key unique to this request (its arrival number, which unlike
        # the request id is never reused) still lets its n samples share the prompt and a
        # preempted sample find its own blocks, but nothing else ever hits.
        extra: tuple[object, ...] = (req.cache_salt,)
        if not self.cfg.enable_prefix_caching:
            extra = (req.cache_salt, self._num_arrivals)
        max_tokens = self._max_tokens(req)
        seqs = [
            Sequence(req, i, max_tokens, (*base, i), self.root, extra, self.block_size)
            for i in range(req.params.n)
        ]
        self.requests[req.request_id] = seqs
        for seq in seqs:
            self.live[seq.seq_id] = seq
            bisect.insort(self.waiting, seq, key=_sort_key)
        return []

    def abort(self, request_ids: list[str], samples: list[SampleKey] | None = None) -> list[SeqUpdate]:
        """Drop requests, and single `samples` (the frontend ends one that way when it hits a stop
        string), now, freeing their blocks; one ABORT update per unfinished sample."""
        popped = [seq for rid in request_ids for seq in self.requests.pop(rid, [])]
        popped += [seq for key in samples or () for seq in self._pop_sample(key)]
        updates = []
        for seq in popped:
            self._release(seq)
            updates.append(
                SeqUpdate(
                    request_id=seq.request_id,
                    sample_index=seq.sample_index,
                    new_token_ids=[],
                    finish_reason=FinishReason.ABORT,
                    num_prompt_tokens=seq.prompt_len,
                    num_cached_tokens=seq.num_cached_tokens or 0,
                )
            )
        if updates:
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
            self.waiting = [s for s in self.waiting if s.status is SeqStatus.WAITING]
        return updates

    def _pop_sample(self, key: SampleKey) -> list[Sequence]:
        samples = self.requests.get(key.request_id, [])
        found = [s for s in samples if s.sample_index == key.sample_index]
        for seq in found:
            samples.remove(seq)
        if not samples:
            self.requests.pop(key.request_id, None)
        return found

    def _max_tokens(self, req: AddRequest) -> int:
        mt = req.params.max_tokens
        return self.max_model_len - len(req.prompt_token_ids) if mt is None else mt

    def _admission_error(self, req: AddRequest) -> str | None:
        """Why this request can never run, or None. Rejecting up front avoids deadlock later."""
        p, limit, n = len(req.prompt_token_ids), self.max_model_len, req.params.n
        if n < 1:
            return f"n must be at least 1, got {n}"
        if p == 0:
            return "prompt is empty; send at least one token"
        if req.request_id in self.requests:
            return f"request_id {req.request_id!r} is already in use by an unfinished request"
        mt = self._max_tokens(req)
        if req.params.max_tokens is None and p >= limit:
            return (
                f"prompt has {p} tokens, but max_model_len is {limit}; "
                "shorten the prompt to leave room for at least one generated token"
            )
        if mt < 1:
            return f"max_tokens must be at least 1, got {mt}"
        if p + mt > limit:
            return (
                f"prompt has {p} tokens and max_tokens is {mt}, but max_model_len is {limit}; "
                "shorten the prompt or lower max_tokens"
            )
        bs, usable = self.block_size, self.block_pool.num_usable
        need = -(-(p + mt) // bs)
        if need > usable:
            return (
                f"prompt has {p} tokens and max_tokens is {mt}, which needs {need} KV blocks of "
                f"{bs} tokens, but the KV cache has only {usable}; shorten the prompt, lower "
                "max_tokens or give the KV cache more memory"
            )
        # Counted in whole blocks, so a request within the default (the cache's capacity) fits
        # the cache whole: nothing preempts it, which bounds how long it delays the others.
        demand = n * need * bs
        if demand > self.max_request_tokens:
            return (
                f"n x (prompt + max_tokens) is {n} x ({p} + {mt}) tokens ({demand} in whole KV blocks "
                f"of {bs}), over max_request_tokens ({self.max_request_tokens}); lower n or max_tokens, "
                "or shorten the prompt"
            )
        return None

    # ------------------------------------------------------------------ the step
    def schedule(self) -> ExecuteBatch | None:
        """Plan one step; None when there is nothing to run."""
        if len(self._in_flight) >= self.max_in_flight:
            raise RuntimeError(f"schedule() called before update() of step {self._in_flight[0][0].step_id}")
        budget = self.cfg.max_num_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        if self.cfg.scheduling_policy == "priority":
            self._preempt_for_waiting_head(budget)
        preempted = False
        # Speculation pays while a step is memory-bound: a larger batch turns it off (see config).
        spec_on = self.spec is not None and len(self.running) <= self.spec.disable_by_batch_size
        # Running sequences first: every one holds blocks, so finishing them frees memory.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_placeholders and self._wait_for_token(seq):
                i += 1
                continue
            n = min(seq.num_tokens_after - seq.num_computed_after, budget)
            if spec_on and n == 1:
                n += self._speculate(seq, budget)
            while not self._grow(seq, n):
                victim = self.running.pop()  # the tail: lowest priority, latest arrival
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self._commit(seq, n)
                plan.append((seq, n))
                budget -= n
                i += 1
        # Then waiting ones, strictly from the head so none starves; none after a
        # preemption, since blocks are short already.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n == 0:
                break
            del self.waiting[0]
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=_sort_key)
            self._commit(seq, n)
            plan.append((seq, n))
            budget -= n
        return self._build_batch(plan) if plan else None

    def _wait_for_token(self, seq: Sequence) -> bool:
        """Whether a sequence whose token is still in flight sits this step out: it surely stops
        on that token (its length), or a grammar must see the token before the next one."""
        return (
            seq.num_generated + seq.num_placeholders >= seq.max_tokens
            or seq.num_tokens_after >= self.max_model_len
            or seq.params.structured_outputs is not None
        )

    def _preempt_for_waiting_head(self, budget: int) -> None:
        """Priority policy: a waiting head that outranks the running tail takes the tail's seat
        or blocks (recompute), as in vLLM. Strict sort-key order keeps it from ping-ponging."""
        while self.waiting and self.running and self.waiting[0].sort_key < self.running[-1].sort_key:
            if len(self.running) < self.cfg.max_num_seqs and self._head_fits(budget):
                return
            self._preempt(self.running.pop())

    def _head_fits(self, budget: int) -> bool:
        """Whether this step's running chunks and the waiting head's first chunk fit the free
        blocks (a head the budget cannot reach this step needs no blocks yet)."""
        bs, head = self.block_size, self.waiting[0]
        grow = 0
        for seq in self.running:
            n = seq.num_tokens_after - seq.num_computed_after
            budget -= n
            grow += max(0, -(-(seq.num_computed_after + n) // bs) - len(seq.blocks))
        hits = self._cached_prefix(head)
        num_hit = len(hits) * bs
        n = min(head.num_tokens - num_hit, budget)
        if n <= 0:
            return True
        revived = sum(1 for b in hits if b.ref_count == 0)
        return grow + -(-(num_hit + n) // bs) - len(hits) + revived <= self.block_pool.num_free

    def _speculate(self, seq: Sequence, budget: int) -> int:
        """Drafts for a decoding seq: sets its spec fields and returns how many, after reserving
        their KV slots (none when the pool is short: speculation never preempts). At most
        max_tokens - 1 generated tokens ahead, so an all-accepted run plus its bonus token never
        overshoots max_tokens or max_model_len."""
        assert self.spec is not None
        k = min(
            self.spec.num_speculative_tokens,
            seq.max_tokens - seq.num_generated - 1,
            self.max_model_len - seq.num_tokens - 1,
            budget - 1,
        )
        # A grammar's state follows one token at a time: constrained seqs do not speculate.
        if k <= 0 or seq.params.structured_outputs is not None:
            return 0
        drafts: list[int] = []
        if self.spec.method == "ngram":
            drafts = propose_ngram(seq.token_ids, k, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
            k = len(drafts)
        if k == 0 or not self._grow(seq, 1 + k):
            return 0
        seq.num_spec_tokens, seq.spec_token_ids = k, drafts
        return k

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Give seq the blocks to hold n more tokens; False when the pool is short."""
        need = -(-(seq.num_computed_after + n) // self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.block_pool.num_free:
            return False
        seq.blocks.extend(self.block_pool.allocate(need))
        return True

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Reuse seq's longest cached prefix and allocate its first chunk; returns the chunk
        size, or 0 (touching nothing) when the blocks do not fit."""
        pool = self.block_pool
        hits = self._cached_prefix(seq)
        num_hit = len(hits) * self.block_size
        n = min(seq.num_tokens - num_hit, budget)
        need = -(-(num_hit + n) // self.block_size) - len(hits)
        revived = sum(1 for b in hits if b.ref_count == 0)  # hits that leave the free queue
        if need + revived > pool.num_free:
            return 0
        pool.acquire(hits)
        seq.blocks = hits + pool.allocate(need)
        seq.num_computed_tokens = num_hit
        seq.num_registered_blocks = len(hits)
        if seq.num_cached_tokens is None:  # first admission; a resume recomputes its own work
            seq.num_cached_tokens = num_hit
        self._num_queried_tokens += seq.num_tokens
        self._num_hit_tokens += num_hit
        return n

    def _cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """Leading full blocks found in the cache, leaving at least one token to compute
        (the step must produce logits for the last one)."""
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block = self.block_pool.lookup(seq.block_hash(i), seq.block_key(i))
            if block is None:
                break
            hits.append(block)
        return hits

    def _commit(self, seq: Sequence, n: int) -> None:
        """Register every block this step fills. The worker writes a layer's KV for the whole
        batch before attending, so a sequence scheduled later in this same step may hit them:
        that is how the n samples of a request share their prompt."""
        end = seq.num_computed_after + n - seq.num_spec_tokens
        # Drafts are not tokens yet, nor is a token still in flight: a block holding one is
        # registered once it is known (accepted, or in a step's result).
        self._register_full(seq, min(end, seq.num_tokens) // self.block_size)

    def _register_full(self, seq: Sequence, full: int) -> None:
        for i in range(seq.num_registered_blocks, full):
            self.block_pool.register(seq.blocks[i], seq.block_hash(i), seq.block_key(i))
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free the blocks (tail first) and rejoin waiting by sort key."""
        self.block_pool.free(reversed(seq.blocks))
        if seq.known_to_worker:
            self._dropped.append(seq.seq_id)
        # Its steps in flight ran the sequence it was: their results must not advance the one
        # that recomputes, which the priority policy may re-admit in this very plan.
        for _, planned in self._in_flight:
            planned[:] = [(s, n) for s, n in planned if s is not seq]
        seq.reset()
        bisect.insort(self.waiting, seq, key=_sort_key)
        self._num_preemptions += 1

    def _build_batch(self, plan: list[tuple[Sequence, int]]) -> ExecuteBatch:
        """Full state for sequences the worker does not hold, deltas for the rest. Workers
        apply `finished_seq_ids` first: a reused request id can be dropped and re-sent at once."""
        new_seqs, cached_seqs = [], []
        for seq, n in plan:
            computed = seq.num_computed_after
            seq.num_ahead += n
            if computed + n - seq.num_spec_tokens == seq.num_tokens_after:  # caught up: it samples
                seq.num_placeholders += 1
            if not seq.known_to_worker:
                new_seqs.append(
                    NewSeq(
                        seq_id=seq.seq_id,
                        token_ids=list(seq.token_ids),
                        prompt_len=seq.prompt_len,
                        params=seq.params,
                        block_ids=[b.block_id for b in seq.blocks],
                        num_computed_tokens=computed,
                        num_scheduled_tokens=n,
                        sample_index=seq.sample_index,
                    )
                )
                seq.known_to_worker = True
            else:
                new_ids = [b.block_id for b in seq.blocks[seq.num_sent_blocks :]]
                offset = seq.num_sent_blocks
                spec = seq.spec_token_ids
                toks = seq.token_ids[seq.num_sent_tokens :] if self._send_tokens else []
                cached_seqs.append(CachedSeq(seq.seq_id, new_ids, computed, n, spec, offset, toks))
            seq.num_sent_blocks = len(seq.blocks)
            seq.num_sent_tokens = seq.num_tokens
        self._num_steps += 1
        batch = ExecuteBatch(
            step_id=self._num_steps * self._num_engines + self._engine,
            new_seqs=new_seqs,
            cached_seqs=cached_seqs,
            finished_seq_ids=self._dropped,
        )
        self._dropped = []
        self._in_flight.append((batch, plan))
        return batch

    # ------------------------------------------------------------------ results in
    def update(self, batch: ExecuteBatch, result: BatchResult) -> list[SeqUpdate]:
        """Advance every scheduled sequence, append sampled tokens and finish the stopped."""
        if not self._in_flight or batch.step_id != self._in_flight[0][0].step_id:
            raise RuntimeError(f"update() for step {batch.step_id}, which is not the oldest batch in flight")
        if result.step_id != batch.step_id:
            raise RuntimeError(f"result of step {result.step_id} given for step {batch.step_id}")
        _, plan = self._in_flight.popleft()
        counts = result.num_tokens or [1] * len(result.seq_ids)
        sampled: dict[str, tuple[int, int]] = {}  # seq id -> (first token, token count)
        start = 0
        for seq_id, count in zip(result.seq_ids, counts, strict=True):
            sampled[seq_id] = (start, count)
            start += count
        updates = []
        any_finished = False
        for seq, n in plan:
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted, finished or preempted (and not re-admitted) while the step ran
            num_spec, seq.num_spec_tokens, seq.spec_token_ids = seq.num_spec_tokens, 0, []
            seq.num_computed_tokens += n - num_spec
            seq.num_ahead -= n
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk short of the end samples nothing
            seq.num_placeholders -= 1
            at = sampled.get(seq.seq_id)
            if at is None:
                raise RuntimeError(f"worker sampled no token for {seq.seq_id} in step {batch.step_id}")
            first, count = at
            if not 1 <= count <= num_spec + 1:
                raise RuntimeError(f"worker returned {count} tokens for {seq.seq_id} with {num_spec} drafts")
            tokens = result.token_ids[first : first + count]
            lps: list[TokenLogprobs | None] = [None] * count
            if result.logprobs:
                lps = result.logprobs[first : first + count]
            if num_spec:
                self._count_spec(num_spec, count - 1)
            updates.append(self._append_tokens(seq, tokens, lps))
            if num_spec and updates[-1].finish_reason is None:
                self._settle_drafts(seq, num_spec, count - 1)
            any_finished |= updates[-1].finish_reason is not None
        if any_finished:
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        return updates

    def _count_spec(self, num_spec: int, accepted: int) -> None:
        self._spec_num_drafts += 1
        self._spec_num_draft_tokens += num_spec
        self._spec_num_accepted += accepted
        for j in range(num_spec):
            self._spec_drafted[j] += 1
        for j in range(accepted):
            self._spec_accepted[j] += 1

    def _settle_drafts(self, seq: Sequence, num_spec: int, accepted: int) -> None:
        """After a verification: free the blocks only rejected drafts reached and register the
        blocks accepted tokens filled. A draft model's cache lacks the last draft's KV when all
        were accepted (it never ran that position), so that token waits one step to be shared."""
        bs = self.block_size
        keep = -(-seq.num_computed_tokens // bs)
        if len(seq.blocks) > keep:
            self.block_pool.free(reversed(seq.blocks[keep:]))
            del seq.blocks[keep:]
            seq.num_sent_blocks = min(seq.num_sent_blocks, keep)
        lag = int(self.spec is not None and self.spec.method == "draft_model" and accepted == num_spec)
        self._register_full(seq, (seq.num_computed_tokens - lag) // bs)

    def _append_tokens(self, seq: Sequence, tokens: list[int], lps: list[TokenLogprobs | None]) -> SeqUpdate:
        """Append a step's tokens (accepted drafts, then the sampled one) up to the first that
        finishes seq; the KV of every one but the last is computed already."""
        reason, stop_token_id = None, None
        kept = 0
        for token in tokens:
            if kept:
                seq.num_computed_tokens += 1
            seq.token_ids.append(token)
            kept += 1
            reason, stop_token_id = self._check_stop(seq, token)
            if reason is not None:
                break
        if reason is not None:
            self._release(seq)
            samples = self.requests[seq.request_id]
            samples.remove(seq)
            if not samples:
                del self.requests[seq.request_id]
        return SeqUpdate(
            request_id=seq.request_id,
            sample_index=seq.sample_index,
            new_token_ids=tokens[:kept],
            finish_reason=reason,
            stop_token_id=stop_token_id,
            logprobs=[lp for lp in lps[:kept] if lp is not None],
            num_prompt_tokens=seq.prompt_len,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )

    def _check_stop(self, seq: Sequence, token: int) -> tuple[FinishReason | None, int | None]:
        p = seq.params
        if seq.num_generated >= p.min_tokens:
            if token in p.stop_token_ids:
                return FinishReason.STOP, token
            if token == self.eos_token_id and not p.ignore_eos:
                return FinishReason.STOP, None
        if seq.num_generated >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _release(self, seq: Sequence) -> None:
        """Finish or abort: free blocks tail first (they keep their hashes until evicted)."""
        self.block_pool.free(reversed(seq.blocks))
        seq.blocks = []
        if seq.known_to_worker:
            self._dropped.append(seq.seq_id)
            seq.known_to_worker = False
        seq.status = SeqStatus.FINISHED
        del self.live[seq.seq_id]

    # ------------------------------------------------------------------ introspection
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free

    def stats(self) -> SchedulerStats:
        usable, free = self.block_pool.num_usable, self.block_pool.num_free
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=(usable - free) / usable,
            num_free_blocks=free,
            num_total_blocks=usable,
            prefix_cache_queries=self._num_queried_tokens,
            prefix_cache_hits=self._num_hit_tokens,
            num_preemptions=self._num_preemptions,
            num_steps=self._num_steps,
            spec_num_drafts=self._spec_num_drafts,
            spec_num_draft_tokens=self._spec_num_draft_tokens,
            spec_num_accepted_tokens=self._spec_num_accepted,
            spec_drafted_per_position=list(self._spec_drafted),
            spec_accepted_per_position=list(self._spec_accepted),
        )
