"""What every reconcile shares: the API, settings, the config fetcher, per-service locks, the work queue's
slots and side queue (workqueue.py), what the watches saw."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from goodput_operator.hub import ConfigFetcher
from goodput_operator.k8s import ApiError, Kube, build_event
from goodput_operator.node_caches import NodeCaches
from goodput_operator.observed import Observed
from goodput_operator.settings import Settings
from goodput_operator.workqueue import RECONCILE_SLOTS, SideQueue, Slots

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Discovered:
    """Optional APIs the cluster serves, found by discovery."""

    pdb_api_version: str = "policy/v1"
    hpa_api_version: str = "autoscaling/v2"
    service_monitors: bool = False
    pod_monitors: bool = False
    scaled_objects: bool = False
    leader_worker_sets: bool = False  # leaderworkerset.x-k8s.io/v1: groups of pods for a replica spanning nodes


@dataclass
class Context:
    kube: Kube
    settings: Settings
    fetcher: ConfigFetcher
    instance: str = "goodput-operator"
    _locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = field(
        default_factory=weakref.WeakValueDictionary
    )
    # (namespace, name) -> Failure.key of the pod failure last posted as an Event
    reported_failures: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    observed: Observed = field(default_factory=Observed)  # children and pods from the watch streams
    side: SideQueue = field(default_factory=SideQueue)
    slots: Slots = field(default_factory=lambda: Slots(RECONCILE_SLOTS))
    started_at: float = field(default_factory=time.time)  # wall clock, as creationTimestamps are
    # (namespace, name) -> the generation the last completed pass reconciled
    handled: dict[tuple[str, str], int] = field(default_factory=dict)
    # pipelines by (namespace, name) -> the services they call, from the pipeline watch
    pipeline_calls: dict[tuple[str, str], frozenset[str]] = field(default_factory=dict)
    # (namespace, service) -> (Ready, why not) as the pipelines last saw it, from the service watch
    service_states: dict[tuple[str, str], tuple[bool, str]] = field(default_factory=dict)
    # the ModelCaches services name in spec.model.nodeCache, from their watch
    node_caches: NodeCaches = field(default_factory=NodeCaches)
    _discovered: Discovered | None = None
    _discovered_at: float = 0.0

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """One reconcile at a time per service, whichever event started it."""
        key = (namespace, name)
        lock = self._locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[key] = lock
        return lock

    def forget_failures_except(self, services: set[tuple[str, str]]) -> None:
        """Drop what was remembered about services that no longer exist."""
        for key in self.reported_failures.keys() - services:
            del self.reported_failures[key]

    async def discovery(self) -> Discovered:
        if self._discovered is None or time.monotonic() - self._discovered_at > self.settings.discovery_seconds:
            has = self.kube.has_resource
            # Older servers serve only the beta versions of PDBs (policy/v1beta1) and HPAs (v2beta2).
            pdb_v1 = await has("policy/v1", "poddisruptionbudgets")
            hpa_v2 = await has("autoscaling/v2", "horizontalpodautoscalers")
            self._discovered = Discovered(
                pdb_api_version="policy/v1" if pdb_v1 else "policy/v1beta1",
                hpa_api_version="autoscaling/v2" if hpa_v2 else "autoscaling/v2beta2",
                service_monitors=await has("monitoring.coreos.com/v1", "servicemonitors"),
                pod_monitors=await has("monitoring.coreos.com/v1", "podmonitors"),
                scaled_objects=await has("keda.sh/v1alpha1", "scaledobjects"),
                leader_worker_sets=await has("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
            )
            self._discovered_at = time.monotonic()
        return self._discovered

    async def event(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Post a core/v1 Event about the service; a failure to post is logged, never raised."""
        meta = body["metadata"]
        try:
            await self.kube.create_event(meta["namespace"], build_event(body, type_, reason, message, self.instance))
        except ApiError as err:
            logger.warning("Posting event %s for %s/%s failed: %s", reason, meta["namespace"], meta["name"], err)
