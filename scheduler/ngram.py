"""The n-gram proposer (prompt lookup): drafts continue the latest earlier occurrence of the
sequence's own suffix.

It lives in the scheduler because it needs only token ids, which the scheduler holds for every
sequence, and because the scheduler must know how many drafts each sequence gets before it can
reserve their KV slots: proposing here means a sequence without a match costs nothing extra.
"""

from __future__ import annotations

from array import array


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens following the latest earlier occurrence of the longest suffix of
    `token_ids` of length max_n down to min_n; [] when none occurs."""
    num = len(token_ids)
    if k <= 0 or num < min_n + 1:
        return []
    # A byte search in C: each id is 4 bytes, so a hit counts only on a 4-byte boundary.
    hay = array("I", token_ids).tobytes()
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        pattern = hay[4 * (num - n) :]
        end = 4 * (num - 1)  # the match must end before the suffix's own last token
        while True:
            at = hay.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return token_ids[start : start + k]
            end = at + len(pattern) - 1
    return []
