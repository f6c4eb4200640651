"""spec.model.nodeCache checked against the ModelCache it names, before any pod is made.

A service's pods read the model from the local volumes the caching agent publishes for a ModelCache
(runtime_pod.node_cache_claim). Naming a ModelCache that does not exist, or one holding another
repository or revision, would leave every pod Pending (no volume ever binds) or serving other
weights: such a spec is refused instead, with the Valid condition and a Warning Event naming
spec.model.nodeCache.

The ModelCaches are watched: each one's spec is kept here, and a ModelCache created, changed or
deleted brings a pass of every service that named it (a refused service turns valid once its
ModelCache appears; handlers.py hands the watch's events here).
Before the watch has delivered a ModelCache (at start, or where the watch does
not run) it is read from the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from goodput_contract.api import GROUP, MODEL_CACHE_PLURAL, VERSION
from goodput_contract.api.model_cache_spec import parse_model_cache
from goodput_contract.api.spec import ServiceSpec, SpecError

if TYPE_CHECKING:
    from goodput_operator.k8s import Kube

FIELD = "model.nodeCache"
NOT_FOUND, INVALID, MISMATCH = "NodeCacheNotFound", "NodeCacheInvalid", "NodeCacheMismatch"
DEFAULT_REVISION = "main"  # model.revision when the service names none


def cache_path(namespace: str, name: str) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{MODEL_CACHE_PLURAL}/{name}"


class NodeCaches:
    """The ModelCaches' specs as their watch delivered them, and which services named each."""

    def __init__(self) -> None:
        self.specs: dict[tuple[str, str], dict[str, Any] | None] = {}  # None: deleted
        self.readers: dict[tuple[str, str], set[str]] = {}  # (namespace, cache) -> services naming it

    def event(self, event_type: str | None, obj: dict[str, Any]) -> list[tuple[str, str]]:
        """Keep the ModelCache's spec; return the services to pass again, (namespace, name) each."""
        meta = obj.get("metadata") or {}
        namespace, name = meta.get("namespace"), meta.get("name")
        if not namespace or not name:
            return []
        key = (namespace, name)
        spec = None if event_type == "DELETED" else dict(obj.get("spec") or {})
        if key in self.specs and self.specs[key] == spec:
            return []  # its status moved (the agents' progress): nothing a service checks
        self.specs[key] = spec
        return [(namespace, service) for service in sorted(self.readers.get(key, ()))]

    def named_by(self, namespace: str, cache: str, service: str) -> None:
        self.readers.setdefault((namespace, cache), set()).add(service)

    def forget(self, namespace: str, service: str) -> None:
        """The service names no ModelCache (any more)."""
        for (ns, _), services in self.readers.items():
            if ns == namespace:
                services.discard(service)


async def check(caches: NodeCaches, kube: Kube, svc: ServiceSpec) -> None:
    """Raise SpecError naming spec.model.nodeCache when its ModelCache is absent, invalid, or holds
    another repository, or another revision than one the service names."""
    name = svc.model.node_cache
    if name is None:
        if caches.readers:
            caches.forget(svc.namespace, svc.name)
        return
    caches.named_by(svc.namespace, name, svc.name)
    key = (svc.namespace, name)
    if key in caches.specs:
        spec = caches.specs[key]
    else:
        live = await kube.get(cache_path(svc.namespace, name))
        spec = None if live is None else dict(live.get("spec") or {})
    if spec is None:
        raise SpecError(
            FIELD,
            f"names ModelCache {name!r}, which does not exist in namespace {svc.namespace}: its pods would wait "
            "for a node's copy forever; create the ModelCache, or remove the field to download the model",
            reason=NOT_FOUND,
        )
    try:
        cache = parse_model_cache(name, spec)
    except SpecError as err:
        raise SpecError(FIELD, f"names ModelCache {name!r}, whose spec is invalid: {err}", reason=INVALID) from None
    wanted = svc.model.source.repo
    if cache.repo != wanted:
        raise SpecError(
            FIELD,
            f"names ModelCache {name!r}, which holds hf://{cache.repo}, not model.source hf://{wanted}",
            reason=MISMATCH,
        )
    if svc.model.revision != DEFAULT_REVISION and svc.model.revision != cache.revision:
        raise SpecError(
            FIELD,
            f"names ModelCache {name!r}, which holds revision {cache.revision!r}, not model.revision "
            f"{svc.model.revision!r}: the pods serve the ModelCache's files",
            reason=MISMATCH,
        )
