"""Constrained decoding in the worker: one xgrammar matcher per constrained sequence, and the
allowed-token mask applied to that sequence's logits row before sampling.

The matcher lives here because this is where sampled tokens are known. It is not advanced after
sampling: at each call it catches up with the row's `output_ids` (the tokens the scheduler
accepted), so a sequence that was preempted and recomputed, or resent in full, has its matcher
rebuilt from its output instead of trusting stale state.

Grammars compile on a background thread with a cache keyed by the constraint, started when the
worker first sees the sequence (`prefetch`, at its first prefill chunk), so the compile overlaps
that step's forward pass; a distinct schema compiles once per worker. xgrammar itself (its
import and the tokenizer's vocabulary, ~4 s on a small CPU) loads on that thread the first time a
constrained request arrives; unconstrained engines never import it.

The vocabulary comes from the model itself (a GGUF's `tokenizer.ggml.tokens`, or tokenizer.json
next to an HF checkpoint or in `tokenizer`), with control tokens blanked: xgrammar then treats
them as special and never allows them inside the constrained text.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from pagebus.bus.constraints import choice_ebnf, constraint_key, json_schema_text
from pagebus.bus.messages import StructuredOutputsParams
from pagebus.workers.gguf_file import read_gguf_fields

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept per worker


def compile_grammar(compiler: xgrammar.GrammarCompiler, c: StructuredOutputsParams) -> Any:
    """The xgrammar CompiledGrammar of one constraint (raises on an invalid one)."""
    schema = json_schema_text(c)
    if schema is not None:
        # No free whitespace: small models otherwise tend to emit newlines until max_tokens.
        return compiler.compile_json_schema(schema, any_whitespace=False)
    if c.regex is not None:
        return compiler.compile_regex(c.regex)
    if c.choice is not None:
        return compiler.compile_grammar(choice_ebnf(c.choice))
    if c.grammar is not None:
        return compiler.compile_grammar(c.grammar)
    raise ValueError("structured_outputs sets no constraint")


def load_vocab(path: str) -> tuple[list[str], str]:
    """(token strings by id, xgrammar vocab type name) of a GGUF file or a tokenizer.json dir;
    control tokens are empty strings."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        meta = read_gguf_fields(path, lambda key: key.startswith("tokenizer.ggml."))
        tokens = [t.decode("utf-8", errors="replace") for t in meta.get("tokenizer.ggml.tokens", [])]
        kinds = meta.get("tokenizer.ggml.token_type")
        if kinds is not None:  # 3: control
            tokens = ["" if k == 3 else t for t, k in zip(tokens, kinds, strict=True)]
        model = meta.get("tokenizer.ggml.model", "")
        kind = {"gpt2": "BYTE_LEVEL", "llama": "BYTE_FALLBACK"}.get(model, "RAW")
        return tokens, kind
    with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    vocab: dict[str, int] = dict(spec["model"].get("vocab", {}))
    special = set()
    for t in spec.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        if t.get("special"):
            special.add(t["id"])
    tokens = [""] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        tokens[i] = "" if i in special else tok
    decoder = json.dumps(spec.get("decoder") or {})
    kind = (
        "BYTE_LEVEL" if '"ByteLevel"' in decoder else "BYTE_FALLBACK" if "ByteFallback" in decoder else "RAW"
    )
    return tokens, kind


@dataclass
class _State:
    key: bytes
    matcher: Any  # xgrammar.GrammarMatcher
    consumed: int  # output tokens the matcher has accepted
    broken: bool = False  # it refused a token: only a stop token is allowed from here


class GrammarStates:
    """Every constrained sequence's matcher, and the compile cache, of one worker."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_ids: list[int]) -> None:
        self.tokenizer_path, self.vocab_size, self.stop_ids = tokenizer_path, vocab_size, stop_ids
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Future[Any] | None = None
        self._grammars: OrderedDict[bytes, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.states: dict[str, _State] = {}
        self._bitmask: torch.Tensor | None = None

    # ------------------------------------------------------------------ compiling
    def _init_compiler(self) -> Any:
        import xgrammar as xgr

        tokens, kind = load_vocab(self.tokenizer_path)
        info = xgr.TokenizerInfo(
            tokens,
            getattr(xgr.VocabType, kind),
            vocab_size=max(self.vocab_size, len(tokens)),
            stop_token_ids=self.stop_ids,
            add_prefix_space=kind == "BYTE_FALLBACK",
        )
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def prefetch(self, c: StructuredOutputsParams) -> Future[Any]:
        """Start compiling `c` unless it is compiled or compiling; the future of its grammar."""
        key = constraint_key(c)
        with self._lock:
            fut = self._grammars.get(key)
            if fut is not None:
                self._grammars.move_to_end(key)
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
                self._compiler = self._pool.submit(self._init_compiler)
            compiler = self._compiler
            assert compiler is not None
            fut = self._pool.submit(lambda: compile_grammar(compiler.result(), c))
            self._grammars[key] = fut
            while len(self._grammars) > _CACHE_SIZE:
                self._grammars.popitem(last=False)
            return fut

    # ------------------------------------------------------------------ matchers
    def forget(self, seq_id: str) -> None:
        self.states.pop(seq_id, None)

    def _matcher(self, seq_id: str, c: StructuredOutputsParams, output_ids: list[int]) -> _State:
        """The sequence's matcher, caught up with its output (rebuilt when that is not a
        continuation of what it accepted: preemption, a resent sequence)."""
        key = constraint_key(c)
        st = self.states.get(seq_id) if seq_id else None
        if st is None or st.key != key or st.consumed > len(output_ids):
            import xgrammar as xgr

            st = _State(key, xgr.GrammarMatcher(self.prefetch(c).result()), 0)
            if seq_id:
                self.states[seq_id] = st
        for tok in output_ids[st.consumed :]:
            if not st.broken and not st.matcher.is_terminated() and not st.matcher.accept_token(tok):
                # A one-off row may be a speculative draft the grammar refuses (its own sample
                # then differs and the draft is rejected); a tracked sequence never should.
                if seq_id:
                    log.error("sequence %s: token %d breaks its grammar; ending it", seq_id, tok)
                st.broken = True
        st.consumed = len(output_ids)
        return st

    def mask(
        self, logits: torch.Tensor, rows: list[tuple[int, str, StructuredOutputsParams, list[int]]]
    ) -> None:
        """Set the disallowed logits of the given rows to -inf, in place.

        rows: (logits row, seq id ("" for a one-off matcher replayed from the output), constraint,
        output token ids)."""
        import xgrammar as xgr

        num, words = logits.shape[0], (logits.shape[1] + 31) // 32
        # One bitmask row per logits row (xgrammar indexes both with the same row numbers).
        if self._bitmask is None or self._bitmask.shape[0] < num or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(max(num, 8), words, dtype=torch.int32)
        bm = self._bitmask[:num]
        for i, seq_id, c, out in rows:
            st = self._matcher(seq_id, c, out)
            if st.broken or st.matcher.is_terminated():
                bm[i].zero_()
                for s in self.stop_ids:
                    if s < words * 32:
                        bm[i, s // 32] |= _bit(s % 32)
            else:
                st.matcher.fill_next_token_bitmask(bm, i)
        idx = [r[0] for r in rows]
        xgr.apply_token_bitmask_inplace(logits, bm.to(logits.device, non_blocking=True), indices=idx)


def _bit(i: int) -> int:
    """Bit i of an int32 word, as a signed Python int."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i
