"""The batched sampler against its per-row spec (workers/sampling_ref.py), and its noise."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch
from pagebus.bus.messages import SamplingParams
from pagebus.workers import sampling, sampling_ref
from pagebus.workers.sampling import Sampler, SampleRow, hash32, log_exp_of_hash, seeded_key, unseeded_key

STOP = (3, 11)


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    def maybe(p: float, value: object, default: object) -> object:
        return value if rng.random() < p else default

    return SamplingParams(
        temperature=rng.choice([0.0, 0.0, 0.3, 0.7, 1.0, 1.0, 1.5]),
        top_k=rng.choice([0, -1, 0, 1, 2, 5, 40, vocab - 1, vocab, vocab + 7]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.95, 1e-6]),
        min_p=maybe(0.3, rng.choice([0.05, 0.2, 1.0]), 0.0),  # type: ignore[arg-type]
        repetition_penalty=maybe(0.3, rng.choice([0.7, 1.3, 2.0]), 1.0),  # type: ignore[arg-type]
        presence_penalty=maybe(0.3, rng.choice([-1.0, 0.5, 2.0]), 0.0),  # type: ignore[arg-type]
        frequency_penalty=maybe(0.3, rng.choice([-0.5, 0.3, 1.5]), 0.0),  # type: ignore[arg-type]
        min_tokens=maybe(0.2, rng.choice([1, 4, 50]), 0),  # type: ignore[arg-type]
        logprobs=rng.choice([None, None, 0, 5]),
        seed=maybe(0.5, rng.randrange(-(2**40), 2**63), None),  # type: ignore[arg-type]
    )


def _random_row(rng: random.Random, vocab: int) -> SampleRow:
    # few distinct ids, so prompt and output repeat tokens (and hit the logits' top)
    pool = [rng.randrange(vocab) for _ in range(6)]
    prompt = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
    output = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
    return SampleRow(_random_params(rng, vocab), prompt, output, rng.randint(0, 3), STOP)


def _reference(logits: torch.Tensor, rows: list[SampleRow], engine_seed: int, call: int) -> list[int]:
    out = []
    for i, (lg, r) in enumerate(zip(logits, rows, strict=True)):
        p = r.params
        key = (
            seeded_key(p.seed, r.sample_index, len(r.output_ids))
            if p.seed is not None
            else unseeded_key(engine_seed, call, i)
        )
        out.append(sampling_ref.sample_row(lg, r, key))
    return out


def _logits(rng: random.Random, rows: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    scale = rng.choice([0.5, 3.0, 8.0])  # flat to peaked distributions
    return torch.randn(rows, vocab, generator=g) * scale


# (top_p search width, candidate limit, bounded-race candidate limit, compiled ops) on CPU, and
# the CUDA way (no reads mid-call) on CPU. "cpu-narrow": most rows overflow the bounded race and
# take the whole-row one; "cpu-torch": the path without the compiled ops.
MODES: dict[str, tuple[int, int, int, bool] | None] = {
    "cpu": (512, 1024, 256, True),
    "cpu-narrow": (4, 8, 2, True),
    "cpu-torch": (4, 8, 256, False),
    "cuda-like": None,
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("vocab", [50, 3000])
def test_batched_equals_reference_on_a_seeded_grid(
    vocab: int, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    widths = MODES[mode]
    calls: list[str] = []
    if widths is None:
        monkeypatch.setattr(sampling, "_SYNC_FREE_DEVICES", frozenset())
    else:
        monkeypatch.setattr(sampling, "_TOP_P_SEARCH_FROM", widths[0])
        monkeypatch.setattr(sampling, "_MAX_CANDIDATES", widths[1])
        monkeypatch.setattr(sampling, "_MAX_RACE_CANDIDATES", widths[2])
        for name in ("race_candidate_ids", "top_values"):
            monkeypatch.setattr(sampling.cpu_native, name, _counted(calls, name, widths[3]))
    _check_grid(random.Random(vocab * 7 + len(mode)), vocab, torch.device("cpu"))
    if widths is not None:  # the grid reached the compiled ops (or their absence)
        assert set(calls) == {"race_candidate_ids", "top_values"}


def _counted(calls: list[str], name: str, compiled: bool) -> Callable[..., object]:
    native = getattr(sampling.cpu_native, name)

    def call(*args: object) -> object:
        calls.append(name)
        return native(*args) if compiled else None

    return call


def _compiled_race() -> bool:
    return sampling.cpu_native.available() is None


@pytest.mark.skipif(not _compiled_race(), reason="needs the compiled CPU ops")
def test_bounded_race_equals_reference_over_a_full_vocabulary() -> None:
    # the default model's vocabulary, temperature only (the whole row races), flat to peaked
    vocab, rng = 49152, random.Random(11)
    rows = [
        SampleRow(SamplingParams(temperature=t, seed=rng.randrange(2**40)), [1], [], 0, ())
        for t in [0.05, 0.3, 0.7, 0.8, 1.0, 1.0, 1.3, 2.0] * 4
    ]
    logits = torch.cat([_logits(rng, 8, vocab) for _ in range(4)])
    logits[3, 7] = logits[3].max() + 40.0  # one id far ahead: its bound alone beats the rest
    logits[5, :] = 2.5  # all tied
    for call in range(3):
        rows = [SampleRow(r.params, r.prompt_ids, [7] * call, 0, ()) for r in rows]
        assert Sampler(1)(logits, rows)[0] == _reference(logits, rows, 1, 1)


@pytest.mark.skipif(not _compiled_race(), reason="needs the compiled CPU ops")
def test_top_p_over_a_full_vocabulary_equals_reference() -> None:
    # csrc top_values sorts each row down to its nucleus only; the cutoffs must be the spec's
    vocab, rng = 49152, random.Random(13)
    knobs = [
        {"top_p": 0.95},
        {"top_p": 0.9, "temperature": 1.3},
        {"top_p": 0.5},
        {"top_p": 0.999},
        {"top_p": 1e-6},
        {"top_k": 40, "top_p": 0.9},
        {"top_k": 3},
        {"top_p": 0.95, "min_p": 0.05},
    ]
    rows = [
        SampleRow(
            SamplingParams(**({"temperature": 0.8, "seed": rng.randrange(2**40)} | knob)), [1], [], 0, ()
        )  # type: ignore[arg-type]
        for knob in knobs * 3
    ]
    logits = torch.cat([_logits(rng, len(knobs), vocab) for _ in range(3)])
    logits[2, : vocab // 2] = -math.inf  # half the ids masked (a grammar, min_tokens)
    logits[9, :] = 1.0  # all tied: the nucleus is 95% of the ids
    logits[10, 5] = logits[10].max() + 30.0  # one id holds nearly all the mass
    assert Sampler(2)(logits, rows)[0] == _reference(logits, rows, 2, 1)


@pytest.mark.skipif(not _compiled_race(), reason="needs the compiled CPU ops")
def test_top_values_are_the_sorted_top_down_past_the_nucleus() -> None:
    vocab, rng = 49152, random.Random(3)
    x = torch.cat([_logits(rng, 1, vocab) for _ in range(4)]) / 0.8
    x[3, 100:] = -math.inf
    top_k = torch.tensor([vocab, vocab, 7, vocab])
    top_p = torch.tensor([0.9, 1e-6, 1.0, 0.99])
    vals = sampling.cpu_native.top_values(x, top_k, top_p)
    assert vals is not None
    ref = x.sort(dim=-1, descending=True).values
    for r in range(4):
        row = vals[r][vals[r] > -math.inf]
        assert torch.equal(row, ref[r, : row.numel()])
        if int(top_k[r]) < vocab:
            assert row.numel() == int(top_k[r])
        else:  # the top len - 1 values already hold top_p of the mass
            mass = (ref[r] - ref[r, 0]).exp()
            assert float(mass[: row.numel() - 1].sum()) >= float(top_p[r]) * float(mass.sum())
    assert vals.shape[1] < vocab // 2
    x[1, 7] = float("nan")
    assert sampling.cpu_native.top_values(x, top_k, top_p) is None
    x[1, 7] = math.inf
    assert sampling.cpu_native.top_values(x, top_k, top_p) is None


@pytest.mark.skipif(not _compiled_race(), reason="needs the compiled CPU ops")
def test_bounded_race_leaves_few_candidates_and_whole_rows_where_it_must() -> None:
    vocab, rng = 49152, random.Random(5)
    x = _logits(rng, 6, vocab) / 0.8
    x[4, 100] = float("nan")  # a NaN: the whole-row race (torch's argmax takes the NaN)
    x[5, :] = -math.inf  # one finite id: the only candidate
    x[5, 9] = 0.0
    keys = [seeded_key(s, 0, 0) for s in range(6)]
    mul = torch.tensor([[k[0]] for k in keys], dtype=torch.int32)
    add = torch.tensor([[k[1]] for k in keys], dtype=torch.int32)
    cut = torch.full((6,), -math.inf)
    cut[1] = float(x[1].max()) - 1.0  # a cutoff: only ids at or above it
    got = sampling.cpu_native.race_candidate_ids(x, mul, add, cut, sampling._log_e_edges(), 256)
    assert got is not None
    ids, counts = got
    n = counts.tolist()
    assert n[4] == -1 and n[5] == 1 and all(0 < c <= 64 for c in n[:4]), n
    assert bool((x[1, ids[1, : n[1]]] >= cut[1]).all())
    every_id = torch.arange(vocab, dtype=torch.int32)
    for r in [0, 1, 2, 3, 5]:  # the whole row's winner is among the candidates
        score = x[r] - sampling.log_exp_noise(mul[r : r + 1], add[r : r + 1], every_id)[0]
        score[x[r] < cut[r]] = -math.inf
        cand = ids[r, : n[r]].tolist()
        assert cand == sorted(cand) and int(score.argmax()) in cand
    rows = [SampleRow(SamplingParams(temperature=1.0, seed=s), [1], [], 0, ()) for s in range(6)]
    assert Sampler(0)(x[4:6].clone(), rows[4:6])[0] == _reference(x[4:6], rows[4:6], 0, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [50, 3000, 49152])
def test_cuda_equals_reference_on_a_seeded_grid(vocab: int) -> None:
    # CUDA's log/exp/cumsum round differently from the CPU's, so a near-tie may fall either
    # way: _check_grid allows no mismatch, which holds unless a draw lands within an ulp
    _check_grid(random.Random(vocab), vocab, torch.device("cuda"))


def _check_grid(rng: random.Random, vocab: int, device: torch.device) -> None:
    sampler = Sampler(5)
    for size in [1, 2, 3, 5, 8, 13, 21, 33]:
        for _ in range(2):
            rows = [_random_row(rng, vocab) for _ in range(size)]
            logits = _logits(rng, size, vocab)
            call = sampler.calls + 1  # the call about to be made
            tokens, lps = sampler(logits.to(device), rows)
            assert tokens == _reference(logits, rows, 5, call), (size, [r.params for r in rows])
            for lg, r, tok, lp in zip(logits, rows, tokens, lps, strict=True):
                if r.params.logprobs is None:
                    assert lp is None
                    continue
                ref = sampling_ref.token_logprobs(lg, tok, r.params.logprobs)
                assert lp is not None and (lp.token_id, lp.rank, lp.top_token_ids) == (
                    ref.token_id,
                    ref.rank,
                    ref.top_token_ids,
                )
                assert math.isclose(lp.logprob, ref.logprob, rel_tol=1e-5, abs_tol=1e-5)
                assert all(
                    math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5)
                    for a, b in zip(lp.top_logprobs, ref.top_logprobs, strict=True)
                )


def test_every_knob_alone_equals_reference() -> None:
    vocab = 200
    rng = random.Random(1)
    base = {"temperature": 0.8, "seed": 42}
    knobs = [
        {"temperature": 0.0},
        {},
        {"top_k": 1},
        {"top_k": 7},
        {"top_k": vocab * 3},
        {"top_p": 1e-9},
        {"top_p": 0.6},
        {"top_k": 20, "top_p": 0.5},
        {"min_p": 0.1},
        {"min_p": 1.0},
        {"top_k": 10, "top_p": 0.9, "min_p": 0.3},
        {"repetition_penalty": 1.8},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.7},
        {"repetition_penalty": 0.5, "presence_penalty": -1.0, "frequency_penalty": 2.0},
        {"min_tokens": 5},
        {"temperature": 0.0, "min_tokens": 5, "repetition_penalty": 1.5},
    ]
    for knob in knobs:
        params = SamplingParams(**(base | knob))  # type: ignore[arg-type]
        rows = [
            SampleRow(params, [1, 2, 2, 9], [out] * n + [3], idx, STOP)
            for out, n, idx in [(9, 0, 0), (9, 3, 1), (4, 2, 0), (5, 1, 2)]
        ]
        logits = _logits(rng, len(rows), vocab)
        logits[:, list(STOP)] += 6.0  # the stop ids lead, so min_tokens matters
        logits[:, 9] += 4.0  # a repeated token near the top, so penalties matter
        tokens, _ = Sampler(0)(logits, rows)
        assert tokens == _reference(logits, rows, 0, 1), knob


def test_seeded_row_is_the_same_alone_and_in_any_batch() -> None:
    vocab = 1000
    rng = random.Random(7)
    logits = _logits(rng, 40, vocab)
    rows = [_random_row(rng, vocab) for _ in range(40)]
    seeded = [i for i, r in enumerate(rows) if r.params.seed is not None and not r.params.greedy]
    assert len(seeded) >= 5
    alone = {i: Sampler(0)(logits[i : i + 1], [rows[i]])[0][0] for i in seeded}
    for trial in range(4):
        pick = sorted(rng.sample(range(40), rng.randint(len(seeded), 40)) + seeded)
        pick = sorted(set(pick))
        rng.shuffle(pick)
        tokens, _ = Sampler(trial)(logits[pick], [rows[i] for i in pick])
        for pos, i in enumerate(pick):
            if i in alone:
                assert tokens[pos] == alone[i], (trial, i)


def test_unseeded_rows_draw_afresh_each_call_and_repeat_with_the_engine_seed() -> None:
    logits = torch.zeros(4, 1000)  # uniform: every draw is the noise's argmax
    rows = [SampleRow(SamplingParams(temperature=1.0), [1], [], 0, ())] * 4
    a, b = Sampler(3), Sampler(3)
    first = [a(logits, rows)[0] for _ in range(3)]
    assert first == [b(logits, rows)[0] for _ in range(3)]
    assert first[0] != first[1] and len(set(first[0])) > 1


# ------------------------------------------------------------------------------ the noise
def _uniforms(num_keys: int, vocab: int) -> torch.Tensor:
    keys = [seeded_key(s, 0, 0) for s in range(num_keys)]
    mul = torch.tensor([[k[0]] for k in keys], dtype=torch.int32)
    add = torch.tensor([[k[1]] for k in keys], dtype=torch.int32)
    z = hash32(mul, add, torch.arange(vocab, dtype=torch.int32)).double()
    return (z + (2.0**31 + 0.5)) / 2.0**32


def test_noise_is_exponential_with_32_bit_uniforms() -> None:
    u = _uniforms(32, 65536).flatten()  # 2M draws
    n = u.numel()
    # far more distinct values than 24 bits allow (~N**2 / 2**33 collisions at 32 bits)
    assert torch.unique(u).numel() > n - 4 * n * n / 2**33
    # chi-square over 1024 equal bins: mean 1023, sd ~45
    counts = torch.bincount((u * 1024).long(), minlength=1024).double()
    chi2 = float(((counts - n / 1024) ** 2 / (n / 1024)).sum())
    assert chi2 < 1023 + 6 * math.sqrt(2 * 1023)
    # Kolmogorov-Smirnov against U(0, 1): the 0.1% critical value is 1.95 / sqrt(n)
    s = u.sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    assert float(torch.maximum(grid - s, s - (grid - 1 / n)).max()) < 1.95 / math.sqrt(n)
    exp = -u.log()
    assert abs(float(exp.mean()) - 1) < 5 / math.sqrt(n) and abs(float(exp.var()) - 1) < 20 / math.sqrt(n)
    # neighbours (next id, next key) are uncorrelated
    grid2 = u.view(32, 65536) - 0.5
    assert abs(float((grid2[:, 1:] * grid2[:, :-1]).mean()) * 12) < 0.01
    assert abs(float((grid2[1:] * grid2[:-1]).mean()) * 12) < 0.01


def test_noise_extremes_are_finite_and_positive() -> None:
    z = torch.tensor([-(2**31), -(2**31) + 1, -1, 0, 2**31 - 2, 2**31 - 1], dtype=torch.int32)
    e = log_exp_of_hash(z).double().exp()
    assert bool(torch.isfinite(e).all()) and bool((e > 0).all())
    assert float(e[0]) == pytest.approx(33 * math.log(2), rel=1e-3)  # u = 2**-33
    assert float(e[-1]) == pytest.approx(2.0**-33, rel=1e-3)  # u = 1 - 2**-33
    assert bool((e[:-1] >= e[1:]).all())  # non-increasing in the hash (float32 merges neighbours)
