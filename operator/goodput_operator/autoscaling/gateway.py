"""What the gateway pods know of each service: requests held while it has no ready replica, requests
it turned away, its last request, and the Batch API lines still to run for it.

The gateway pods are the ready endpoints of the `goodput-gateway` Service in the operator's
namespace, and of `goodput-gateway-batch` where one gateway owns the Batch API's store (or the URLs
in GATEWAY_URL). Held and refused requests are summed over them and the last
request time is the latest any of them saw; pending batch lines come from the store the gateways
share, so each reports the same count and the largest is taken. A gateway whose /metrics cannot be read is left
out; with none readable the reading is None, and nothing wakes or idles on it.

Held and refused requests are demand the pods cannot see: a request waiting at the gateway is
in no pod's queue, and one the gateway turned away (its held queue full, held too long, or no
replica answering) reached no pod's counters. `with_gateway_demand` adds them to what the pods
report, held ones to the queue and refusals to the arrival rate, before the law decides.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field, replace

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from goodput_contract.metrics import (
    BATCH_SERVICE_LINES_PENDING,
    GATEWAY_LAST_REQUEST,
    GATEWAY_REQUESTS_REFUSED,
    GATEWAY_REQUESTS_WAITING,
)
from goodput_operator.autoscaling.sources import SCRAPE_TIMEOUT_SECONDS, endpoint_slice_version, service_endpoints
from goodput_operator.autoscaling.state import Signals
from goodput_operator.k8s import Kube

logger = logging.getLogger(__name__)
GATEWAY_SERVICE = "goodput-gateway"
# the gateway that owns the Batch API's SQLite store (the chart's default): its pending lines
BATCH_GATEWAY_SERVICE = "goodput-gateway-batch"

Key = tuple[str, str]


@dataclass(frozen=True)
class GatewayView:
    held: int = 0
    last_request: float | None = None  # unix seconds
    batch_pending: int = 0
    refused: float = 0.0  # requests turned away so far (a counter, summed over the gateway pods)


REFUSED_FAMILY = GATEWAY_REQUESTS_REFUSED.removesuffix("_total")  # the parser names counters without it


def parse_gateway_metrics(text: str) -> dict[Key, GatewayView]:
    views: dict[Key, GatewayView] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (
            GATEWAY_REQUESTS_WAITING,
            GATEWAY_LAST_REQUEST,
            BATCH_SERVICE_LINES_PENDING,
            REFUSED_FAMILY,
        ):
            continue
        for sample in family.samples:
            if family.name == REFUSED_FAMILY and not sample.name.endswith("_total"):
                continue  # the counter's _created sample
            key = (sample.labels.get("namespace", ""), sample.labels.get("service", ""))
            view = views.get(key, GatewayView())
            if family.name == REFUSED_FAMILY:
                view = replace(view, refused=view.refused + sample.value)
            elif family.name == GATEWAY_REQUESTS_WAITING:
                view = replace(view, held=view.held + round(sample.value))
            elif family.name == GATEWAY_LAST_REQUEST:
                view = replace(view, last_request=sample.value)
            else:
                view = replace(view, batch_pending=round(sample.value))
            views[key] = view
    return views


def merge(readings: list[dict[Key, GatewayView]]) -> dict[Key, GatewayView]:
    merged: dict[Key, GatewayView] = {}
    for reading in readings:
        for key, view in reading.items():
            old = merged.get(key, GatewayView())
            times = [t for t in (old.last_request, view.last_request) if t is not None]
            merged[key] = GatewayView(
                old.held + view.held,
                max(times) if times else None,
                max(old.batch_pending, view.batch_pending),
                old.refused + view.refused,
            )
    return merged


@dataclass
class RefusalRate:
    """Refusals per second over the window, from the summed counter read each period. A total that
    falls (a gateway pod restarted, or one could not be read) starts the count afresh."""

    samples: deque[tuple[float, float]] = field(default_factory=deque)

    def observe(self, now: float, total: float, window: float) -> float:
        if self.samples and total < self.samples[-1][1]:
            self.samples.clear()
        self.samples.append((now, total))
        while len(self.samples) > 2 and self.samples[1][0] <= now - window:
            self.samples.popleft()
        first_at, first = self.samples[0]
        return (total - first) / (now - first_at) if now > first_at else 0.0


def with_gateway_demand(signals: Signals, held: int, refused_rate: float) -> Signals:
    """The pods' signals with what only the gateway saw: held requests join the queue, refusals the
    arrival rate (the last period's too, where a surge shows first)."""
    if not held and refused_rate <= 0:
        return signals
    now_rate = None if signals.arrival_rate_now is None else signals.arrival_rate_now + refused_rate
    return replace(
        signals,
        waiting=signals.waiting + held,
        arrival_rate=signals.arrival_rate + refused_rate,
        arrival_rate_now=now_rate,
    )


class GatewayReader:
    def __init__(self, kube: Kube, namespace: str, urls: tuple[str, ...] = ()) -> None:
        self.kube, self.namespace, self.urls = kube, namespace, urls
        self._slice_version: str | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _targets(self) -> tuple[str, ...]:
        if self.urls:
            return tuple(u.rstrip("/") + "/metrics" for u in self.urls)
        if self._slice_version is None:
            self._slice_version = await endpoint_slice_version(self.kube)
        found = [
            await service_endpoints(self.kube, self._slice_version, self.namespace, name)
            for name in (GATEWAY_SERVICE, BATCH_GATEWAY_SERVICE)
        ]
        return tuple(url for endpoints in found for url in endpoints.ready)

    async def _scrape(self, url: str) -> dict[Key, GatewayView]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS))
        async with self._session.get(url) as response:
            response.raise_for_status()
            return parse_gateway_metrics(await response.text())

    async def read(self) -> dict[Key, GatewayView] | None:
        """Every service's view across the gateway pods; None when no gateway could be read."""
        try:
            targets = await self._targets()
        except Exception as err:
            logger.warning("Finding the gateway pods failed: %s", err)
            return None
        results = await asyncio.gather(*(self._scrape(u) for u in targets), return_exceptions=True)
        readings = [r for r in results if isinstance(r, dict)]
        if not readings:
            return None
        return merge(readings)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
