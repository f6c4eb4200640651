"""The gateway's HTTP application: OpenAI routes for every model and pipeline, health and metrics.

`Gateway` is handed everything it serves with (`__main__` builds the parts); `build_app` puts its
routes, and the Batch API's, on an aiohttp application.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from goodput_gateway import batch, resume, routing
from goodput_gateway.apis import chat
from goodput_gateway.apis.messages import MessagesAPI
from goodput_gateway.apis.responses import ResponsesAPI
from goodput_gateway.apis.store import ResponseStore
from goodput_gateway.auth import ServiceKeys
from goodput_gateway.discovery import Registry, Service
from goodput_gateway.errors import APIError, invalid, model_not_found, too_many, unavailable
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.pipelines import PipelineServer
from goodput_gateway.proxy import Proxy, Upstream, parse_body, rewrite_model, served_model
from goodput_gateway.slo import own_slo_headers
from goodput_gateway.tenants import ANONYMOUS, FairGate, Lease, Meter, NoTurn, Tenant, Tenants, slo_targets

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class FairSettings:
    per_replica: int = 0  # requests in flight per ready replica before the rest wait their fair turn; 0: no cap
    queue_seconds: float = 60.0  # how long one waits for its turn; then 429


class Metered(Upstream):
    """A replica's stream whose tokens are charged to the caller's tenant as they pass."""

    def __init__(self, upstream: Upstream, meter: Meter) -> None:
        super().__init__(upstream.response, upstream.first, upstream.replica)
        self.upstream, self.meter = upstream, meter

    async def iter_any(self) -> AsyncGenerator[bytes, None]:
        chunks = self.upstream.iter_any()
        try:
            async for chunk in chunks:
                self.meter.feed(chunk)
                yield chunk
        finally:
            await chunks.aclose()


class Gateway:
    def __init__(
        self,
        registry: Registry,
        proxy: Proxy,
        metrics: GatewayMetrics,
        pipelines: PipelineServer,
        keys: ServiceKeys | None = None,
        tenants: Tenants | None = None,
        fair: FairSettings | None = None,
    ) -> None:
        self.registry, self.proxy, self.metrics, self.pipelines = registry, proxy, metrics, pipelines
        self.keys = keys or ServiceKeys(None)
        self.tenants = tenants or Tenants(None, "", metrics.registry)
        self.fair = fair or FairSettings()
        self.gates: dict[tuple[str, str], FairGate] = {}
        self.created = int(time.time())
        self.stopping = False  # after SIGTERM: health 503, every response closes its connection

    def service_for(self, model: str) -> Service:
        if not self.registry.synced:
            raise unavailable("The gateway is still reading the cluster's services; retry shortly", "starting")
        found = self.registry.resolve(model)
        if not found:
            raise model_not_found(model)
        if len(found) > 1:
            names = ", ".join(f"{s.namespace}/{s.served_name}" for s in found)
            raise invalid(
                f"The model '{model}' is served in several namespaces; name one of {names}", "model", "ambiguous_model"
            )
        svc = found[0]
        self.metrics.service_seen(svc.namespace, svc.name)
        return svc

    async def proxy_request(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        raw = await request.read()
        body = parse_body(raw)
        model = body.get("model")
        if model is None:
            raise invalid(
                "'model' is a required property: the gateway routes by it", "model", "missing_required_parameter"
            )
        if not isinstance(model, str):
            raise invalid("'model' must be a string", "model", "invalid_type")
        tenant = await self.tenants.identify(request.headers.get("Authorization"))
        if (pipeline := self.pipelines.find(model)) is not None:
            lease = self.tenants.admit(tenant) if tenant is not None else None
            status = 500
            try:
                response = await self.pipelines.serve(request, pipeline, body, own_slo_headers(request.headers, tenant))
                status = response.status
                return response
            finally:
                if lease is not None:
                    lease.release(status)
        svc = self.service_for(model)
        upstream_auth = await self.keys.upstream_authorization(svc, request.headers.get("Authorization"))
        targets = slo_targets(request.headers, tenant, svc.ttft_slo, svc.tpot_slo)
        own_slo = own_slo_headers(request.headers, tenant)  # the runtime's admission judges it by them
        lease = self.tenants.admit(tenant, len(routing.prompt_text(body)) // 4) if tenant is not None else None
        meter = None
        if lease is not None or targets != (None, None):
            meter = Meter(lease, body.get("stream") is True, started)
        labels = (svc.namespace, svc.name)
        self.metrics.last_request.labels(*labels).set(time.time())
        in_flight = self.metrics.in_flight.labels(*labels)
        in_flight.inc()
        status = 500
        try:
            async with self.turn(svc, tenant):
                response = await self.proxy.forward(
                    request,
                    svc,
                    model,
                    rewrite_model(raw, body, served_model(self.registry, svc, model)),
                    body,
                    upstream_auth,
                    meter.feed if meter is not None else None,
                    own_slo,
                )
            status = response.status
            return response
        except APIError as err:
            status = err.status
            raise
        finally:
            in_flight.dec()
            self.metrics.requests.labels(*labels, str(status)).inc()
            self.metrics.duration.labels(*labels).observe(time.monotonic() - started)
            self.account(labels, status, meter, targets, lease)

    def account(
        self,
        labels: tuple[str, str],
        status: int,
        meter: Meter | None,
        targets: tuple[float | None, float | None],
        lease: Lease | None,
    ) -> None:
        """An answered request's goodput against its own targets, and its tenant's lease settled."""
        if meter is not None:
            meter.finish()
            if targets != (None, None) and 200 <= status < 300:
                good = meter.good(*targets)
                self.metrics.slo_requests.labels(*labels, "good" if good else "missed").inc()
                if good and lease is not None:
                    self.tenants.metrics.good.labels(lease.label).inc()
        if lease is not None:
            lease.release(status)

    @contextlib.asynccontextmanager
    async def turn(self, svc: Service, tenant: Tenant | None) -> AsyncIterator[None]:
        """The service's fair turn where the gateway caps what it sends each replica; at once otherwise."""
        if not self.fair.per_replica:
            yield
            return
        key = (svc.namespace, svc.name)
        gate = self.gates.setdefault(key, FairGate())
        limit = max(1, len(self.registry.ready(key))) * self.fair.per_replica
        who = tenant or Tenant(ANONYMOUS)
        try:
            async with gate.turn(who, limit, self.fair.queue_seconds) as waited:
                self.tenants.metrics.queued.labels(self.tenants.metrics.label(who.name)).observe(waited)
                yield
        except NoTurn:
            raise too_many(
                f"'{svc.served_name}' is saturated: no turn came within {self.fair.queue_seconds:g} s", 1
            ) from None

    async def owner(self, request: web.Request) -> str:
        """Whom the caller's stored objects belong to: its tenant, else (tenants off) a digest of its key."""
        tenant = await self.tenants.identify(chat.caller_authorization(request.headers))
        return f"tenant:{tenant.name}" if tenant is not None else chat.owner_of(request.headers)

    @contextlib.asynccontextmanager
    async def open_chat(
        self, request: web.Request, model: str, body: dict[str, Any], path: str = "/v1/chat/completions"
    ) -> AsyncIterator[Upstream]:
        """A streamed chat completion (or another call at `path`) for a translated API's request (Responses,
        Messages), on a replica of `model`'s service, with the service's key checked and counted as any
        request to the service."""
        if self.pipelines.find(model) is not None:
            raise invalid(
                f"The pipeline '{model}' is served on /v1/chat/completions and /v1/completions only",
                "model",
                "unsupported_model",
            )
        started = time.monotonic()
        authorization = chat.caller_authorization(request.headers)
        tenant = await self.tenants.identify(authorization)
        svc = self.service_for(model)
        upstream_auth = await self.keys.upstream_authorization(svc, authorization)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if upstream_auth or authorization:
            headers["Authorization"] = upstream_auth or authorization or ""
        for name in ("X-Goodput-Priority", "X-Request-Id"):
            if name in request.headers:
                headers[name] = request.headers[name]
        headers.update(own_slo_headers(request.headers, tenant))  # the runtime's admission judges it by them
        raw = json.dumps({**body, "model": served_model(self.registry, svc, model)}).encode()
        if path != "/v1/chat/completions":  # a helper call (a prompt's token count), not a request
            async with self.proxy.open("POST", path, headers, svc, model, raw, body) as upstream:
                yield upstream
            return
        resumable = resume.resumable(path, body)
        if resumable:  # a stream the gateway may take up on another replica
            raw = resume.with_token_ids(raw)
        targets = slo_targets(request.headers, tenant, svc.ttft_slo, svc.tpot_slo)
        lease = self.tenants.admit(tenant, len(routing.prompt_text(body)) // 4) if tenant is not None else None
        meter = Meter(lease, True, started)
        labels = (svc.namespace, svc.name)
        self.metrics.last_request.labels(*labels).set(time.time())
        in_flight = self.metrics.in_flight.labels(*labels)
        in_flight.inc()
        status = 500
        try:
            async with (
                self.turn(svc, tenant),
                self.proxy.open("POST", path, headers, svc, model, raw, body) as upstream,
            ):
                status = upstream.status
                if resumable and status == 200:
                    upstream = self.proxy.resumable(upstream, path, body, raw, svc, model, headers, None)
                yield Metered(upstream, meter)
        except APIError as err:
            status = err.status
            raise
        finally:
            in_flight.dec()
            self.metrics.requests.labels(*labels, str(status)).inc()
            self.metrics.duration.labels(*labels).observe(time.monotonic() - started)
            self.account(labels, status, meter, targets, lease)

    def card(self, svc: Service) -> dict[str, Any]:
        return {
            "id": self.registry.model_id(svc),
            "object": "model",
            "created": self.created,
            "owned_by": "goodput",
            "root": svc.served_name,
            "parent": None,
            "namespace": svc.namespace,
            "service": svc.name,
            "replicas": svc.replicas,
            "ready_replicas": len(self.registry.ready((svc.namespace, svc.name))),
        }

    async def list_models(self, request: web.Request) -> web.Response:
        """Every service the caller may use: those that ask for no key, and those whose key it sent."""
        services = sorted(self.registry.services.values(), key=lambda s: (s.served_name, s.namespace))
        authorization = request.headers.get("Authorization")
        visible = []
        for svc in services:
            try:
                if await self.keys.allowed(svc, authorization):
                    visible.append(svc)
            except APIError:
                continue  # its Secret cannot be read: nobody may use it now
        pipelines = await self.pipelines.cards(self.created, authorization)
        return web.json_response({"object": "list", "data": [*(self.card(s) for s in visible), *pipelines]})

    async def get_model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if (pipeline := self.pipelines.find(model)) is not None:
            await self.pipelines.authorize(pipeline, request.headers.get("Authorization"))
            return web.json_response(self.pipelines.card(pipeline, self.created))
        svc = self.service_for(model)
        await self.keys.upstream_authorization(svc, request.headers.get("Authorization"))
        return web.json_response(self.card(svc))

    async def health(self, request: web.Request) -> web.Response:
        if self.stopping:
            return web.json_response({"status": "stopping"}, status=503)
        synced = self.registry.synced
        return web.json_response({"status": "ready" if synced else "starting"}, status=200 if synced else 503)

    async def close_when_stopping(self, request: web.Request, response: web.StreamResponse) -> None:
        """Keep-alive clients reconnect, through the Service, to a gateway that is not stopping."""
        if self.stopping:
            response.force_close()
            response.headers["Connection"] = "close"

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as err:
        return err.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        message = "Not Found: no such route" if exc.status == 404 else exc.reason
        return APIError(exc.status, message, code=codes.get(exc.status)).response()


def build_app(gateway: Gateway, batch_settings: batch.BatchSettings | None = None) -> web.Application:
    app = web.Application(middlewares=[openai_errors], client_max_size=MAX_BODY_BYTES)
    app.on_response_prepare.append(gateway.close_when_stopping)
    app.router.add_get("/v1/models", gateway.list_models)
    app.router.add_get("/v1/models/{model:.+}", gateway.get_model)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/metrics", gateway.metrics_page)
    batch_settings = batch_settings or batch.BatchSettings()
    batch.install(app, gateway.registry, gateway.proxy, gateway.metrics.registry, batch_settings)
    store = ResponseStore(batch_settings.database)
    responses = ResponsesAPI(gateway.open_chat, store, gateway.owner)
    app.router.add_post("/v1/responses", responses.create)
    app.router.add_get("/v1/responses/{id}", responses.retrieve)
    app.router.add_delete("/v1/responses/{id}", responses.delete)
    app.router.add_post("/v1/messages", MessagesAPI(gateway.open_chat).create)

    async def store_open(app: web.Application) -> AsyncIterator[None]:
        await store.open()
        yield
        store.close()

    app.cleanup_ctx.append(store_open)
    app.router.add_post("/{path:.*}", gateway.proxy_request)
    return app
