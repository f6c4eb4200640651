"""What the gateway serves: InferenceServices and their ready endpoints, kept current by watches.

Two watches (watch.py), one per resource: InferenceServices in every namespace, and the
EndpointSlices of their Services (the EndpointSlice controller copies the Service's labels,
so the operator's `serving.goodput.dev/service` label selects them). `Registry` holds both
tables and wakes requests waiting for a replica on every change.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from goodput_contract.api.disaggregation_spec import Disaggregation
from goodput_contract.api.spec import SpecError, parse
from goodput_gateway.watch import Key, Table, Watch
from goodput_operator.k8s import ApiError, Kube, owner_collection

logger = logging.getLogger(__name__)
SERVICE_LABEL = "serving.goodput.dev/service"


STATIC = "static"  # the namespace of services given on the command line (set_static)


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
    adapters: frozenset[str] = frozenset()  # LoRA adapters of spec.model.lora, served under their own names
    max_adapters: int = 0  # spec.model.lora.maxAdapters: adapter slots per replica (0: no LoRA)
    suspended: bool = False  # spec.suspend: its requests are answered 503 at once, not held
    disaggregation: Split | None = None  # spec.disaggregation: prefill on a second pool (disagg.py)

    @property
    def prefill_key(self) -> Key:
        """The prefill pool's Service: `<name>-prefill`, whose EndpointSlices list its replicas."""
        return (self.namespace, f"{self.name}-prefill")


@dataclass(frozen=True)
class Split:
    """What the gateway needs of spec.disaggregation."""

    threshold_tokens: int = 512  # uncached prompt tokens below which the decode replica prefills itself
    transport: str = "tcp"


class Registry:
    """Services by key and by served name, and each one's ready replicas (base URLs)."""

    def __init__(self) -> None:
        self.services: Table[Service] = Table(service_of, self._notify)
        self.slices: Table[tuple[Key, tuple[str, ...]]] = Table(slice_of, self._notify)  # (service, ready URLs)
        self.changed = asyncio.Event()  # set and replaced on every change
        self._ready: dict[Key, tuple[str, ...]] | None = None  # ready URLs by service, rebuilt after a change
        # LoRA adapters a service's replicas list (/v1/models) beyond its CR's: those loaded at run time
        self.learned_adapters: dict[Key, frozenset[str]] = {}

    @property
    def synced(self) -> bool:
        """Both resources listed at least once."""
        return self.services.synced and self.slices.synced

    def _notify(self) -> None:
        self._ready = None
        self.changed.set()
        self.changed = asyncio.Event()

    def resolve(self, model: str) -> list[Service]:
        """Services a request's model names: `servedName`, or `namespace/servedName` where one name is in
        several namespaces; failing those, the services one of whose LoRA adapters has that name (from
        spec.model.lora, or listed by its replicas: ``learn_adapters``)."""
        if "/" in model:
            namespace, _, served = model.partition("/")
            found = [s for s in self.services.values() if s.namespace == namespace and s.served_name == served]
            return found or [s for s in self.services.values() if s.namespace == namespace and self.serves(s, served)]
        found = [s for s in self.services.values() if s.served_name == model]
        if not found:
            found = [s for s in self.services.values() if self.serves(s, model)]
        return sorted(found, key=lambda s: (s.namespace, s.name))

    def serves(self, svc: Service, adapter: str) -> bool:
        """Whether `adapter` is one of svc's LoRA adapters (its CR's, or one its replicas listed)."""
        return adapter in svc.adapters or adapter in self.learned_adapters.get((svc.namespace, svc.name), ())

    def adapter_of(self, svc: Service, model: str) -> str | None:
        """The LoRA adapter a request for `model` on svc names; None for the base model."""
        name = model.partition("/")[2] if "/" in model else model
        return None if name == svc.served_name or not self.serves(svc, name) else name

    def learn_adapters(self, key: Key, models: list[dict[str, Any]]) -> None:
        """The adapters a replica's /v1/models lists (each card whose parent is another model of it)."""
        names = frozenset(str(m["id"]) for m in models if isinstance(m, dict) and m.get("parent") and m.get("id"))
        if names != self.learned_adapters.get(key, frozenset()):
            self.learned_adapters[key] = names
            self._notify()

    def model_id(self, svc: Service) -> str:
        shared = sum(1 for s in self.services.values() if s.served_name == svc.served_name) > 1
        return f"{svc.namespace}/{svc.served_name}" if shared else svc.served_name

    def watched(self, key: Key) -> bool:
        """Whether the service's ready replicas follow the cluster (a static service's are fixed)."""
        return key[0] != STATIC

    def ready(self, key: Key) -> tuple[str, ...]:
        if self._ready is None:
            index: dict[Key, set[str]] = {}
            for service, urls in self.slices.values():
                index.setdefault(service, set()).update(urls)
            self._ready = {service: tuple(sorted(urls)) for service, urls in index.items()}
        return self._ready.get(key, ())

    def set_static(
        self,
        models: dict[str, tuple[str, ...]],
        policy: str,
        prefill: dict[str, tuple[str, ...]] | None = None,
        split: Split | None = None,
    ) -> None:
        """Fixed services outside any cluster: served name -> replica URLs; a name in `prefill` is
        disaggregated (`split`, by default the spec's defaults), those URLs its prefill pool."""
        prefill = prefill or {}
        self.services.fill(
            {
                (STATIC, name): Service(
                    STATIC,
                    name,
                    name,
                    policy,
                    len(urls),
                    len(urls),
                    disaggregation=(split or Split()) if name in prefill else None,
                )
                for name, urls in models.items()
            }
        )
        slices = {(STATIC, name): ((STATIC, name), urls) for name, urls in models.items()}
        for name, urls in prefill.items():
            slices[(STATIC, f"{name}-prefill")] = ((STATIC, f"{name}-prefill"), urls)
        self.slices.fill(slices)


def service_of(body: dict[str, Any]) -> Service | None:
    """What the gateway routes by in an InferenceService; None where its spec does not parse."""
    meta = body["metadata"]
    try:
        spec = parse(meta["name"], meta["namespace"], body.get("spec") or {})
    except SpecError as err:
        logger.info("Not routing to %s/%s: %s", meta["namespace"], meta["name"], err)
        return None
    secret = spec.auth.api_key_secret
    lora = spec.model.lora
    return Service(
        meta["namespace"],
        meta["name"],
        spec.model.served_name,
        spec.routing.policy,
        spec.autoscaling.min_replicas,
        spec.desired_replicas,
        spec.slo.ttft_seconds,
        spec.slo.tpot_seconds,
        (secret.name, secret.key) if secret else None,
        frozenset(a.name for a in lora.adapters) if lora else frozenset(),
        lora.max_adapters if lora else 0,
        spec.suspend,
        split_of(spec.disaggregation),
    )


def split_of(disaggregation: Disaggregation | None) -> Split | None:
    """The gateway's view of a parsed spec.disaggregation (None: off)."""
    if disaggregation is None:
        return None
    return Split(disaggregation.threshold_tokens, disaggregation.transport)


def slice_of(body: dict[str, Any]) -> tuple[Key, tuple[str, ...]] | None:
    """An EndpointSlice's service and ready URLs; None for a slice of no Service."""
    meta = body["metadata"]
    service = (meta.get("labels") or {}).get("kubernetes.io/service-name")
    return ((meta["namespace"], service), ready_urls(body)) if service else None


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


async def slice_api(kube: Kube) -> str:
    for version in ("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1"):
        if await kube.has_resource(version, "endpointslices"):
            return version
    raise ApiError(404, "NotFound", "the server serves no EndpointSlices")


async def start_watches(kube: Kube, registry: Registry) -> list[Watch]:
    version = await slice_api(kube)
    return [
        Watch(kube, owner_collection(None), "", registry.services).start(),
        Watch(kube, f"/apis/{version}/endpointslices", SERVICE_LABEL, registry.slices).start(),
    ]
