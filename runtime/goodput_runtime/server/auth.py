"""API keys: every route but /health and /metrics wants ``Authorization: Bearer <key>``.

Keys come from ``--api-key`` (repeatable) or ``GOODPUT_API_KEY`` (comma-separated, so a
rotation can hold the old and the new key at once). A presented key is compared with every
configured key in constant time, and a refusal never echoes what was sent.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

from aiohttp import hdrs, web

from goodput_runtime.server.errors import APIError

API_KEY_ENV = "GOODPUT_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and Prometheus


def split_keys(values: Iterable[str]) -> tuple[str, ...]:
    """Keys from flag values or the environment variable: comma-separated, blanks dropped."""
    return tuple(dict.fromkeys(k.strip() for v in values for k in v.split(",") if k.strip()))


def presented_key(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get(hdrs.AUTHORIZATION, "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """Compares with every key, whichever matches, so the time taken tells nothing about which."""
    given = presented.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode())
    return found


def unauthorized(missing: bool) -> APIError:
    message = ("You didn't provide an API key. Send it as a bearer token: 'Authorization: Bearer <key>'"
               if missing else "Incorrect API key provided")
    return APIError(401, message, "invalid_request_error", code="invalid_api_key",
                    headers={hdrs.WWW_AUTHENTICATE: 'Bearer realm="goodput"'})


def require_api_key(keys: tuple[str, ...]) -> Any:
    """A middleware refusing requests without one of ``keys``; place it inside the error middleware."""

    @web.middleware
    async def api_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            given = presented_key(request)
            if given is None or not key_matches(given, keys):
                raise unauthorized(given is None)
        return await handler(request)

    return api_key
