"""Batched sampling over requests with different parameters, on the logits' device.

Order, as vLLM applies it: repetition / frequency / presence penalties -> min_tokens mask (stop
ids get -inf while fewer than min_tokens were generated) -> greedy rows take the argmax; random
rows divide by their temperature, keep only the tokens at or above a per-row cutoff logit
(top_k; top_p over the top_k-renormalised mass; min_p relative to the top token) and draw by the
exponential race: argmax of p / E with E ~ Exp(1) per token, computed as argmax(logit/T - log E).
The race needs no cumulative sum and lets every row have its own noise. Logprobs are of the raw
model distribution (vLLM's default): the chosen token's, its rank and the top N.

Noise: E is a pure function of (row key, token id), not a draw from a generator stream, so all
rows are sampled in one batched pass on any device: a 32-bit integer hash (lowbias32) of
`token_id * mul + add` in int32 arithmetic (which wraps modulo 2**32 on every torch backend),
read as u = (h + 0.5) / 2**32 in (0, 1) exactly in float64, then E = -log u. A seeded row's
(mul, add) key derives from (seed, sample index, output position), so its token depends on
nothing else in the batch and survives preemption; unseeded rows key on (engine seed, call
counter, row).

API: `Sampler(seed)(logits, rows)` takes `SampleRow`s and returns host lists; it is a thin
wrapper over `Sampler.sample(logits, SamplingTensors.build(...))`, which works on device tensors
only and returns a `SampleOutput` whose `to_host()` is the one device->host transfer. A caller
that keeps per-sequence state in tensors may fill `SamplingTensors` itself (keying unseeded rows
with `Sampler.next_call()`). On CUDA, `sample` never synchronises. On CPU, where reading a
tensor back is free, top_p searches a growing top-k instead of sorting the whole vocabulary, and
the race runs over the few ids that can win it: with the compiled CPU ops, those whose noise
bucket's bound reaches the row's best (_race_bounded), else, in rows that keep few tokens, those.
`sampling_ref.py` is the per-row spec.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from pagebus.bus.messages import SamplingParams, TokenLogprobs
from pagebus.kernels import cpu_native

if TYPE_CHECKING:
    from pagebus.workers.structured import GrammarStates

_MASK64 = (1 << 64) - 1
_SEEDED, _UNSEEDED = 0x5EED, 0xF4EE  # key domains: a seeded row never shares an unseeded key
# lowbias32 (C. Wellons' hash prospector) multipliers, as signed int32
_H1 = 0x7FEB352D
_H2 = 0x846CA68B - (1 << 32)
_TOP_P_SEARCH_FROM = 512  # CPU: first top-k width tried for top_p rows without top_k
_MAX_CANDIDATES = 1024  # CPU: rows keeping at most this many tokens draw noise for those alone
_MAX_RACE_CANDIDATES = 256  # CPU, compiled ops: ids a row's bounded race may leave (see _race_bounded)
_SYNC_FREE_DEVICES = frozenset({"cpu"})  # where sample() may read a tensor back mid-call

_ToDevice = Callable[[list[Any], torch.dtype], torch.Tensor]  # host list -> device tensor


_ARGMAX_CHUNK = 1024


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) of [rows, vocab] logits, the same ids (the first maximum of each row).

    On CPUs torch's row-wise argmax over a wide row runs ~5x slower than a max over it (2.4 ms
    against 0.3 ms for 32 x 49152, one thread), so several rows go in two passes: the max of
    every 1024-wide chunk, then the argmax of the first chunk holding the row's maximum (0.5 ms),
    where the compiled CPU ops (kernels/cpu_native.py) do not take the logits.
    """
    if logits.device.type == "cpu":
        from pagebus.kernels.cpu_native import argmax_rows

        ids = argmax_rows(logits)  # the compiled ops' one pass: ~10 us a 49,152-wide row
        if ids is not None:
            return ids
    rows, vocab = logits.shape
    n = vocab // _ARGMAX_CHUNK
    if logits.device.type != "cpu" or rows < 2 or n < 2 or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    head = logits[:, : n * _ARGMAX_CHUNK].view(rows, n, _ARGMAX_CHUNK)
    chunk = head.amax(dim=-1).argmax(dim=-1)
    ids = chunk * _ARGMAX_CHUNK + head[torch.arange(rows), chunk].argmax(dim=-1)
    if n * _ARGMAX_CHUNK < vocab:  # the tail wins only if strictly greater (ids stay the first)
        tail_max, tail_id = logits[:, n * _ARGMAX_CHUNK :].max(dim=-1)
        better = tail_max > logits.gather(1, ids.unsqueeze(1)).squeeze(1)
        ids = torch.where(better, tail_id + n * _ARGMAX_CHUNK, ids)
    return ids


@dataclass
class SampleRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    sample_index: int
    stop_ids: tuple[int, ...]  # ids masked while fewer than min_tokens were generated
    seq_id: str = ""  # keys a constrained row's grammar matcher ("": replayed from output_ids)


# ---------------------------------------------------------------------------------- noise
def _mix64(x: int) -> int:
    """splitmix64's step and finaliser."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _int32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def row_key(domain: int, a: int, b: int, c: int) -> tuple[int, int]:
    """The (mul, add) int32 key of one row's noise: mul is odd, so ids map to distinct inputs."""
    k = _mix64(_mix64(_mix64(_mix64(domain) ^ (a & _MASK64)) ^ (b & _MASK64)) ^ (c & _MASK64))
    return _int32((k >> 32) | 1), _int32(k & 0xFFFFFFFF)


def seeded_key(seed: int, sample_index: int, position: int) -> tuple[int, int]:
    return row_key(_SEEDED, seed, sample_index, position)


def unseeded_key(engine_seed: int, call: int, row: int) -> tuple[int, int]:
    return row_key(_UNSEEDED, engine_seed, call, row)


def log_exp_noise(key_mul: torch.Tensor, key_add: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log E, E ~ Exp(1), float32 [rows, n] for int32 keys [rows, 1] and int32 token ids [n] or
    [rows, n]. Each element depends only on its row's key and its token id."""
    return log_exp_of_hash(hash32(key_mul, key_add, ids))


def hash32(key_mul: torch.Tensor, key_add: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """lowbias32(id * mul + add) as int32, in wrapping int32 arithmetic (in place, one scratch
    buffer: on CPU each pass is memory-bound)."""
    z = ids * key_mul
    z += key_add
    t = torch.empty_like(z)
    for shift, mul in ((16, _H1), (15, _H2), (16, 0)):
        torch.bitwise_right_shift(z, shift, out=t)
        t &= (1 << (32 - shift)) - 1  # a logical shift: >> is arithmetic on signed ints
        z ^= t
        if mul:
            z *= mul
    return z


def log_exp_of_hash(z: torch.Tensor) -> torch.Tensor:
    """log E for E = -log u, u uniform on (0, 1) from a uniform int32 hash z."""
    # h = z + 2**31 in [0, 2**32); u = (h + 0.5) / 2**32 is exact in float64, never 0 or 1
    u = z.double()
    u += 2.0**31 + 0.5
    u *= 2.0**-32
    e = torch.empty(u.shape, dtype=torch.float32, device=u.device)
    return torch.mul(u.log_(), -1.0, out=e).log_()  # E = -log u, rounded to float32 once


# ------------------------------------------------------------------------- parameter tensors
@dataclass
class Penalties:
    """Rows with any penalty. Id tensors are padded with `vocab` (an id no logit has)."""

    rows: torch.Tensor | None  # [P] long rows of the batch; None: every row
    repetition: torch.Tensor  # [P, 1] float32
    seen_ids: torch.Tensor | None  # [P, L] long prompt + output ids; None: no repetition penalty
    frequency: torch.Tensor  # [P, 1] float32
    presence: torch.Tensor  # [P, 1] float32
    output_ids: torch.Tensor | None  # [P, Lo] long; None: no frequency / presence penalty


@dataclass
class RandomRows:
    """Rows that draw. Every tensor has one row per random row, in batch order."""

    rows: torch.Tensor | None  # [R] long rows of the batch; None: every row
    temperature: torch.Tensor  # [R, 1] float32
    key_mul: torch.Tensor  # [R, 1] int32
    key_add: torch.Tensor  # [R, 1] int32
    log_min_p: torch.Tensor | None  # [R, 1] float32, -inf without min_p; None: no row has min_p
    trunc_rows: torch.Tensor | None  # [T] long rows (of the random rows) with top_k or top_p
    top_k: torch.Tensor | None  # [T] long, vocab when off
    top_p: torch.Tensor | None  # [T] float32
    max_top_k: int  # largest top_k below vocab among trunc rows (0: none)
    any_top_p: bool
    any_full_k: bool  # a trunc row without top_k (its top_p mass spans the whole vocab)


@dataclass
class SamplingTensors:
    """Per-row parameters of one sampling call, one tensor per field on the logits' device, with
    the few host-side facts that choose which work runs (so sample() never reads the device)."""

    num_rows: int
    greedy_rows: torch.Tensor | None  # [G] long; None: every row is greedy or every row draws
    random: RandomRows | None
    penalties: Penalties | None
    min_tokens_idx: torch.Tensor | None  # flat indices row * vocab + stop id to mask
    logprob_rows: list[int]  # rows that want logprobs
    logprob_index: torch.Tensor | None  # the same rows, [L] long; None: no row wants them
    logprob_n: list[int]  # top-N per logprob row

    @staticmethod
    def build(
        rows: list[SampleRow], vocab: int, device: torch.device, engine_call: tuple[int, int]
    ) -> SamplingTensors:
        """engine_call: (engine seed, call counter), which key unseeded rows with their row index."""

        def t(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
            host = torch.tensor(values, dtype=dtype)
            if device.type != "cuda":
                return host.to(device)
            # pinned, so the copy queues behind the forward pass instead of waiting for it
            return host.pin_memory().to(device, non_blocking=True)

        n = len(rows)
        params = [r.params for r in rows]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        rand = [i for i, p in enumerate(params) if not p.greedy]
        random = _random_rows(rows, rand, n, vocab, engine_call, t) if rand else None
        pen = [i for i, p in enumerate(params) if _has_penalty(p)]
        penalties = _penalties(rows, pen, n, vocab, t) if pen else None
        mask = [
            i * vocab + s
            for i, r in enumerate(rows)
            if len(r.output_ids) < r.params.min_tokens
            for s in r.stop_ids
            if 0 <= s < vocab  # an id past the logits would land in the next row
        ]
        lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        return SamplingTensors(
            num_rows=n,
            greedy_rows=t(greedy, torch.long) if greedy and rand else None,
            random=random,
            penalties=penalties,
            min_tokens_idx=t(mask, torch.long) if mask else None,
            logprob_rows=lp,
            logprob_index=t(lp, torch.long) if lp else None,
            logprob_n=[params[i].logprobs or 0 for i in lp],
        )


def _plain_greedy(r: SampleRow) -> bool:
    p = r.params
    return p.greedy and p.logprobs is None and not _has_penalty(p) and len(r.output_ids) >= p.min_tokens


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _padded(lists: list[list[int]], pad: int) -> list[list[int]]:
    width = max(1, max(len(x) for x in lists))
    return [x + [pad] * (width - len(x)) for x in lists]


def _penalties(rows: list[SampleRow], pen: list[int], n: int, vocab: int, t: _ToDevice) -> Penalties:
    ps = [rows[i].params for i in pen]
    any_rep = any(p.repetition_penalty != 1.0 for p in ps)
    any_count = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in ps)
    seen = _padded([rows[i].prompt_ids + rows[i].output_ids for i in pen], vocab) if any_rep else None
    out = _padded([rows[i].output_ids for i in pen], vocab) if any_count else None
    return Penalties(
        rows=None if len(pen) == n else t(pen, torch.long),
        repetition=t([[p.repetition_penalty] for p in ps], torch.float32),
        seen_ids=t(seen, torch.long) if seen is not None else None,
        frequency=t([[p.frequency_penalty] for p in ps], torch.float32),
        presence=t([[p.presence_penalty] for p in ps], torch.float32),
        output_ids=t(out, torch.long) if out is not None else None,
    )


def _random_rows(
    rows: list[SampleRow],
    rand: list[int],
    n: int,
    vocab: int,
    engine_call: tuple[int, int],
    t,
) -> RandomRows:
    ps = [rows[i].params for i in rand]
    keys = [
        seeded_key(p.seed, rows[i].sample_index, len(rows[i].output_ids))
        if p.seed is not None
        else unseeded_key(*engine_call, i)
        for i, p in zip(rand, ps, strict=True)
    ]
    trunc = [j for j, p in enumerate(ps) if 0 < p.top_k < vocab or p.top_p < 1.0]
    top_k = [ps[j].top_k if 0 < ps[j].top_k < vocab else vocab for j in trunc]
    return RandomRows(
        rows=None if len(rand) == n else t(rand, torch.long),
        temperature=t([[p.temperature] for p in ps], torch.float32),
        key_mul=t([[k[0]] for k in keys], torch.int32),
        key_add=t([[k[1]] for k in keys], torch.int32),
        log_min_p=(
            t([[math.log(p.min_p) if p.min_p > 0 else -math.inf] for p in ps], torch.float32)
            if any(p.min_p > 0 for p in ps)
            else None
        ),
        trunc_rows=None if not trunc or len(trunc) == len(ps) else t(trunc, torch.long),
        top_k=t(top_k, torch.long) if trunc else None,
        top_p=t([ps[j].top_p for j in trunc], torch.float32) if trunc else None,
        max_top_k=max((k for k in top_k if k < vocab), default=0),
        any_top_p=any(ps[j].top_p < 1.0 for j in trunc),
        any_full_k=any(k == vocab for k in top_k),
    )


# --------------------------------------------------------------------------------- sampling
@dataclass
class SampleOutput:
    """Device tensors of one call; logprob fields are None when no row asked for them."""

    token_ids: torch.Tensor  # [B] long
    logprob_rows: list[int]
    logprob_n: list[int]
    chosen_logprob: torch.Tensor | None  # [L] float32
    rank: torch.Tensor | None  # [L] long
    top_logprobs: torch.Tensor | None  # [L, max N] float32
    top_ids: torch.Tensor | None  # [L, max N] long

    def to_host(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One device->host copy (ids, ranks and float32 values are exact in float64)."""
        b = self.token_ids.shape[0]
        logprobs: list[TokenLogprobs | None] = [None] * b
        if self.chosen_logprob is None or self.rank is None:
            return self.token_ids.tolist(), logprobs
        parts = [self.token_ids.double(), self.chosen_logprob.double(), self.rank.double()]
        width = 0
        if self.top_logprobs is not None and self.top_ids is not None:
            width = self.top_logprobs.shape[1]
            parts += [self.top_logprobs.double().flatten(), self.top_ids.double().flatten()]
        flat = torch.cat(parts).tolist()
        num = len(self.logprob_rows)
        tokens = [int(v) for v in flat[:b]]
        chosen, ranks = flat[b : b + num], flat[b + num : b + 2 * num]
        vals, ids = flat[b + 2 * num : b + 2 * num + num * width], flat[b + 2 * num + num * width :]
        for j, (i, top_n) in enumerate(zip(self.logprob_rows, self.logprob_n, strict=True)):
            row = slice(j * width, j * width + top_n)
            logprobs[i] = TokenLogprobs(
                token_id=tokens[i],
                logprob=chosen[j],
                rank=int(ranks[j]),
                top_token_ids=[int(v) for v in ids[row]],
                top_logprobs=vals[row],
            )
        return tokens, logprobs


class Sampler:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.calls = 0
        self._ids: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.grammars: GrammarStates | None = None  # set by the runner: structured outputs

    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRow]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [num_rows, vocab] on any device (constrained rows are masked in place).
        Returns token ids and logprobs."""
        engine_call = self.next_call()
        constrained = [
            (i, r.seq_id, c, r.output_ids)
            for i, r in enumerate(rows)
            if (c := r.params.structured_outputs) is not None
        ]
        if constrained:  # only these rows change: the others keep their exact logits
            if self.grammars is None:
                raise RuntimeError("a structured-output row reached a Sampler without grammars")
            self.grammars.mask(logits, constrained)
        if all(_plain_greedy(r) for r in rows):  # most decode steps: the argmax is all there is
            return greedy_ids(logits).tolist(), [None] * len(rows)
        st = SamplingTensors.build(rows, logits.shape[-1], logits.device, engine_call)
        return self.sample(logits, st).to_host()

    def next_call(self) -> tuple[int, int]:
        """(engine seed, call counter) for SamplingTensors.build: unseeded rows draw afresh
        every call, and the same calls repeat under the same engine seed."""
        self.calls += 1
        return self.seed, self.calls

    def sample(self, logits: torch.Tensor, st: SamplingTensors) -> SampleOutput:
        """logits [B, vocab] on any device; st built for these rows on the same device."""
        raw = logits.float()
        work = raw
        if st.penalties is not None or st.min_tokens_idx is not None:
            work = raw.clone()
            if st.penalties is not None:
                _apply_penalties(work, st.penalties)
            if st.min_tokens_idx is not None:
                work.view(-1).index_fill_(0, st.min_tokens_idx, -math.inf)
        if st.random is None:
            tokens = greedy_ids(work)
        else:
            r = st.random
            x = (work[r.rows] if r.rows is not None else work) / r.temperature
            drawn = self._draw(x, r)
            if r.rows is None:
                tokens = drawn
            else:
                tokens = torch.empty(st.num_rows, dtype=torch.long, device=work.device)
                tokens[r.rows] = drawn
                if st.greedy_rows is not None:
                    tokens[st.greedy_rows] = greedy_ids(work[st.greedy_rows])
        out = SampleOutput(tokens, st.logprob_rows, st.logprob_n, None, None, None, None)
        if st.logprob_index is not None:
            lp = torch.log_softmax(raw[st.logprob_index], dim=-1)
            chosen = lp.gather(1, tokens[st.logprob_index].unsqueeze(1))
            out.chosen_logprob = chosen.squeeze(1)
            out.rank = (lp > chosen).sum(dim=-1) + 1
            top_n = max(st.logprob_n)
            if top_n > 0:
                out.top_logprobs, out.top_ids = lp.topk(top_n, dim=-1)
        return out

    def _token_ids(self, vocab: int, device: torch.device) -> torch.Tensor:
        ids = self._ids.get((vocab, device))
        if ids is None:
            ids = self._ids[(vocab, device)] = torch.arange(vocab, dtype=torch.int32, device=device)
        return ids

    def _draw(self, x: torch.Tensor, r: RandomRows) -> torch.Tensor:
        """x: [R, vocab] penalised logits of the random rows over their temperature."""
        num = x.shape[0]
        sync_free = x.device.type in _SYNC_FREE_DEVICES
        cutoff: torch.Tensor | None = None
        if r.top_k is not None and r.top_p is not None:
            xt = x[r.trunc_rows] if r.trunc_rows is not None else x
            cut = _truncation_cutoff(xt, r, host_sync=sync_free)
            if r.trunc_rows is not None:
                cutoff = torch.full((num,), -math.inf, device=x.device).index_copy_(0, r.trunc_rows, cut)
            else:
                cutoff = cut
        if r.log_min_p is not None:
            cut = (x.amax(dim=-1, keepdim=True) + r.log_min_p).squeeze(1)
            cutoff = cut if cutoff is None else torch.maximum(cutoff, cut)
        tokens = torch.empty(num, dtype=torch.long, device=x.device)
        dense = list(range(num))
        if sync_free:
            left = _race_bounded(x, cutoff, r, tokens)
            if left is not None:
                dense = left
            elif cutoff is not None:
                dense = _race_candidates(x, cutoff, r, tokens)
        if dense:
            self._race_dense(x, cutoff, r, tokens, dense)
        return tokens

    def _race_dense(
        self,
        x: torch.Tensor,
        cutoff: torch.Tensor | None,
        r: RandomRows,
        tokens: torch.Tensor,
        rows: list[int],
    ) -> None:
        """The race over the whole vocabulary of the given rows, masked below their cutoff."""
        num, vocab = x.shape
        ids = self._token_ids(vocab, x.device)
        # CPU: a few rows at a time so the hash's intermediates stay in cache
        step = max(1, (1 << 17) // vocab) if x.device.type == "cpu" else max(1, (1 << 22) // vocab)
        every = len(rows) == num
        for a in range(0, len(rows), step):
            b = min(len(rows), a + step)
            sel: slice | torch.Tensor = (
                slice(a, b) if every else torch.tensor(rows[a:b], dtype=torch.long, device=x.device)
            )
            xs = x[sel]
            score = log_exp_noise(r.key_mul[sel], r.key_add[sel], ids)
            torch.sub(xs, score, out=score)
            if cutoff is not None:
                score.masked_fill_(xs < cutoff[sel].unsqueeze(1), -math.inf)
            tokens[sel] = score.argmax(dim=-1)


@functools.cache
def _log_e_edges() -> torch.Tensor:
    """log E at the lower edge of each 2^20-wide bucket of the noise hash h = z + 2^31 (and at
    h = 2^32 - 1): log E falls as h grows, so these bound every id's noise by its bucket."""
    h = torch.arange(4097, dtype=torch.int64) << 20
    h[-1] = (1 << 32) - 1
    return log_exp_of_hash((h - (1 << 31)).to(torch.int32))


def _race_bounded(
    x: torch.Tensor, cutoff: torch.Tensor | None, r: RandomRows, tokens: torch.Tensor
) -> list[int] | None:
    """CPU, compiled ops: each row's race over the few ids that can win it. One native pass
    hashes every id and bounds its score by its hash's bucket (_log_e_edges); the exact noise
    is then drawn for the ids whose upper bound reaches the best lower bound (a few dozen of
    49,152 at temperature 0.8), so the same id wins as over the whole row. Returns the rows
    left for the whole-row race (a NaN, too many candidates), or None without the compiled ops."""
    num = x.shape[0]
    cut = cutoff if cutoff is not None else torch.full((num,), -math.inf)
    got = cpu_native.race_candidate_ids(x, r.key_mul, r.key_add, cut, _log_e_edges(), _MAX_RACE_CANDIDATES)
    if got is None:
        return None
    ids, counts = got
    per_row = counts.tolist()
    ok = [i for i, n in enumerate(per_row) if n > 0]
    if ok:
        width = max(per_row[i] for i in ok)
        sel: slice | torch.Tensor = slice(None) if len(ok) == num else torch.tensor(ok, dtype=torch.long)
        cand = ids[sel, :width]
        score = x[sel].gather(1, cand) - log_exp_noise(r.key_mul[sel], r.key_add[sel], cand.int())
        score.masked_fill_(torch.arange(width) >= counts[sel].unsqueeze(1), -math.inf)
        tokens[sel] = cand.gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)
    return [i for i, n in enumerate(per_row) if n <= 0]


def _race_candidates(x: torch.Tensor, cutoff: torch.Tensor, r: RandomRows, tokens: torch.Tensor) -> list[int]:
    """Where reading the device is free: rows that keep at most _MAX_CANDIDATES tokens race over
    those alone (noise for a few ids instead of the vocabulary). Returns the other rows."""
    num = x.shape[0]
    kept = (x >= cutoff.unsqueeze(1)).sum(dim=-1)  # ties at the cutoff included
    counts = kept.tolist()
    sparse = [i for i, n in enumerate(counts) if 0 < n <= _MAX_CANDIDATES]
    if sparse:
        sel = torch.tensor(sparse, dtype=torch.long, device=x.device)
        width = max(counts[i] for i in sparse)
        # the kept tokens are exactly each row's first `kept` of the top `width`
        vals, ids = x[sel].topk(width, dim=-1)
        score = vals - log_exp_noise(r.key_mul[sel], r.key_add[sel], ids.int())
        rank = torch.arange(width, device=x.device)
        score.masked_fill_(rank >= kept[sel].unsqueeze(1), -math.inf)
        tokens[sel] = ids.gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)
    done = set(sparse)
    return [i for i in range(num) if i not in done]


def _apply_penalties(work: torch.Tensor, pen: Penalties) -> None:
    """In place on work [B, vocab]. Penalised ids are gathered and scattered back; a padding id
    (vocab) is clamped onto vocab - 1 and writes that token's own correct value, so duplicate
    writes always agree."""
    vocab = work.shape[1]
    sub = work[pen.rows] if pen.rows is not None else work
    if pen.seen_ids is not None:
        seen = torch.zeros(sub.shape[0], vocab + 1, dtype=torch.bool, device=work.device)
        seen.scatter_(1, pen.seen_ids, True)
        idx = pen.seen_ids.clamp(max=vocab - 1)
        vals = sub.gather(1, idx)
        r = pen.repetition
        # over prompt and output (vLLM/HF): shrink positive logits, push negative ones down
        new = torch.where(vals > 0, vals / r, vals * r)
        sub.scatter_(1, idx, torch.where(seen.gather(1, idx), new, vals))
    if pen.output_ids is not None:
        counts = torch.zeros(sub.shape[0], vocab + 1, device=work.device)
        counts.scatter_add_(1, pen.output_ids, torch.ones_like(pen.output_ids, dtype=torch.float32))
        idx = pen.output_ids.clamp(max=vocab - 1)
        c = counts.gather(1, idx)
        vals = sub.gather(1, idx)
        sub.scatter_(1, idx, vals - (pen.frequency * c + pen.presence * (c > 0)))
    if pen.rows is not None:
        work[pen.rows] = sub


def _truncation_cutoff(x: torch.Tensor, r: RandomRows, host_sync: bool) -> torch.Tensor:
    """The smallest kept logit of each row of x [T, vocab] under top_k then top_p.

    top_p keeps the sorted tokens whose mass before them (of the top_k-renormalised
    distribution) is below top_p, and always the first. Only the first K sorted values are
    needed when the boundary lies inside them; with host_sync (CPU) a top_p row without top_k
    takes them from the compiled ops (csrc top_values: a histogram of the row's mass says how
    many, a margin over it, and only those are sorted), or, without them, tries K = 512, 4096,
    ... before the full sort; on CUDA it sorts at once. Either way the check below widens K
    until the boundary lies inside.
    """
    assert r.top_k is not None and r.top_p is not None
    vocab = x.shape[1]
    k, top_p = r.top_k, r.top_p
    width = r.max_top_k
    if r.any_full_k:
        width = max(width, _TOP_P_SEARCH_FROM if host_sync else vocab)
    width = min(vocab, max(width, 1))
    full_sum: torch.Tensor | None = None
    # with the compiled ops, a top_p row's values down to its nucleus, sorted, in one go (-inf
    # padded); rows with top_k alone: torch's topk of the largest k is as quick
    native = cpu_native.top_values(x, k, top_p) if host_sync and r.any_full_k else None
    while True:
        if native is not None:
            vals, native = native, None
            width = vals.shape[1]
        else:
            vals = x.topk(width, dim=-1).values if width < vocab else x.sort(dim=-1, descending=True).values
        if not r.any_top_p:
            return vals.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
        rank = torch.arange(width, device=x.device)
        e = (vals - vals[:, :1]).exp_() * (rank < k.unsqueeze(1))
        cs = e.cumsum(dim=-1)
        total = cs.gather(1, (k - 1).clamp(max=width - 1).unsqueeze(1)).squeeze(1)
        if r.any_full_k:
            if full_sum is None:
                full_sum = (x - vals[:, :1]).exp_().sum(dim=-1)
            total = torch.where(k == vocab, full_sum, total)
        kept = (cs[:, :-1] < (top_p * total).unsqueeze(1)).sum(dim=-1) + 1
        kept = torch.minimum(kept, k)
        # without host_sync the width already covers every row: no read-back on CUDA
        if width == vocab or not host_sync or bool(((k <= width) | ((k == vocab) & (kept < width))).all()):
            return vals.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
        width = min(vocab, width * 8)
