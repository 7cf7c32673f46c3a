"""Bearer-token check for the API key; constant-time so a timing side channel cannot leak it."""

from __future__ import annotations

import hmac


def bearer_ok(authorization: bytes | None, api_key: str) -> bool:
    """True when the `Authorization` header is exactly `Bearer <api_key>` (scheme case-insensitive)."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(token.strip(), api_key.encode())
