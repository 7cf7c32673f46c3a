"""The batched sampler: greedy, seeded reproducibility, masks, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from pagebus.bus.messages import SamplingParams
from pagebus.workers.sampling import Sampler, SampleRow, greedy_ids

VOCAB = 64


def _row(params: SamplingParams, output: list[int] | None = None, index: int = 0) -> SampleRow:
    return SampleRow(params, prompt_ids=[1, 2, 3], output_ids=output or [], sample_index=index, stop_ids=(2,))


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_1_are_argmax() -> None:
    logits = _logits(4)
    s = Sampler(0)
    tokens, _ = s(logits, [_row(SamplingParams(temperature=0.0))] * 2 + [_row(SamplingParams(top_k=1))] * 2)
    assert tokens == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    logits = _logits(1).repeat(3, 1)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    a, _ = Sampler(0)(logits[:1], [_row(seeded)])
    b, _ = Sampler(99)(
        logits, [_row(SamplingParams(temperature=1.0)), _row(seeded), _row(SamplingParams(temperature=0.7))]
    )
    assert a[0] == b[1]
    # a different sample index of the same request draws differently over many positions
    draws = [
        Sampler(0)(logits[:1], [_row(seeded, output=[5] * k, index=i)])[0][0]
        for k in range(20)
        for i in (0, 1)
    ]
    assert draws[0::2] != draws[1::2]


def _frequencies(logits: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    s = Sampler(0)
    tokens, _ = s(logits.repeat(n, 1), [_row(params)] * n)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / n


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    freq = _frequencies(probs.log().unsqueeze(0), SamplingParams(temperature=1.0, top_p=0.8))
    assert freq[2] == 0 and freq[3] == 0  # 0.5 + 0.3 reaches 0.8: the rest is masked
    assert abs(float(freq[0]) - 0.5 / 0.8) < 0.04


def test_min_p_masks_relative_to_the_top_token() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    freq = _frequencies(probs.log().unsqueeze(0), SamplingParams(temperature=1.0, min_p=0.2))
    assert freq[3] == 0 and freq[4] == 0  # below 0.2 * 0.4
    assert abs(float(freq[2]) - 0.2 / 0.9) < 0.04


def test_top_k_keeps_k_tokens() -> None:
    freq = _frequencies(_logits(1, seed=3) / 3, SamplingParams(temperature=1.0, top_k=3))
    assert int((freq > 0).sum()) <= 3


def test_logprobs_match_log_softmax() -> None:
    logits = _logits(3)
    rows = [_row(SamplingParams(temperature=0.0, logprobs=5))] * 3
    tokens, lps = Sampler(0)(logits, rows)
    ref = torch.log_softmax(logits, -1)
    for i, lp in enumerate(lps):
        assert lp is not None and lp.token_id == tokens[i] and lp.rank == 1
        assert math.isclose(lp.logprob, float(ref[i, tokens[i]]), rel_tol=1e-5)
        assert lp.top_token_ids == ref[i].topk(5).indices.tolist()
        assert math.isclose(sum(math.exp(v) for v in ref[i].tolist()), 1.0, rel_tol=1e-4)


def test_penalties_and_min_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 5.0
    logits[0, 2] = 10.0  # the stop id
    # min_tokens masks the stop id while too few tokens were generated
    tokens, _ = Sampler(0)(logits, [_row(SamplingParams(temperature=0.0, min_tokens=2), output=[7])])
    assert tokens == [7]
    # a frequency penalty pushes a repeated token below the next one
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8] = 2.0, 1.5
    tokens, _ = Sampler(0)(logits, [_row(SamplingParams(temperature=0.0, frequency_penalty=1.0), output=[7])])
    assert tokens == [8]
    tokens, _ = Sampler(0)(
        logits, [_row(SamplingParams(temperature=0.0, repetition_penalty=2.0), output=[7])]
    )
    assert tokens == [8]


@pytest.mark.parametrize("vocab", [1000, 2048, 5000, 49152, 128256])
@pytest.mark.parametrize("rows", [1, 2, 33])
@pytest.mark.parametrize("compiled", ["1", "0"])  # the compiled ops' argmax, and torch's chunks
def test_greedy_ids_is_argmax_first_maximum_included(
    vocab: int, rows: int, compiled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEBUS_CPU_KERNELS", compiled)

    g = torch.Generator().manual_seed(vocab + rows)
    x = torch.randn(rows, vocab, generator=g)
    assert torch.equal(greedy_ids(x), x.argmax(-1))
    # ties: across chunks, inside one, and between the chunks and the tail: the first wins
    x = torch.zeros(rows, vocab)
    for i in range(rows):
        for j in sorted({(7 * i) % vocab, (7 * i + 1500) % vocab, vocab - 1 - i % 3}):
            x[i, j] = 1.0
    assert torch.equal(greedy_ids(x), x.argmax(-1))
