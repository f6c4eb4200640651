"""The work queue's bookkeeping: the priority of each kind of trigger, the slots that bound how many
passes talk to the API server at once, and the side queue that folds a burst of triggers into one pass.

Plain asyncio, no API: the controller (controller.py) drives passes through them, and the Context
holds one of each per operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator

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
