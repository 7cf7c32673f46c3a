"""Several tokens in one update (speculative decoding) read exactly as one token per update."""

from __future__ import annotations

import pytest
from pagebus.bus.messages import FinishReason, SamplingParams, SeqUpdate
from pagebus.frontends.output_processor import OutputProcessor
from pagebus.frontends.tokenizer import Tokenizer

from tests.frontends.tokenizer_fixtures import shared_tokenizer_dir


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(shared_tokenizer_dir(tmp_path_factory))


def _run(
    tok: Tokenizer, ids: list[int], chunks: list[int], params: SamplingParams, last: FinishReason | None
):
    """Feed ids in updates of the given sizes (the last carrying `last`); the sample's text,
    tokens and finish, and which updates asked for an abort."""
    proc = OutputProcessor(tok)
    proc.add("r", None, tok.encode("Say:"), params)
    text, out, finish, aborts, at = "", [], None, [], 0
    for j, size in enumerate(chunks):
        update = SeqUpdate("r", 0, ids[at : at + size], last if j == len(chunks) - 1 else None)
        at += size
        deltas, to_abort = proc.process([update])
        aborts += to_abort
        for d in deltas:
            for s in d.samples:
                text += s.text_delta
                out += s.new_token_ids
                finish = s.finish_reason or finish
        if finish is not None:
            break
    return text, out, finish, bool(aborts)


@pytest.mark.parametrize("last", [None, FinishReason.LENGTH])
def test_stop_string_mid_update_cuts_tokens_as_single_updates_do(tok: Tokenizer, last) -> None:
    ids = tok.encode(" one two three STOP four five six")
    params = SamplingParams(stop=["STOP"], max_tokens=len(ids))
    one_by_one = _run(tok, ids, [1] * len(ids), params, last)
    assert one_by_one[2] is FinishReason.STOP and "STOP" not in one_by_one[0]
    for chunks in ([len(ids)], [2, len(ids) - 2], [3] * (len(ids) // 3) + [len(ids) % 3 or 3]):
        chunks = [c for c in chunks if c]
        assert _run(tok, ids, chunks, params, last) == one_by_one


def test_no_stop_string_keeps_every_token(tok: Tokenizer) -> None:
    ids = tok.encode(" one two three four")
    params = SamplingParams(max_tokens=len(ids))
    assert _run(tok, ids, [len(ids)], params, FinishReason.LENGTH) == _run(
        tok, ids, [1] * len(ids), params, FinishReason.LENGTH
    )
