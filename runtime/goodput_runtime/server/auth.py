"""API keys: every route but /health and /metrics wants ``Authorization: Bearer <key>``.

Keys come from ``--api-key`` (repeatable) or ``GOODPUT_API_KEY`` (comma-separated), read and
compared as goodput_contract.api_keys says (constant time); a refusal never echoes what was sent.
"""

from __future__ import annotations

from typing import Any

from aiohttp import hdrs, web

from goodput_contract.api_keys import RUNTIME_VARIABLE as API_KEY_ENV
from goodput_contract.api_keys import bearer_token, key_matches, split_keys
from goodput_runtime.server.errors import APIError

__all__ = ["API_KEY_ENV", "key_matches", "require_api_key", "split_keys", "unauthorized"]
OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and Prometheus


def unauthorized(missing: bool) -> APIError:
    message = (
        "You didn't provide an API key. Send it as a bearer token: 'Authorization: Bearer <key>'"
        if missing
        else "Incorrect API key provided"
    )
    return APIError(
        401,
        message,
        "invalid_request_error",
        code="invalid_api_key",
        headers={hdrs.WWW_AUTHENTICATE: 'Bearer realm="goodput"'},
    )


def require_api_key(keys: tuple[str, ...]) -> Any:
    """A middleware refusing requests without one of ``keys``; place it inside the error middleware."""

    @web.middleware
    async def api_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            given = bearer_token(request.headers.get(hdrs.AUTHORIZATION))
            if given is None or not key_matches(given, keys):
                raise unauthorized(given is None)
        return await handler(request)

    return api_key
