"""A replica's response as the proxy hands it on (its first bytes read), and the request-body helpers the
proxy and the APIs share."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from goodput_gateway import resume
from goodput_gateway.discovery import Registry, Service
from goodput_gateway.errors import APIError


@dataclass
class Upstream:
    """A replica's response whose body's first bytes were read: a replica that fails before them is
    retried elsewhere, so whoever reads the body gets those bytes first."""

    response: aiohttp.ClientResponse
    first: bytes
    replica: str = ""  # its base URL
    unresumable: str | None = None  # a stream's field that keeps it from being resumed (resume.why_not)

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self.response.headers

    async def read(self) -> bytes:
        return self.first + await self.response.read()

    async def iter_any(self) -> AsyncGenerator[bytes, None]:
        if self.first:
            yield self.first
        async for chunk in self.response.content.iter_any():
            yield chunk


class Resumed(Upstream):
    """A streamed completion that goes on on another replica when its own goes away (resume.py)."""

    def __init__(self, upstream: Upstream, state: resume.Resumption) -> None:
        super().__init__(upstream.response, upstream.first, upstream.replica)
        self.upstream, self.state = upstream, state

    async def iter_any(self) -> AsyncGenerator[bytes, None]:
        events = self.state.run(self.upstream.iter_any(), self.replica)
        try:
            async for chunk in events:
                yield chunk
        finally:
            await events.aclose()


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise APIError(
            400,
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_type")
    return body


def served_model(registry: Registry, svc: Service, model: str) -> str:
    """`model` as svc's runtime knows it: its served name, or the LoRA adapter the request names (a
    `namespace/name` model loses its namespace)."""
    return registry.adapter_of(svc, model) or svc.served_name


def rewrite_model(raw: bytes, body: dict[str, Any], served_name: str) -> bytes:
    """The body with `model` as the runtime knows it (a `namespace/name` model loses its namespace)."""
    if body.get("model") == served_name:
        return raw
    return json.dumps({**body, "model": served_name}).encode()
