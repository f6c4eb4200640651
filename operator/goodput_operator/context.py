"""What every reconcile shares: the API, settings, the config fetcher, per-service locks, what the watches saw."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from goodput_operator.hub import ConfigFetcher
from goodput_operator.k8s import ApiError, Kube, build_event
from goodput_operator.observed import Observed
from goodput_operator.settings import Settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Discovered:
    """Optional APIs the cluster serves, found by discovery."""

    pdb_api_version: str = "policy/v1"
    hpa_api_version: str = "autoscaling/v2"
    service_monitors: bool = False
    pod_monitors: bool = False
    scaled_objects: bool = False


# Who asked for a reconcile, most urgent first: a user's change, start-up, a side trigger, the resync.
# Start-up goes before side triggers: a service's first pass writes its children and status, while a
# side trigger only refreshes a status, and the refreshes of a start-up's burst fold into one when
# they wait until the backlog is done.
CHANGE, RESUME, SIDE, RESYNC = range(4)
TRIGGERS = ("change", "resume", "side", "resync")  # by priority: the label of the writes a pass sends
RECONCILE_SLOTS = 8  # reconciles talking to the API server at once (k8s.API_THREADS calls between them)


class Slots:
    """At most `size` holders at once; waiters go by priority, then by arrival.

    Unbounded, thousands of reconciles (start-up, a burst of child events) interleave their
    API calls in one FIFO thread pool: each finishes only when nearly all do, and a new
    service's first call waits behind all of theirs. Bounded, each finishes in turn and a
    user's change goes ahead of the rest.
    """

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def hold(self, priority: int) -> AsyncIterator[None]:
        if self._free > 0 and not self._waiters:
            self._free -= 1
        else:
            future = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiters, (priority, next(self._arrivals), future))
            try:
                await future
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    self._release()  # handed a slot just as it was cancelled: pass it on
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():
                future.set_result(None)
                return
        self._free += 1


class SideQueue:
    """Services to reconcile for a side trigger, in order, each at most once in the queue: the burst
    of events one change makes (a Deployment and its status, its pod) costs one reconcile."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self._queued: set[tuple[str, str]] = set()

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        if key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    async def next(self) -> tuple[str, str]:
        key = await self._queue.get()
        self._queued.discard(key)  # a trigger from now on queues it again: it may change what we read
        return key


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
