"""A saturated service's fair turns: past its in-flight cap, each free slot goes to the highest priority class
with a waiting request, within it to the tenant that has had the least service for its weight (start-time
fair queueing: a tenant that was idle starts level with the others, not with banked credit)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator

from goodput_gateway.tenant_table import PRIORITIES, Tenant


class NoTurn(Exception):
    """No turn came within the wait allowed."""


class FairGate:
    """A service's in-flight cap, with waiting requests served by priority class, then by weighted fair turn."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.waiting: dict[int, dict[str, deque[asyncio.Future[None]]]] = {}
        self.served: dict[str, float] = {}  # a tenant's next start tag: service received / weight
        self.weights: dict[str, float] = {}
        self.virtual = 0.0  # the start tag of the request last given a place

    def _activate(self, name: str) -> None:
        """A tenant with nothing waiting becomes active: its next start is no earlier than the start of the
        request last given a place (start-time fair queueing), so idle time banks no credit."""
        self.served[name] = max(self.served.get(name, 0.0), self.virtual)

    def _give(self, name: str) -> None:
        self.virtual = self.served[name]
        self.served[name] += 1 / self.weights.get(name, 1.0)
        self.in_flight += 1

    @contextlib.asynccontextmanager
    async def turn(self, tenant: Tenant, limit: int, timeout: float) -> AsyncIterator[float]:
        """Held while the request runs; yields the seconds it waited. Past `timeout` waiting: NoTurn."""
        started = time.monotonic()
        self.weights[tenant.name] = tenant.weight
        if self.in_flight >= limit or self.waiting:
            prio = PRIORITIES[tenant.priority]
            queues = self.waiting.setdefault(prio, {})
            if tenant.name not in queues:
                self._activate(tenant.name)
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            queues.setdefault(tenant.name, deque()).append(future)
            self.dispatch(limit)
            try:
                await asyncio.wait_for(asyncio.shield(future), timeout)
            except BaseException as err:
                if future.done() and not future.cancelled():
                    self.release(limit)  # the turn came as the wait ended: give it to the next
                else:
                    future.cancel()
                    self.forget(prio, tenant.name, future)
                if isinstance(err, TimeoutError):
                    raise NoTurn from None
                raise
        else:
            self._activate(tenant.name)
            self._give(tenant.name)
        try:
            yield time.monotonic() - started
        finally:
            self.release(limit)

    def forget(self, prio: int, name: str, future: asyncio.Future[None]) -> None:
        queue = self.waiting.get(prio, {}).get(name)
        if queue is not None and future in queue:
            queue.remove(future)
            if not queue:
                del self.waiting[prio][name]
                if not self.waiting[prio]:
                    del self.waiting[prio]

    def release(self, limit: int) -> None:
        self.in_flight -= 1
        self.dispatch(limit)

    def dispatch(self, limit: int) -> None:
        while self.in_flight < limit and self.waiting:
            prio = min(self.waiting)
            queues = self.waiting[prio]
            name = min(queues, key=lambda t: self.served.get(t, 0.0))
            future = queues[name].popleft()
            if not queues[name]:
                del queues[name]
                if not queues:
                    del self.waiting[prio]
            if future.done():
                continue
            self._give(name)
            future.set_result(None)
