"""The api key check both front ends share: gRPC's `authorization` metadata and HTTP's
`Authorization` header carry `Bearer <key>`.

The scheme is case-insensitive (RFC 9110: `bearer` and `BEARER` are `Bearer`); the key is
compared in constant time. This module imports nothing from meshserve.
"""

from __future__ import annotations

import hmac


def bearer_matches(header: str | None, key: str) -> bool:
    """Whether an authorization value carries `key` as a bearer token."""
    scheme, _, token = (header or "").strip().partition(" ")
    return hmac.compare_digest(token.strip().encode(), key.encode()) and scheme.lower() == "bearer"
