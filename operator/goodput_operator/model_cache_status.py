"""What the ModelCache agent writes to the API server: status.nodes.<node> and the summary, the node's
label, and the complete copy published as local PersistentVolumes."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from goodput_contract.api import GROUP, MODEL_CACHE_PLURAL, VERSION
from goodput_contract.api.model_cache_spec import STORAGE_CLASS, VOLUME_LABEL, cache_key, node_label
from goodput_operator.model_cache_progress import summary

logger = logging.getLogger("goodput_operator.model_cache_agent")

STATUS_CONFLICT_TRIES = 8


class Status:
    """Writes status.nodes.<node> and the summary, under the object's resourceVersion, and the node's
    label modelcache.goodput.dev/<namespace>.<name>: "ready" while the node holds every file."""

    def __init__(
        self,
        api: kubernetes.client.CustomObjectsApi,
        node: str,
        core: kubernetes.client.CoreV1Api | None = None,
        host_root: Path | None = None,
        volumes_per_node: int = 0,
    ) -> None:
        self.api, self.node, self.core = api, node, core
        self.host_root, self.volumes_per_node = host_root, volumes_per_node

    def volumes(self, namespace: str, name: str, ready: bool, size: int = 0) -> None:
        """The node's copy as `volumes_per_node` local PersistentVolumes (read-only, bound to this node, of
        the StorageClass goodput-model-cache, labelled with the cache) while it is complete: a serving pod's
        claim selecting them is placed on a node holding the model and reads it without a hostPath. A
        released volume is made available again; unbound ones go when the copy is incomplete or deleted."""
        if self.core is None or self.host_root is None or not self.volumes_per_node:
            return
        key = cache_key(namespace, name)
        base = "gcache-" + hashlib.sha256(f"{self.node}/{namespace}/{name}".encode()).hexdigest()[:20]
        try:
            listing = self.core.list_persistent_volume(label_selector=f"{VOLUME_LABEL}={key}")
            mine: dict[str, Any] = {}
            for volume in listing.items:
                volume_name = str((volume.metadata and volume.metadata.name) or "")
                if volume_name.startswith(base + "-"):
                    mine[volume_name] = volume
            if not ready:
                for volume_name, volume in mine.items():
                    if (volume.status and volume.status.phase) in ("Available", "Released", "Pending", None):
                        self.core.delete_persistent_volume(volume_name)
                return
            node = self.core.read_node(self.node)
            hostname = ((node.metadata and node.metadata.labels) or {}).get("kubernetes.io/hostname", self.node)
            for i in range(self.volumes_per_node):
                pv_name = f"{base}-{i}"
                current = mine.get(pv_name)
                if current is None:
                    manifest: Any = self._volume(pv_name, key, namespace, name, hostname, size)
                    self.core.create_persistent_volume(manifest)
                elif current.status and current.status.phase == "Released":
                    self.core.patch_persistent_volume(pv_name, {"spec": {"claimRef": None}})
        except ApiException as err:
            logger.warning("volumes of %s/%s on node %s: %s %s", namespace, name, self.node, err.status, err.reason)

    def _volume(self, pv_name: str, key: str, namespace: str, name: str, hostname: str, size: int) -> dict[str, Any]:
        assert self.host_root is not None
        return {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {
                "name": pv_name,
                "labels": {VOLUME_LABEL: key, "app.kubernetes.io/managed-by": "goodput-model-cache-agent"},
                "annotations": {
                    "serving.goodput.dev/node": self.node,
                    "serving.goodput.dev/cache": f"{namespace}/{name}",
                },
            },
            "spec": {
                "capacity": {"storage": str(max(size, 1))},
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": STORAGE_CLASS,
                "volumeMode": "Filesystem",
                "local": {"path": str(self.host_root / namespace / name)},
                "nodeAffinity": {
                    "required": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "kubernetes.io/hostname", "operator": "In", "values": [hostname]}
                                ]
                            }
                        ]
                    }
                },
            },
        }

    def label(self, namespace: str, name: str, ready: bool) -> None:
        """Set (or remove) the node's label; a failure (no such Node, no right to patch it) is logged only."""
        if self.core is None:
            return
        key = node_label(namespace, name)
        try:
            node = self.core.read_node(self.node)
            if ((node.metadata and node.metadata.labels) or {}).get(key) == ("ready" if ready else None):
                return
            self.core.patch_node(self.node, {"metadata": {"labels": {key: "ready" if ready else None}}})
        except ApiException as err:
            logger.warning("label %s on node %s: %s %s", key, self.node, err.status, err.reason)

    def write(self, namespace: str, name: str, entry: dict[str, Any]) -> None:
        for _ in range(STATUS_CONFLICT_TRIES):
            try:
                body: Any = self.api.get_namespaced_custom_object(GROUP, VERSION, namespace, MODEL_CACHE_PLURAL, name)
            except ApiException as err:
                if err.status == 404:
                    return
                raise
            status = dict(body.get("status") or {})
            nodes = dict(status.get("nodes") or {})
            nodes[self.node] = entry
            status.pop("lastError", None)
            status.update(summary(nodes), nodes=nodes)
            status["observedGeneration"] = body["metadata"].get("generation")
            try:
                self.api.replace_namespaced_custom_object_status(
                    GROUP,
                    VERSION,
                    namespace,
                    MODEL_CACHE_PLURAL,
                    name,
                    {
                        "apiVersion": body["apiVersion"],
                        "kind": body["kind"],
                        "metadata": {
                            "name": name,
                            "namespace": namespace,
                            "resourceVersion": body["metadata"]["resourceVersion"],
                        },
                        "status": status,
                    },
                )
                return
            except ApiException as err:
                if err.status not in (404, 409):
                    raise
                if err.status == 404:
                    return
        logger.warning("status of %s/%s: conflicts %d times in a row", namespace, name, STATUS_CONFLICT_TRIES)
