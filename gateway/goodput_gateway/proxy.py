"""One request through the gateway: pick a replica, forward, stream the answer back.

A failure before the replica sent response headers (refused or reset connection), or a
503 from a replica that is loading or draining, is tried again on another replica; the
failed one sits out `cooldown` seconds. Once headers arrive the response is the client's:
bytes are copied as they come, each write waiting for the client to take the last
(backpressure), and a client that goes away closes the upstream connection, so the
runtime aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict

from goodput_gateway import routing
from goodput_gateway.discovery import Registry, Service
from goodput_gateway.errors import APIError, unavailable
from goodput_gateway.holding import Holds
from goodput_gateway.loads import LoadScraper
from goodput_gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(h.lower() for h in (
    hdrs.CONNECTION, hdrs.KEEP_ALIVE, hdrs.PROXY_AUTHENTICATE, hdrs.PROXY_AUTHORIZATION, hdrs.TE, hdrs.TRAILER,
    hdrs.TRANSFER_ENCODING, hdrs.UPGRADE, hdrs.HOST, hdrs.CONTENT_LENGTH))
NOT_COPIED_BACK = HOP_BY_HOP - {hdrs.CONTENT_LENGTH.lower()} | {hdrs.SERVER.lower(), hdrs.DATE.lower()}
RETRYABLE = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
             ConnectionResetError)


@dataclass(frozen=True)
class ProxySettings:
    epsilon: float = routing.EPSILON
    attempts: int = 3
    cooldown: float = 2.0  # seconds a replica that failed before headers is passed over
    chunk_chars: int = routing.CHUNK_CHARS
    prefix_chunks: int = routing.PREFIX_CHUNKS


class Proxy:
    def __init__(self, registry: Registry, holds: Holds, scraper: LoadScraper, session: aiohttp.ClientSession,
                 metrics: GatewayMetrics, settings: ProxySettings) -> None:
        self.registry, self.holds, self.scraper, self.session = registry, holds, scraper, session
        self.metrics, self.settings = metrics, settings
        self.outstanding: Counter[str] = Counter()
        self.cooling: dict[str, float] = {}
        self.rings: dict[tuple[str, ...], routing.Ring] = {}
        self.rng = random.Random()

    def loads(self, replicas: tuple[str, ...]) -> dict[str, float]:
        return {r: self.outstanding[r] + self.scraper.extra(r) for r in replicas}

    def ring(self, replicas: tuple[str, ...]) -> routing.Ring:
        ring = self.rings.get(replicas)
        if ring is None:
            if len(self.rings) > 256:
                self.rings.clear()
            ring = self.rings[replicas] = routing.Ring(replicas)
        return ring

    def pick(self, svc: Service, ready: tuple[str, ...], tried: set[str], key: int) -> routing.Choice:
        now = time.monotonic()
        usable = tuple(r for r in ready if r not in tried and self.cooling.get(r, 0.0) <= now)
        if not usable:
            usable = tuple(r for r in ready if r not in tried) or ready
        loads = self.loads(usable)
        if tried:
            return routing.Choice(routing.least_loaded(usable, loads, self.rng), routing.RETRY)
        ring = self.ring(usable) if svc.policy == "prefix" else None
        return routing.choose(svc.policy, usable, loads, key, ring=ring, epsilon=self.settings.epsilon,
                              rng=self.rng)

    async def forward(self, request: web.Request, svc: Service, model: str, raw: bytes,
                      body: dict[str, Any], authorization: str | None = None) -> web.StreamResponse:
        """`authorization`, when given, replaces the client's header: the runtime's own key."""
        key = (svc.namespace, svc.name)
        prefix = 0
        if svc.policy == "prefix":
            text = routing.prompt_text(body)
            prefix = routing.prefix_key(text, self.settings.chunk_chars, self.settings.prefix_chunks)
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP)
        if authorization is not None:
            headers.popall(hdrs.AUTHORIZATION, None)
            headers[hdrs.AUTHORIZATION] = authorization
        tried: set[str] = set()
        failure = ""
        for _attempt in range(self.settings.attempts):
            ready = await self.holds.ready(key, model)
            choice = self.pick(svc, ready, tried, prefix)
            self.metrics.decisions.labels(*key, choice.decision).inc()
            url = choice.replica
            self.outstanding[url] += 1
            try:
                upstream = await self.session.request(request.method, url + request.path_qs, data=raw,
                                                      headers=headers)
            except RETRYABLE as err:
                self.outstanding[url] -= 1
                tried.add(url)
                self.cooling[url] = time.monotonic() + self.settings.cooldown
                failure = f"{url}: {err}"
                logger.info("Retrying a request for %s/%s elsewhere: %s", *key, failure)
                continue
            except BaseException:
                self.outstanding[url] -= 1
                raise
            if upstream.status == 503 and _attempt + 1 < self.settings.attempts:
                upstream.release()
                self.outstanding[url] -= 1
                tried.add(url)
                self.cooling[url] = time.monotonic() + self.settings.cooldown
                failure = f"{url}: 503"
                continue
            try:
                return await self.stream(request, upstream)
            finally:
                self.outstanding[url] -= 1
        raise unavailable(f"No replica of '{model}' answered after {self.settings.attempts} attempts ({failure})",
                          "upstream_unavailable")

    async def stream(self, request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        finished = False
        try:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in NOT_COPIED_BACK:
                    response.headers.add(name, value)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)  # waits while the client is slow to read
            await response.write_eof()
            finished = True
            return response
        finally:
            if finished:
                upstream.release()
            else:
                upstream.close()  # the runtime sees the connection go and aborts the request


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "We could not parse the JSON body of your request. (HINT: This likely means you "
                       "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_type")
    return body


def rewrite_model(raw: bytes, body: dict[str, Any], served_name: str) -> bytes:
    """The body with `model` as the runtime knows it (a `namespace/name` model loses its namespace)."""
    if body.get("model") == served_name:
        return raw
    return json.dumps({**body, "model": served_name}).encode()


