"""IncrementalDetokenizer: streamed text equals the full decode, never splits a character, and
never shows text that a stop string later retracts. Uses the default model's real tokenizer."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagebus.bus.messages import SamplingParams
from pagebus.frontends.detokenizer import DetokResult, IncrementalDetokenizer
from pagebus.frontends.tokenizer import Tokenizer

from tests.frontends.tokenizer_fixtures import shared_tokenizer_dir

HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# a prompt's tail, output ids, the sizes they are pushed in (cycled), skip_special_tokens
RANDOM_STREAMS = given(
    prompt=st.lists(st.integers(0, 49151), max_size=6),
    ids=st.lists(st.integers(0, 49151), max_size=40),
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    skip=st.booleans(),
)
PROMPT = [1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198]  # a chat-formatted prompt's tail


@pytest.fixture(scope="session")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(shared_tokenizer_dir(tmp_path_factory))


def stream(
    tok: Tokenizer,
    ids: Sequence[int],
    chunks: Sequence[int] = (1,),
    prompt: Sequence[int] = PROMPT,
    **params: object,
) -> tuple[IncrementalDetokenizer, list[DetokResult]]:
    """Push `ids` in chunks of the given sizes (cycled), then flush unless a stop string ended it."""
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(**params))  # type: ignore[arg-type]
    out, i, k = [], 0, 0
    while i < len(ids) and not d.finished:
        n = chunks[k % len(chunks)]
        out.append(d.push(ids[i : i + n]))
        i, k = i + n, k + 1
    out.append(d.flush())
    return d, out


def joined(results: list[DetokResult]) -> str:
    return "".join(r.text_delta for r in results)


def check_stream(tok: Tokenizer, prompt: list[int], ids: list[int], chunks: list[int], skip: bool) -> None:
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip))
    pushed: list[int] = []
    i = k = 0
    while i < len(ids):
        n = chunks[k % len(chunks)]
        pushed += ids[i : i + n]
        delta = d.push(ids[i : i + n]).text_delta
        full = tok.decode(pushed, skip)
        assert full.startswith(d.text)  # never ahead of, or different from, the full decode
        assert "\ufffd" not in delta or "\ufffd" in full
        i, k = i + n, k + 1
    d.flush()
    assert d.text == tok.decode(ids, skip)


@HYP
@RANDOM_STREAMS
def test_random_ids_equal_full_decode(
    tok: Tokenizer, prompt: list[int], ids: list[int], chunks: list[int], skip: bool
) -> None:
    check_stream(tok, prompt, ids, chunks, skip)


# Byte-level BPE splits these across tokens; mixing in ASCII and specials exercises the boundaries.
PIECES = [
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "你好",
    "世界。",
    "日本語",
    "é",
    "∑",
    " ",
    "  ",
    "\n",
    "a",
    " the",
    "<|im_end|>",
    "\ufffd",
]


@HYP
@given(
    pieces=st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=4)), max_size=12),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    skip=st.booleans(),
)
def test_encoded_unicode_streams_never_show_partial_chars(
    tok: Tokenizer, pieces: list[str], chunks: list[int], skip: bool
) -> None:
    text = "".join(pieces)
    ids = tok.encode(text, add_special_tokens=False)
    check_stream(tok, PROMPT, ids, chunks, skip)
    # Some rare characters have no byte token in this vocabulary and decode to U+FFFD anyway.
    if "\ufffd" not in tok.decode(ids, skip):
        _, results = stream(tok, ids, chunks, skip_special_tokens=skip)
        assert all("\ufffd" not in r.text_delta for r in results)


def test_emoji_waits_for_its_last_byte(tok: Tokenizer) -> None:
    ids = tok.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3  # "a" plus the emoji's bytes over several tokens
    d = IncrementalDetokenizer(tok, PROMPT, SamplingParams())
    deltas = [d.push([i]).text_delta for i in ids]
    assert deltas[0] == "a" and all(x == "" for x in deltas[1:-1]) and deltas[-1] == "😀"


def test_flush_emits_an_unfinished_character_as_the_full_decode_does(tok: Tokenizer) -> None:
    ids = tok.encode("😀", add_special_tokens=False)[:-1]
    d = IncrementalDetokenizer(tok, PROMPT, SamplingParams())
    assert d.push(ids).text_delta == ""
    assert d.flush().text_delta == tok.decode(ids) != ""


def test_prompt_ending_mid_character_is_not_fused_with_output(tok: Tokenizer) -> None:
    emoji = tok.encode("😀", add_special_tokens=False)
    d, _ = stream(tok, [emoji[-1], *tok.encode(" ok")], prompt=emoji[:-1])
    assert d.text == tok.decode([emoji[-1], *tok.encode(" ok")])


# ------------------------------------------------------------------------- stop strings
def test_stop_string_across_tokens_is_truncated(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world, how are you?")
    d, results = stream(tok, ids, stop=["o wor"])
    assert d.text == joined(results) == "Hell"
    assert [r.stop_matched for r in results if r.finished_by_stop] == ["o wor", "o wor"]  # push, then flush
    assert d.finished and results[-1] == DetokResult("", "o wor", True)


def test_stop_string_kept_when_asked(tok: Tokenizer) -> None:
    d, results = stream(
        tok, tok.encode("Hello world, how are you?"), stop=["o wor"], include_stop_str_in_output=True
    )
    assert d.text == joined(results) == "Hello wor"
    assert next(r.stop_matched for r in results if r.finished_by_stop) == "o wor"


def test_pushes_after_a_stop_add_nothing(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok, PROMPT, SamplingParams(stop=["world"]))
    assert d.push(tok.encode("Hello world")) == DetokResult("Hello ", "world", True)
    assert d.push(tok.encode(" more")) == DetokResult("", "world", True)
    assert d.flush() == DetokResult("", "world", True)
    assert d.text == "Hello "


def test_partial_stop_string_is_held_back_then_released(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok, PROMPT, SamplingParams(stop=["world peace"]))
    assert d.push(tok.encode("Hello")).text_delta == "Hello"
    assert d.push(tok.encode(" world")).text_delta == " "  # "world" may begin the stop string
    assert d.push(tok.encode(" war")).text_delta == "world war"  # it did not
    assert d.push(tok.encode(" world")).text_delta == " "
    assert d.flush() == DetokResult("world", None, False)  # finished for another reason
    assert d.text == "Hello world war world"


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world")
    assert stream(tok, ids, chunks=[len(ids)], stop=["world", "llo"])[0].text == "He"
    # Same start: the first listed wins.
    assert stream(tok, ids, chunks=[len(ids)], stop=["worl", "wo"])[1][0].stop_matched == "worl"


def test_stop_string_inside_one_token_and_in_emoji(tok: Tokenizer) -> None:
    assert stream(tok, tok.encode("Hello world"), stop=["ll"])[0].text == "He"
    d, results = stream(tok, tok.encode("I 😀 you"), stop=["😀"], include_stop_str_in_output=True)
    assert d.text == "I 😀" and all("\ufffd" not in r.text_delta for r in results)


def test_special_tokens_are_searched_only_when_shown(tok: Tokenizer) -> None:
    ids = tok.encode("a<|im_end|>b")
    assert stream(tok, ids, stop=["<|im_end|>"], skip_special_tokens=False)[0].text == "a"
    assert stream(tok, ids, stop=["<|im_end|>"], skip_special_tokens=True)[0].text == "ab"


@HYP
@given(
    text=st.text(alphabet="ab 😀再", max_size=16),
    stops=st.lists(st.text(alphabet="ab 😀再", min_size=1, max_size=3), min_size=1, max_size=3),
    chunks=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_stop_strings_random(
    tok: Tokenizer, text: str, stops: list[str], chunks: list[int], include: bool
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    d, results = stream(tok, ids, chunks, stop=stops, include_stop_str_in_output=include)
    out = d.text
    assert joined(results) == out  # deltas are append-only: nothing shown is ever retracted
    stopped = [r.stop_matched for r in results if r.finished_by_stop]
    if not stopped:
        assert out == text and not any(s in text for s in stops)
        return
    stop = stopped[0]
    assert stop in stops and d.finished
    body = out[: len(out) - len(stop)] if include else out
    assert text.startswith(body + stop)  # a genuine match, truncated at its start
    assert not include or out.endswith(stop)
    assert not any(s in body for s in stops)  # no earlier match was missed


@HYP
@RANDOM_STREAMS
def test_final_only_text_is_the_streamed_text(
    tok: Tokenizer, prompt: list[int], ids: list[int], chunks: list[int], skip: bool
) -> None:
    """A final_only sample without stop strings shows nothing until flush, then the text the
    streamed deltas join to."""
    streamed, parts = stream(tok, ids, chunks, prompt, skip_special_tokens=skip)
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip), final_only=True)
    i = k = 0
    while i < len(ids):
        n = chunks[k % len(chunks)]
        assert d.push(ids[i : i + n]) == DetokResult("", None, False)
        i, k = i + n, k + 1
    assert d.text == ""
    last = d.flush()
    assert last.text_delta == joined(parts) == streamed.text == d.text


def test_final_only_with_stop_strings_still_streams(tok: Tokenizer) -> None:
    """Stop strings need the text as it grows: final_only changes nothing there."""
    ids = tok.encode("Hello there. General Kenobi!", add_special_tokens=False)
    params = SamplingParams(stop=["General"])
    d = IncrementalDetokenizer(tok, PROMPT, params, final_only=True)
    texts = [d.push([t]).text_delta for t in ids if not d.finished]
    assert d.finished and "".join(texts) == "Hello there. "
