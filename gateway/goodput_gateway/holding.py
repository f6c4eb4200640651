"""Requests held while their service has no ready replica (at zero and waking, or between pods), or
while the LoRA adapter they name is loading on a replica and no replica serves it yet (lora_holding.py),
or while every ready replica is one this request already failed on (a lone replica that crashed is still
listed until the kubelet sees it): such a request waits until a replica it has not failed on is ready, one
that left the ready set and came back counting as new (a restarted container keeps its pod's address), for
at most FAILED_WAIT seconds; a replica still listed after that is tried again, since it is live and failed
this request only.

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

# how long a request that failed on every ready replica waits for one of them to leave the ready set: a
# crashed container's pod turns unready within a second or two; readiness probes that fail take up to 15 s
FAILED_WAIT = 20.0


class Holds:
    def __init__(self, registry: Registry, metrics: GatewayMetrics, limit: int, seconds: float) -> None:
        self.registry, self.metrics, self.limit, self.seconds = registry, metrics, limit, seconds
        self.held: Counter[Key] = Counter()

    async def ready(
        self, key: Key, model: str, load: AdapterLoad | None = None, tried: set[str] | None = None
    ) -> tuple[str, ...]:
        """The service's ready replicas, waiting for one if it has none; with `load`, waiting also while
        the request's adapter is loading on one of them and served by none; with `tried` (the replicas the
        request failed on, kept up to date here: one that leaves the ready set is forgotten), waiting also
        while every ready replica is in it."""

        failed_until = time.monotonic() + min(FAILED_WAIT, self.seconds)  # over before the hold's own bound

        def failed_on_all(ready: tuple[str, ...]) -> bool:
            if tried:
                tried.intersection_update(ready)
            return bool(tried and all(r in tried for r in ready) and time.monotonic() < failed_until)

        def blocked(ready: tuple[str, ...]) -> bool:
            return not ready or (load is not None and load.pending(ready)) or failed_on_all(ready)

        ready = self.registry.ready(key)
        if not blocked(ready):
            return ready
        retry_after = max(1, min(30, round(self.seconds / 10)))
        if self.held[key] >= self.limit:
            self.metrics.refused.labels(*key, "queue_full").inc()
            why = "has no ready replica" if not ready else "is still loading" if load else "has no replica to retry on"
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
                if failed_on_all(ready):  # woken when the wait for a failed replica to leave ends
                    remaining = min(remaining, max(0.0, failed_until - time.monotonic()))
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
