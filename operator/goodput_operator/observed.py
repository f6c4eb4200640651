"""The children and runtime pods as the watch streams last delivered them.

The operator already watches its children and pods (kopf event handlers, server-side label
selector); keeping what they deliver lets a reconcile read them without an API call. A
reconcile of an unchanged service then costs no call at all, so the periodic resync of
thousands of services does not crowd out new work.

A child the cache has not seen is read from the API server (it may predate the watch); a pod
it has not seen counts as absent (its own event triggers a reconcile when it arrives). The
services themselves are kept too, from their watch and from the answers to our own status
writes, whichever is newer: a reconcile a side trigger starts reads the service from here.
Stored objects leave out ``metadata.managedFields``, the bulk of most objects; pods keep only
what `pods.failure` reads.
"""

from __future__ import annotations

from typing import Any

Key = tuple[str, str, str]  # (kind, namespace, name)
POD_STATUS_FIELDS = ("phase", "conditions", "containerStatuses", "initContainerStatuses")


def trimmed(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    return {**obj, "metadata": meta}


def trimmed_pod(pod: dict[str, Any]) -> dict[str, Any]:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    return {
        "metadata": {k: meta[k] for k in ("name", "deletionTimestamp") if k in meta},
        "status": {k: status[k] for k in POD_STATUS_FIELDS if k in status},
    }


class Observed:
    def __init__(self) -> None:
        self._children: dict[Key, dict[str, Any]] = {}
        self._pods: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}  # (namespace, service) -> name -> pod
        # paths of unwatched optional children (HPAs, ScaledObjects) found absent or deleted; only the
        # operator creates them, and it forgets the path when it does
        self._absent: set[str] = set()

        self._services: dict[tuple[str, str], dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self._children) + sum(len(p) for p in self._pods.values()) + len(self._services)

    def service_event(self, event_type: str | None, obj: dict[str, Any]) -> None:
        """A service as its watch delivered it, or as the server answered a write (`event_type` None).
        An older copy never replaces a newer one: the watch may lag behind our own writes."""
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if event_type == "DELETED":
            self._services.pop(key, None)
            return
        held = self._services.get(key)
        if held is not None and held["metadata"].get("uid") == meta.get("uid") and version(held) > version(obj):
            return
        self._services[key] = trimmed(obj)

    def service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._services.get((namespace, name))

    def child_event(self, event_type: str | None, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (obj.get("kind", ""), meta.get("namespace", ""), meta.get("name", ""))
        if event_type == "DELETED":
            self._children.pop(key, None)
        else:
            self._children[key] = trimmed(obj)

    def remember(self, obj: dict[str, Any]) -> None:
        """An object as the API server answered a write or read of it."""
        self.child_event(None, obj)

    def forget(self, kind: str, namespace: str, name: str) -> None:
        self._children.pop((kind, namespace, name), None)

    def child(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self._children.get((kind, namespace, name))

    def children(self, kind: str, namespace: str, prefix: str) -> list[dict[str, Any]]:
        """The children of `kind` in `namespace` whose names start with `prefix` (a service's groups)."""
        return [
            obj
            for (k, ns, name), obj in self._children.items()
            if k == kind and ns == namespace and name.startswith(prefix)
        ]

    def known_absent(self, path: str) -> bool:
        return path in self._absent

    def mark_absent(self, path: str, absent: bool = True) -> None:
        if absent:
            self._absent.add(path)
        else:
            self._absent.discard(path)

    def pod_event(self, event_type: str | None, pod: dict[str, Any], service: str) -> None:
        meta = pod.get("metadata") or {}
        key, name = (meta.get("namespace", ""), service), meta.get("name", "")
        if event_type == "DELETED":
            pods = self._pods.get(key)
            if pods is not None:
                pods.pop(name, None)
                if not pods:
                    del self._pods[key]
        else:
            self._pods.setdefault(key, {})[name] = trimmed_pod(pod)

    def pods(self, namespace: str, service: str) -> list[dict[str, Any]]:
        return list((self._pods.get((namespace, service)) or {}).values())


def version(obj: dict[str, Any]) -> int:
    """resourceVersion as a number, to order two copies of one object (-1 when it is not one; opaque by
    contract, etcd's revision in every server this operator supports)."""
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or -1)
    except ValueError:
        return -1
