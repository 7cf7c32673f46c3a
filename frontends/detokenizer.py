"""Incremental detokenization of one sequence, with stop strings.

Text is decoded over a short sliding window of token ids rather than all of them, which keeps each
step O(window) and lets decoders that depend on neighbouring tokens (a SentencePiece leading space)
see context. The window idea, prefix and read offsets, comes from vLLM's `detokenize_incrementally`
(itself after Hugging Face TGI); this is our own implementation.

Invariants, for byte-level BPE tokenizers:
- `text` is always a prefix of `tokenizer.decode(output_ids)` and, after `flush()` or a stop
  string, equal to it (truncated at the stop string).
- A delta never ends in the middle of a character: bytes of a character split across tokens wait
  until the character is complete (or until `flush()`, which emits what the full decode shows).
- A delta never holds text that a stop string later retracts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from pagebus.bus.messages import SamplingParams

# Prompt tokens used as left context for the first output tokens. A few are enough: no decoder
# looks further back than one token, and the window stays short.
_CONTEXT_TOKENS = 4
_REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class DetokResult(NamedTuple):
    text_delta: str  # new text a streaming client may show now
    stop_matched: str | None  # the stop string that finished the sequence, if one did
    finished_by_stop: bool


class IncrementalDetokenizer:
    """Turns token ids, pushed as they are sampled, into text deltas.

    Every pushed id becomes text: with `skip_special_tokens=False`, a final EOS shows as "<|im_end|>".
    vLLM leaves the token that finished a sequence out of its text unless
    `include_stop_str_in_output`; callers that want the same drop it before pushing.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        final_only: bool = False,
    ) -> None:
        """final_only: the caller reads only the whole text; without stop strings, which need
        the text as it grows, it is then decoded once by `flush` (every `push` delta empty): two
        decodes a token took ~75 us of a single-stream step in process, on cold caches."""
        self._tok = tokenizer
        self._skip = params.skip_special_tokens
        self._stops = [s for s in params.stop if s]
        self._defer = final_only and not self._stops
        self._include_stop = params.include_stop_str_in_output
        self._max_stop = max((len(s) for s in self._stops), default=0)
        # Left context from the prompt, unless its last character is incomplete: its bytes would
        # fuse with the first output token's, and output text would no longer equal decode(output).
        ctx = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        if ctx and tokenizer.decode(ctx, self._skip).endswith(_REPLACEMENT):
            ctx = []
        self._ids: list[int] = ctx  # context then output ids; only the tail is ever decoded
        self._prefix = 0  # window start: text of ids[_prefix:_read] was already decoded
        self._read = len(ctx)  # ids before this are decoded and in _text
        self._text = ""  # decoded output text (cut at the stop string once one matches)
        self._emitted = 0  # characters of _text handed to the client
        self._stop: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """The output text so far: every delta joined (held-back text is not in it yet)."""
        return self._text[: self._emitted]

    @property
    def finished(self) -> bool:
        return self._finished

    def push(self, new_token_ids: Sequence[int]) -> DetokResult:
        """Add sampled tokens; return the text that is now safe to show."""
        if self._finished:
            return DetokResult("", self._stop, self._stop is not None)
        self._ids.extend(new_token_ids)
        if self._defer:
            return DetokResult("", None, False)
        return self._advance(final=False)

    def flush(self) -> DetokResult:
        """The sequence ended for another reason (EOS, length, abort): release held-back text."""
        if self._finished:
            return DetokResult("", self._stop, self._stop is not None)
        result = self._advance(final=True)
        self._finished = True
        return result

    def _decode_new(self, final: bool) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        # A trailing U+FFFD is (usually) a character whose remaining bytes are in tokens still to
        # come: wait for them. A genuine U+FFFD in the output only delays its emission.
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def _advance(self, final: bool) -> DetokResult:
        # A stop string not found before must end in the new text: search from where it could start.
        start = max(0, len(self._text) - self._max_stop + 1)
        self._text += self._decode_new(final)
        if self._stops:
            match = self._find_stop(start)
            if match is not None:
                at, stop = match
                self._text = self._text[: at + len(stop) if self._include_stop else at]
                self._stop, self._finished = stop, True
                delta, self._emitted = self._text[self._emitted :], len(self._text)
                return DetokResult(delta, stop, True)
        end = len(self._text) if final else len(self._text) - self._held_back()
        delta, self._emitted = self._text[self._emitted : end], max(end, self._emitted)
        return DetokResult(delta, None, False)

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """The earliest stop string in the text (the first listed wins a tie)."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self._text.find(stop, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        text = self._text
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
