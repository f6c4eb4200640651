"""Requests held while their service has no ready replica: at zero and waking, or between pods.

Each service has a bounded queue: past `limit` held requests a new one gets 429, and one
held longer than `seconds` gets 503, both with Retry-After. The number held is exported
as goodput_gateway_requests_waiting, which the operator's autoscaler reads to wake a
service at zero.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from goodput_gateway.discovery import Key, Registry
from goodput_gateway.errors import model_not_found, too_many, unavailable
from goodput_gateway.metrics import GatewayMetrics


class Holds:
    def __init__(self, registry: Registry, metrics: GatewayMetrics, limit: int, seconds: float) -> None:
        self.registry, self.metrics, self.limit, self.seconds = registry, metrics, limit, seconds
        self.held: Counter[Key] = Counter()

    async def ready(self, key: Key, model: str) -> tuple[str, ...]:
        """The service's ready replicas, waiting for one if it has none."""
        ready = self.registry.ready(key)
        if ready:
            return ready
        retry_after = max(1, min(30, round(self.seconds / 10)))
        if self.held[key] >= self.limit:
            self.metrics.refused.labels(*key, "queue_full").inc()
            raise too_many(
                f"The model '{model}' has no ready replica and {self.held[key]} requests are already "
                "waiting for one; retry later",
                retry_after,
            )
        self.held[key] += 1
        gauge = self.metrics.waiting.labels(*key)
        gauge.inc()
        started = time.monotonic()
        try:
            deadline = started + self.seconds
            while not (ready := self.registry.ready(key)):
                if key not in self.registry.services:
                    raise model_not_found(model)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.metrics.refused.labels(*key, "hold_timeout").inc()
                    raise unavailable(
                        f"The model '{model}' had no ready replica within {self.seconds:g} s; retry later",
                        "no_ready_replica",
                        retry_after,
                    )
                try:
                    await asyncio.wait_for(self.registry.changed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
            return ready
        finally:
            self.held[key] -= 1
            gauge.dec()
            self.metrics.hold.labels(*key).observe(time.monotonic() - started)
