"""API keys as the runtime and the gateway both read them.

A key setting (``GOODPUT_API_KEY``, a Secret's value) holds one key or several, comma-separated,
so a rotation can hold the old and the new key at once. A presented key is compared with every
key in constant time, whichever matches, so the time taken tells nothing about the keys.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

RUNTIME_VARIABLE = "GOODPUT_API_KEY"


def split_keys(values: Iterable[str]) -> tuple[str, ...]:
    """Keys from settings: comma-separated, surrounding blanks and empty entries dropped, in order."""
    return tuple(dict.fromkeys(k.strip() for v in values for k in v.split(",") if k.strip()))


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def key_matches(presented: str, keys: Iterable[str]) -> bool:
    given = presented.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode())
    return found
