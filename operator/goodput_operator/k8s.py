"""The one place that talks to the Kubernetes API.

Calls go through the official client's ApiClient (kubeconfig or in-cluster service
account) in worker threads, so the event loop never blocks. Children are written with
server-side apply under one field manager, and only when they differ from what the
server holds.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from functools import partial
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from goodput_contract.api import API_VERSION, KIND, PLURAL

API_THREADS = 16  # API calls the operator has out at once, at most
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ServiceMonitor": "servicemonitors",
    "PodMonitor": "podmonitors",
    KIND: PLURAL,
    "Secret": "secrets",
    "Pod": "pods",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ScaledObject": "scaledobjects",
    "NetworkPolicy": "networkpolicies",
    "StatefulSet": "statefulsets",
    "LeaderWorkerSet": "leaderworkersets",
}


class ApiError(Exception):
    def __init__(self, status: int, reason: str, body: str = "") -> None:
        try:
            message = json.loads(body).get("message") or body
        except ValueError:
            message = body
        super().__init__(f"{status} {reason}: {message[:1000]}")
        self.status = status
        self.message = message

    @property
    def namespace_going(self) -> bool:
        """The namespace is being deleted: nothing may be created there, and nothing needs to be."""
        terminating = self.status == 403 and "is being terminated" in self.message
        return terminating or (self.status == 404 and self.message.startswith('namespaces "'))


def load_config() -> kubernetes.client.ApiClient:
    """An ApiClient for the in-cluster service account, else the current kubeconfig."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    config = kubernetes.client.Configuration.get_default_copy()
    config.connection_pool_maxsize = API_THREADS  # a kept connection for each thread that may call at once
    api = kubernetes.client.ApiClient(config)
    api.user_agent = "goodput-operator"
    return api


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{PLURALS[kind]}" if namespace else f"{base}/{PLURALS[kind]}"
    return f"{path}/{name}" if name else path


def owner_path(namespace: str, name: str) -> str:
    return resource_path(API_VERSION, KIND, namespace, name)


def owner_collection(namespace: str | None) -> str:
    return resource_path(API_VERSION, KIND, namespace)


def now_timestamp() -> str:
    """The current time as the API writes timestamps (RFC 3339, UTC, whole seconds)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(stamp: str) -> datetime:
    """A timestamp as the API writes them (RFC 3339, `Z` for UTC); ValueError where it is not one."""
    return datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))


def build_event(
    body: dict[str, Any], type_: str, reason: str, message: str, instance: str, now: str | None = None
) -> dict[str, Any]:
    """A core/v1 Event about the object `body` (type Normal or Warning), posted by goodput-operator."""
    meta = body["metadata"]
    now = now or now_timestamp()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": body.get("apiVersion"),
            "kind": body.get("kind"),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "goodput-operator"},
        "reportingComponent": "goodput-operator",
        "reportingInstance": instance,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def is_subset(desired: Any, live: Any) -> bool:
    """Whether every field set in `desired` has the same value in `live` (lists match item by item)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(is_subset(d, x) for d, x in zip(desired, live, strict=True))
        )
    if isinstance(desired, bool) or isinstance(live, bool):
        return desired is live
    if isinstance(desired, int | float | str) and isinstance(live, int | float | str):
        return str(desired) == str(live)  # quantities and ports may come back as either
    return bool(desired == live)


# A character beyond the BMP, as json.dumps writes it: a UTF-16 surrogate pair (after an even
# number of backslashes, so an escaped backslash followed by "u" is left alone)
_SURROGATE_PAIR = re.compile(r"(?<!\\)((?:\\\\)*)\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})")


def apply_body(manifest: dict[str, Any]) -> bytes:
    """A manifest for server-side apply, which the server reads as YAML: JSON is YAML, except
    that YAML has no surrogate pairs, so a character beyond the BMP is written as \\UXXXXXXXX."""

    def one_escape(match: re.Match[str]) -> str:
        high, low = int(match[2], 16), int(match[3], 16)
        return f"{match[1]}\\U{0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00):08x}"

    return _SURROGATE_PAIR.sub(one_escape, json.dumps(manifest)).encode()


class Kube:
    """`on_write(verb)` is called before each write (any method but GET): the caller counts them in its
    own metrics, so a process that imports this module exports only the series it registered itself."""

    def __init__(
        self, api: kubernetes.client.ApiClient, field_manager: str, on_write: Callable[[str], None] | None = None
    ) -> None:
        self._api = api
        self.field_manager = field_manager
        self._on_write = on_write
        # blocking client calls run here, not in the loop's default executor (cpus + 4 threads): each
        # reconcile slot may have several calls out at once
        self._pool = ThreadPoolExecutor(API_THREADS, thread_name_prefix="kube")

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        request = self._api.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self._api.call_api(*request, _request_timeout=30)
        except ApiException as err:  # transport trouble, reported as status 0
            raise ApiError(err.status or 0, err.reason or "", "") from None
        data = response.read()
        if not 200 <= response.status <= 299:
            raise ApiError(response.status, response.reason or "", data.decode(errors="replace") if data else "")
        return json.loads(data) if data else None

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        if method != "GET" and self._on_write is not None:
            self._on_write(method)
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(self._call, method, path, **kwargs))

    async def get(self, path: str, any_version: bool = False) -> dict[str, Any] | None:
        """The object, or None when absent. `any_version`: as the API server's watch cache holds it
        (resourceVersion=0: no etcd read, possibly a moment old)."""
        try:
            result: dict[str, Any] = await self.request(
                "GET", path, query={"resourceVersion": "0"} if any_version else None
            )
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        return result

    async def list_items(self, path: str, label_selector: str) -> list[dict[str, Any]]:
        listing = await self.request("GET", path, query={"labelSelector": label_selector})
        return list((listing or {}).get("items") or ())

    async def apply(self, manifest: dict[str, Any], live: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        """Server-side apply unless `live` already matches.

        Returns ("created" | "updated" | "unchanged", the object as the server holds it).
        """
        if live is not None and is_subset(manifest, live):
            return "unchanged", live
        meta = manifest["metadata"]
        path = resource_path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"])
        current = await self.request(
            "PATCH",
            path,
            body=apply_body(manifest),
            content_type="application/apply-patch+yaml",
            query={"fieldManager": self.field_manager, "force": "true"},
        )
        return ("created" if live is None else "updated"), current

    async def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        await self.request("POST", f"/api/v1/namespaces/{namespace}/events", body=event)

    async def delete(self, path: str) -> bool:
        try:
            await self.request("DELETE", path, body={"propagationPolicy": "Background"})
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return True

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """The object as the server holds it after the patch."""
        return await self.request(
            "PATCH",
            owner_path(namespace, name) + "/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    async def has_resource(self, group_version: str, plural: str) -> bool:
        """Whether the server serves `plural` in `group_version` (discovery, not assumption)."""
        base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
        try:
            listing = await self.request("GET", base)
        except ApiError as err:
            if err.status in (404, 503):
                return False
            raise
        return any(r.get("name") == plural for r in (listing or {}).get("resources", ()))

    async def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        secret = await self.get(resource_path("v1", "Secret", namespace, name))
        data = (secret or {}).get("data") or {}
        if key not in data:
            return None
        return base64.b64decode(data[key]).decode().strip()
