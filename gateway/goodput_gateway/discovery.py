"""What the gateway serves: InferenceServices and their ready endpoints, kept current by watches.

Two list-then-watch loops, one per resource, each in a worker thread (the Kubernetes
client blocks): InferenceServices in every namespace, and the EndpointSlices of their
Services (the EndpointSlice controller copies the Service's labels, so the operator's
`serving.goodput.dev/service` label selects them). Events are handed to the event loop,
where `Registry` holds the picture and wakes requests waiting for a replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from goodput_contract.api.spec import SpecError, parse
from goodput_operator.k8s import ApiError, Kube, owner_collection

logger = logging.getLogger(__name__)
SERVICE_LABEL = "serving.goodput.dev/service"
WATCH_SECONDS = 55
RETRY_SECONDS = 1.0

Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class Service:
    namespace: str
    name: str
    served_name: str
    policy: str
    min_replicas: int
    replicas: int  # what the scale subresource holds (or minReplicas while unset)
    ttft_slo: float | None = None  # seconds; pipelines count goodput end to end against it
    tpot_slo: float | None = None
    api_key_secret: tuple[str, str] | None = None  # (Secret, key) of spec.auth.apiKeySecretRef


@dataclass
class Registry:
    """Services by key and by served name, and each one's ready replicas (base URLs)."""

    services: dict[Key, Service] = field(default_factory=dict)
    slices: dict[Key, tuple[Key, tuple[str, ...]]] = field(default_factory=dict)  # slice -> (service, ready URLs)
    synced: set[str] = field(default_factory=set)  # resources listed at least once
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set and replaced on every change

    _ready: dict[Key, tuple[str, ...]] | None = None  # ready URLs by service, rebuilt after a change

    def _notify(self) -> None:
        self._ready = None
        self.changed.set()
        self.changed = asyncio.Event()

    def resolve(self, model: str) -> list[Service]:
        """Services a request's model names: `servedName`, or `namespace/servedName` where one name is in
        several namespaces."""
        if "/" in model:
            namespace, _, served = model.partition("/")
            return [s for s in self.services.values() if s.namespace == namespace and s.served_name == served]
        return sorted(
            (s for s in self.services.values() if s.served_name == model), key=lambda s: (s.namespace, s.name)
        )

    def model_id(self, svc: Service) -> str:
        shared = sum(1 for s in self.services.values() if s.served_name == svc.served_name) > 1
        return f"{svc.namespace}/{svc.served_name}" if shared else svc.served_name

    def ready(self, key: Key) -> tuple[str, ...]:
        if self._ready is None:
            index: dict[Key, set[str]] = {}
            for service, urls in self.slices.values():
                index.setdefault(service, set()).update(urls)
            self._ready = {service: tuple(sorted(urls)) for service, urls in index.items()}
        return self._ready.get(key, ())

    def set_static(self, models: dict[str, tuple[str, ...]], policy: str) -> None:
        """Fixed services outside any cluster: served name -> replica URLs."""
        self.services = {
            ("static", name): Service("static", name, name, policy, len(urls), len(urls))
            for name, urls in models.items()
        }
        self.slices = {("static", name): (("static", name), urls) for name, urls in models.items()}
        self.synced.update(("services", "slices"))
        self._notify()

    # watch events

    def reset_services(self, items: list[dict[str, Any]]) -> None:
        self.services = {}
        for body in items:
            self._put_service(body)
        self.synced.add("services")
        self._notify()

    def service_event(self, kind: str, body: dict[str, Any]) -> None:
        meta = body.get("metadata") or {}
        if kind == "DELETED":
            self.services.pop((meta.get("namespace", ""), meta.get("name", "")), None)
        else:
            self._put_service(body)
        self._notify()

    def _put_service(self, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        try:
            spec = parse(meta["name"], meta["namespace"], body.get("spec") or {})
        except SpecError as err:
            logger.info("Not routing to %s/%s: %s", *key, err)
            self.services.pop(key, None)
            return
        secret = spec.auth.api_key_secret
        self.services[key] = Service(
            key[0],
            key[1],
            spec.model.served_name,
            spec.routing.policy,
            spec.autoscaling.min_replicas,
            spec.desired_replicas,
            spec.slo.ttft_seconds,
            spec.slo.tpot_seconds,
            (secret.name, secret.key) if secret else None,
        )

    def reset_slices(self, items: list[dict[str, Any]]) -> None:
        self.slices = {}
        for body in items:
            self._put_slice(body)
        self.synced.add("slices")
        self._notify()

    def slice_event(self, kind: str, body: dict[str, Any]) -> None:
        meta = body.get("metadata") or {}
        if kind == "DELETED":
            self.slices.pop((meta.get("namespace", ""), meta.get("name", "")), None)
        else:
            self._put_slice(body)
        self._notify()

    def _put_slice(self, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        service = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        if not service:
            return
        self.slices[(meta["namespace"], meta["name"])] = ((meta["namespace"], service), ready_urls(body))


def ready_urls(piece: dict[str, Any]) -> tuple[str, ...]:
    """Base URLs of an EndpointSlice's ready, not terminating endpoints, on its `http` port."""
    ports = {p.get("name"): p.get("port") for p in piece.get("ports") or ()}
    port = ports.get("http") or ports.get("metrics")
    if port is None:
        return ()
    urls = []
    for endpoint in piece.get("endpoints") or ():
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating"):
            continue
        addresses = endpoint.get("addresses") or ()
        if addresses:
            host = addresses[0]
            urls.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
    return tuple(sorted(urls))


class Watch:
    """List, then watch from the list's resourceVersion; on any failure list again. In a daemon thread."""

    def __init__(
        self,
        kube: Kube,
        path: str,
        selector: str,
        loop: asyncio.AbstractEventLoop,
        reset: Callable[[list[dict[str, Any]]], None],
        event: Callable[[str, dict[str, Any]], None],
    ) -> None:
        self.kube, self.path, self.selector, self.loop = kube, path, selector, loop
        self.reset, self.event = reset, event
        self.stopping = threading.Event()

    def start(self) -> Watch:
        threading.Thread(target=self._run, daemon=True, name=f"watch {self.path}").start()
        return self

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                query = {"labelSelector": self.selector} if self.selector else {}
                listing = self.kube._call("GET", self.path, query=query)
                self.loop.call_soon_threadsafe(self.reset, list(listing.get("items") or ()))
                self._watch(listing["metadata"]["resourceVersion"])
            except Exception as err:
                if self.stopping.is_set():
                    return
                logger.warning("Watching %s failed, listing again: %s", self.path, err)
                time.sleep(RETRY_SECONDS)

    def _watch(self, version: str) -> None:
        api = self.kube._api
        while not self.stopping.is_set():
            query = [
                ("watch", "true"),
                ("resourceVersion", version),
                ("allowWatchBookmarks", "true"),
                ("timeoutSeconds", str(WATCH_SECONDS)),
            ]
            if self.selector:
                query.append(("labelSelector", self.selector))
            request = api.param_serialize(
                "GET",
                self.path,
                query_params=query,
                header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"],
            )
            response = api.call_api(*request, _request_timeout=(10, WATCH_SECONDS + 10))
            if response.status != 200:
                raise ApiError(response.status, response.reason or "", response.read().decode(errors="replace"))
            for line in response.response:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, body = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiError(int(body.get("code") or 0), body.get("reason") or "", json.dumps(body))
                version = (body.get("metadata") or {}).get("resourceVersion") or version
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.loop.call_soon_threadsafe(self.event, kind, body)
            response.response.release_conn()


async def slice_api(kube: Kube) -> str:
    for version in ("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1"):
        if await kube.has_resource(version, "endpointslices"):
            return version
    raise ApiError(404, "NotFound", "the server serves no EndpointSlices")


async def start_watches(kube: Kube, registry: Registry) -> list[Watch]:
    loop = asyncio.get_running_loop()
    version = await slice_api(kube)
    return [
        Watch(kube, owner_collection(None), "", loop, registry.reset_services, registry.service_event).start(),
        Watch(
            kube, f"/apis/{version}/endpointslices", SERVICE_LABEL, loop, registry.reset_slices, registry.slice_event
        ).start(),
    ]
