"""Requests held while their service has no ready replica (at zero and waking, or between pods), or
while the LoRA adapter they name is loading on a replica and no replica serves it yet (lora_holding.py).

Each service has one bounded queue for both: past `limit` held requests a new one gets 429, and one
held longer than `seconds` gets 503, both with Retry-After. The number held is exported as
goodput_gateway_requests_waiting, which the operator's autoscaler reads as the service's queue (and
to wake a service at zero).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from goodput_gateway.discovery import Key, Registry
from goodput_gateway.errors import model_not_found, too_many, unavailable
from goodput_gateway.lora_holding import AdapterLoad
from goodput_gateway.metrics import GatewayMetrics


class Holds:
    def __init__(self, registry: Registry, metrics: GatewayMetrics, limit: int, seconds: float) -> None:
        self.registry, self.metrics, self.limit, self.seconds = registry, metrics, limit, seconds
        self.held: Counter[Key] = Counter()

    async def ready(self, key: Key, model: str, load: AdapterLoad | None = None) -> tuple[str, ...]:
        """The service's ready replicas, waiting for one if it has none; with `load`, waiting also while
        the request's adapter is loading on one of them and served by none."""

        def blocked(ready: tuple[str, ...]) -> bool:
            return not ready or (load is not None and load.pending(ready))

        ready = self.registry.ready(key)
        if not blocked(ready):
            return ready
        retry_after = max(1, min(30, round(self.seconds / 10)))
        if self.held[key] >= self.limit:
            self.metrics.refused.labels(*key, "queue_full").inc()
            why = "is still loading" if ready else "has no ready replica"
            raise too_many(
                f"The model '{model}' {why} and {self.held[key]} requests are already waiting for its service; "
                "retry later",
                retry_after,
            )
        self.held[key] += 1
        gauge = self.metrics.waiting.labels(*key)
        gauge.inc()
        started = time.monotonic()
        try:
            deadline = started + self.seconds
            while blocked(ready := self.registry.ready(key)):
                if key not in self.registry.services:
                    raise model_not_found(model)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.metrics.refused.labels(*key, "hold_timeout").inc()
                    if ready:
                        raise unavailable(
                            f"The model '{model}' was still loading after {self.seconds:g} s; retry later",
                            "lora_loading",
                            retry_after,
                        )
                    raise unavailable(
                        f"The model '{model}' had no ready replica within {self.seconds:g} s; retry later",
                        "no_ready_replica",
                        retry_after,
                    )
                events = [self.registry.changed] + ([load.changed()] if load is not None else [])
                await first_of(events, remaining)
            return ready
        finally:
            self.held[key] -= 1
            gauge.dec()
            self.metrics.hold.labels(*key).observe(time.monotonic() - started)


async def first_of(events: list[asyncio.Event], timeout: float) -> None:
    """Until one of `events` is set, or `timeout` seconds."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
