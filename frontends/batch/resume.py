"""`--resume`: which input lines an existing output file already answers, and a clean place to append.

A crash can leave a partial last line; it is cut off, so the file stays valid JSONL and the line it
belonged to runs again. Answers worth retrying (5xx, engine death, cancellation) do not count as
answered: those lines run again and their new answer is appended after the old one.
"""

from __future__ import annotations

import os
from typing import Any

from pagebus.frontends.batch.formats import answered_keys

_CHUNK = 1 << 20


def load_answered(path: str) -> set[tuple[str, Any]]:
    """Keys answered in `path` (missing file: none), after truncating a partial last line."""
    if not os.path.exists(path):
        return set()
    _drop_partial_tail(path)
    keys: set[tuple[str, Any]] = set()
    with open(path, "rb") as f:
        for raw in f:  # streamed: the output may be larger than memory
            if raw.strip():
                keys.update(answered_keys(raw))
    return keys


def _drop_partial_tail(path: str) -> None:
    """Cut the file after its last newline (a line without one was never completely written)."""
    with open(path, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            start = max(0, pos - _CHUNK)
            f.seek(start)
            chunk = f.read(pos - start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                cut = start + nl + 1
                break
            pos = start
        else:
            cut = 0
        if cut != end:
            f.truncate(cut)


def count_lines(path: str) -> int:
    """Newline count of a file, read in chunks (for the progress bar's total)."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")
