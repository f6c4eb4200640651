"""One request through the gateway: pick a replica, forward, stream the answer back.

The pick is the service's policy (routing.py); under ``prefix``, held-aware first where the replicas
publish what they hold (held_routing.py: the prompt's digests, asked once before the attempts). For
a disaggregated service the chosen replica decodes, and disagg.py decides whether a prefill replica
computes the prompt first (the first attempt only; a retry sends the plain request). A request waits in
the service's holding queue (holding.py) while it has no ready replica, or while its LoRA adapter is
loading on a replica and served by none (lora_holding.py).

A failure before the client got a byte (a refused connection, a connection reset before the
replica's response headers or between them and the body's first byte), or a 503 from a
replica that is loading or draining, is tried again on another replica, counted in
`goodput_gateway_retries_total{reason}`; the failed one sits out `cooldown` seconds. Once
the first byte has gone to the client the response is the client's: bytes are copied as they
come, each write waiting for the client to take the last (backpressure), and a client that
goes away closes the upstream connection, so the runtime aborts the request and frees its
KV blocks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict

from goodput_gateway import resume, routing
from goodput_gateway.disagg import TwoPhase
from goodput_gateway.discovery import Registry, Service
from goodput_gateway.errors import unavailable
from goodput_gateway.held_routing import HeldRouter
from goodput_gateway.holding import Holds
from goodput_gateway.loads import LoadScraper
from goodput_gateway.lora_holding import AdapterLoad
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.prompt_digests import PromptBlocks
from goodput_gateway.upstream import Resumed, Upstream, parse_body, rewrite_model, served_model

logger = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        hdrs.CONNECTION,
        hdrs.KEEP_ALIVE,
        hdrs.PROXY_AUTHENTICATE,
        hdrs.PROXY_AUTHORIZATION,
        hdrs.TE,
        hdrs.TRAILER,
        hdrs.TRANSFER_ENCODING,
        hdrs.UPGRADE,
        hdrs.HOST,
        hdrs.CONTENT_LENGTH,
    )
)
NOT_COPIED_BACK = HOP_BY_HOP - {hdrs.CONTENT_LENGTH.lower()} | {hdrs.SERVER.lower(), hdrs.DATE.lower()}
RETRYABLE = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionResetError)
FIRST_BYTE_LOST = (*RETRYABLE, aiohttp.ClientPayloadError)
LOST = {
    "message": "The replica serving this stream went away before it finished; the text so far is all there is",
    "type": "server_error",
    "param": None,
    "code": "upstream_lost",
}
LOST_EVENT = f"data: {json.dumps({'error': LOST})}\n\n".encode()


def lost_event(unresumable: str | None) -> bytes:
    """The error event ending a stream lost mid-way; naming the field that kept it from being resumed."""
    if unresumable is None:
        return LOST_EVENT
    message = f"{LOST['message']} (a stream with '{unresumable}' is not resumed on another replica)"
    return f"data: {json.dumps({'error': {**LOST, 'message': message}})}\n\n".encode()


@dataclass(frozen=True)
class ProxySettings:
    epsilon: float = routing.EPSILON
    attempts: int = 3
    cooldown: float = 2.0  # seconds a replica that failed before headers is passed over
    chunk_chars: int = routing.CHUNK_CHARS
    prefix_chunks: int = routing.PREFIX_CHUNKS


class Proxy:
    def __init__(
        self,
        registry: Registry,
        holds: Holds,
        scraper: LoadScraper,
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        settings: ProxySettings,
        held: HeldRouter | None = None,
    ) -> None:
        self.registry, self.holds, self.scraper, self.session = registry, holds, scraper, session
        self.metrics, self.settings = metrics, settings
        self.held = held  # routing by what each replica holds (held_routing.py); None: the ring alone
        self.disagg: TwoPhase | None = None  # disagg.py: prefill elsewhere first, where the service splits
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

    def pick(
        self,
        svc: Service,
        ready: tuple[str, ...],
        tried: set[str],
        key: int,
        adapter: str | None = None,
        blocks: PromptBlocks | None = None,
        lookup: bool = False,
    ) -> routing.Choice:
        """With `lookup`, held-aware routing by the prompt's digests `blocks` (None: none could be had)."""
        now = time.monotonic()
        usable = tuple(r for r in ready if r not in tried and self.cooling.get(r, 0.0) <= now)
        if not usable:
            usable = tuple(r for r in ready if r not in tried) or ready
        if adapter is not None:
            # replicas that list the adapter, where any does: another would answer 404 or load it first
            usable = tuple(r for r in usable if self.scraper.serving(r, adapter)) or usable
        loads = self.loads(usable)
        if tried:
            return routing.Choice(routing.least_loaded(usable, loads, self.rng), routing.RETRY)
        if adapter is not None:
            states = {r: self.scraper.lora.get(r) for r in usable}
            return routing.choose_adapter(
                svc.policy, usable, loads, key, adapter, states, epsilon=self.settings.epsilon, rng=self.rng
            )
        ring = self.ring(usable) if svc.policy == "prefix" else None
        if ring is not None and self.held is not None and lookup:
            eps = self.settings.epsilon
            choice, result = self.held.pick(svc.policy, usable, loads, key, ring, blocks, eps, self.rng)
            self.metrics.held_lookups.labels(svc.namespace, svc.name, result).inc()
            return choice
        return routing.choose(svc.policy, usable, loads, key, ring=ring, epsilon=self.settings.epsilon, rng=self.rng)

    async def forward(
        self,
        request: web.Request,
        svc: Service,
        model: str,
        raw: bytes,
        body: dict[str, Any],
        authorization: str | None = None,
        observe: Callable[[bytes], None] | None = None,
        extra_headers: Mapping[str, str] | None = None,
    ) -> web.StreamResponse:
        """`extra_headers` replace the client's of the same names (a request's own SLO targets)."""
        labels = (svc.namespace, svc.name)
        resumable = request.method == "POST" and resume.resumable(request.path, body)
        if resumable:
            raw = resume.with_token_ids(raw)
        client_headers: Mapping[str, str] = request.headers
        if extra_headers:
            merged = CIMultiDict(request.headers)
            merged.update(extra_headers)
            client_headers = merged
        async with self.open(
            request.method, request.path_qs, client_headers, svc, model, raw, body, authorization
        ) as upstream:
            if resumable and upstream.status == 200:
                upstream = self.resumable(upstream, request.path, body, raw, svc, model, client_headers, authorization)
            elif request.path in resume.PATHS and body.get("stream") is True:
                upstream.unresumable = resume.why_not(body)
            return await self.stream(request, upstream, observe, labels)

    def resumable(
        self,
        upstream: Upstream,
        path: str,
        body: Mapping[str, Any],
        raw: bytes,
        svc: Service,
        model: str,
        client_headers: Mapping[str, str],
        authorization: str | None,
    ) -> Upstream:
        """`upstream`, whose stream goes on on another replica of svc if its own goes away mid-stream."""
        labels = (svc.namespace, svc.name)

        def reopen(rest: bytes, dead: set[str]) -> contextlib.AbstractAsyncContextManager[Upstream]:
            return self.open("POST", "/v1/completions", client_headers, svc, model, rest, {}, authorization, avoid=dead)

        def resumed(seconds: float) -> None:
            self.metrics.streams_resumed.labels(*labels).inc()
            self.metrics.resume_seconds.labels(*labels).observe(seconds)

        served = json.loads(raw).get("model", model)
        state = resume.Resumption(path, body, served, reopen, FIRST_BYTE_LOST, resumed)
        state.ids_shown = resume.ids_shown(upstream.headers)
        return Resumed(upstream, state)

    @contextlib.asynccontextmanager
    async def open(
        self,
        method: str,
        path_qs: str,
        client_headers: Mapping[str, str],
        svc: Service,
        model: str,
        raw: bytes,
        body: dict[str, Any],
        authorization: str | None = None,
        avoid: set[str] | None = None,
    ) -> AsyncIterator[Upstream]:
        """One replica of `svc`'s response, its body's first bytes read (retried elsewhere as above); the
        replica counts as carrying the request until the block ends. `authorization`, when given,
        replaces the client's header: the runtime's own key. Replicas in `avoid` are tried last."""
        key = (svc.namespace, svc.name)
        adapter = self.registry.adapter_of(svc, model)
        load = AdapterLoad(self.scraper, adapter) if adapter is not None else None  # held while it loads
        prefix = 0
        if svc.policy == "prefix" or adapter is not None:
            text = routing.prompt_text(body)
            prefix = routing.prefix_key(text, self.settings.chunk_chars, self.settings.prefix_chunks)
        headers = CIMultiDict((k, v) for k, v in client_headers.items() if k.lower() not in HOP_BY_HOP)
        if authorization is not None:
            headers.popall(hdrs.AUTHORIZATION, None)
            headers[hdrs.AUTHORIZATION] = authorization
        tried: set[str] = set(avoid or ())
        failure, reason = "", ""
        path = path_qs.partition("?")[0]
        blocks: PromptBlocks | None = None
        lookup = self.held is not None and self.held.applies(svc.policy, adapter, method, path)
        if self.held is not None and lookup:
            ready = self.registry.ready(key)
            blocks = await self.held.blocks(key, path, raw, body, headers, ready, self.loads(ready))
        for attempt in range(self.settings.attempts):
            last = attempt + 1 == self.settings.attempts
            if reason:
                self.metrics.retries.labels(*key, reason).inc()
            if svc.suspended:  # held at zero until spec.suspend is cleared: nothing to wait for
                raise unavailable(
                    f"The model '{model}' is suspended (spec.suspend of InferenceService {svc.namespace}/{svc.name}); "
                    "it serves again once that is cleared",
                    "service_suspended",
                    60,
                )
            # a request failed on every replica of a watched service waits for one that has not failed it
            ready = await self.holds.ready(key, model, load, tried if self.registry.watched(key) else None)
            choice = self.pick(svc, ready, tried, prefix, adapter, blocks, lookup)
            self.metrics.decisions.labels(*key, choice.decision).inc()
            url = choice.replica
            self.outstanding[url] += 1
            try:
                sent = raw
                if self.disagg is not None and not tried and svc.disaggregation is not None:
                    sent = await self.disagg.prepare(svc, url, path, raw, body, headers, blocks)
                if self.held is not None and lookup and not tried and sent is raw:  # held_routing.py
                    sent = await self.held.with_pull(key, url, path, raw, body, blocks, ready, headers)
                response = await self.session.request(method, url + path_qs, data=sent, headers=headers)
            except RETRYABLE as err:
                self.outstanding[url] -= 1
                reason = "connect" if isinstance(err, aiohttp.ClientConnectorError) else "reset"
                failure = self.failed(key, url, tried, f"{url}: {err}")
                continue
            except BaseException:
                self.outstanding[url] -= 1
                raise
            if response.status == 503 and not last:
                response.release()
                self.outstanding[url] -= 1
                reason = "unavailable"
                failure = self.failed(key, url, tried, f"{url}: 503")
                continue
            try:
                try:
                    first = await response.content.readany()
                except FIRST_BYTE_LOST as err:
                    # headers came, then the replica went before the body's first byte: the client has
                    # seen nothing yet, so the request may still go elsewhere
                    response.close()
                    reason = "reset"
                    failure = self.failed(key, url, tried, f"{url}: lost before the first byte ({err!r})")
                    continue
                except BaseException:
                    response.close()
                    raise
                yield Upstream(response, first, url)
            finally:
                self.outstanding[url] -= 1
                response.close()  # a no-op after a full read (the connection went back to the pool)
            return
        self.metrics.refused.labels(*key, "upstream_unavailable").inc()
        raise unavailable(
            f"No replica of '{model}' answered after {self.settings.attempts} attempts ({failure})",
            "upstream_unavailable",
        )

    def failed(self, key: tuple[str, str], url: str, tried: set[str], failure: str) -> str:
        """`url` sits out the cooldown and is not tried again for this request."""
        tried.add(url)
        self.cooling[url] = time.monotonic() + self.settings.cooldown
        logger.info("A replica of %s/%s failed before the client got a byte: %s", *key, failure)
        return failure

    async def stream(
        self,
        request: web.Request,
        upstream: Upstream,
        observe: Callable[[bytes], None] | None = None,
        labels: tuple[str, str] | None = None,
    ) -> web.StreamResponse:
        """Copy the replica's response to the client; `observe` sees each chunk (a tenant's token meter). A
        server-sent event stream whose replica goes away ends with an error event (no `[DONE]`)."""
        finished = False
        try:
            response = web.StreamResponse(status=upstream.status, reason=upstream.response.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in NOT_COPIED_BACK:
                    response.headers.add(name, value)
            await response.prepare(request)
            events = upstream.headers.get(hdrs.CONTENT_TYPE, "").startswith("text/event-stream")
            pending = b""  # an event's start, held until its end comes: a lost replica never leaves half of one
            chunks = upstream.iter_any()
            try:
                async for chunk in chunks:
                    if observe is not None:
                        observe(chunk)
                    if events:
                        pending += chunk
                        cut = pending.rfind(b"\n\n")
                        end = cut + 2 if cut >= 0 else 0
                        chunk, pending = pending[:end], pending[end:]
                        if not chunk:
                            continue
                    await response.write(chunk)  # waits while the client is slow to read
                if pending:
                    await response.write(pending)
            except FIRST_BYTE_LOST as err:
                if not events:
                    raise
                if labels is not None:
                    self.metrics.streams_lost.labels(*labels).inc()
                logger.info("A replica went away mid-stream: %r", err)
                await response.write(lost_event(upstream.unresumable))
            finally:
                await chunks.aclose()  # a resumed stream's replica, if any, let go
            await response.write_eof()
            finished = True
            return response
        finally:
            if finished:
                upstream.response.release()
            else:
                upstream.response.close()  # the runtime sees the connection go and aborts the request


# the response and body helpers moved to upstream.py; importers of this module keep their names
__all__ = ["Proxy", "ProxySettings", "Resumed", "Upstream", "parse_body", "rewrite_model", "served_model"]
