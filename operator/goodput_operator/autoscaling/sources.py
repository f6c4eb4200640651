"""Where the autoscaler's numbers come from: the service's ready endpoints, then the pods or Prometheus.

Ready pods are the service's EndpointSlices' ready endpoints (the same set the Service
routes to); their count, not the Deployment's, is the capacity serving now. By default
each ready pod's /metrics is scraped directly; with PROMETHEUS_URL the same signals are
asked of Prometheus (series labelled `namespace` by the ServiceMonitor or PodMonitor and
`model` by the runtime, `model_name` by vLLM and SGLang). Every engine's names are read
(goodput_contract.metrics.ENGINE_METRICS); where an engine has no good counter, good requests
are estimated from its TTFT and TPOT histograms against the SLO. A failed read is reported as
missing, never as zero.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from goodput_contract.metrics import ENGINE_METRICS
from goodput_operator.autoscaling.signals import (
    History,
    PodSample,
    estimated_good,
    histogram_quantile,
    parse_pod_metrics,
    share_within,
)
from goodput_operator.autoscaling.state import Signals
from goodput_operator.k8s import ApiError, Kube

logger = logging.getLogger(__name__)
SCRAPE_TIMEOUT_SECONDS = 5.0
Slo = tuple[float | None, float | None]  # (ttft, tpot) targets in seconds


@dataclass(frozen=True)
class Endpoints:
    ready: tuple[str, ...]  # metrics URLs of ready pods


@dataclass(frozen=True)
class Reading:
    ready: int
    signals: Signals | None
    missing: str = ""  # why signals is None
    failed: bool = False  # a read went wrong (not merely too early, or no pod ready)


class Source(Protocol):
    """Signals for one service from its ready endpoints; DirectSource and PrometheusSource below."""

    async def read(
        self,
        key: tuple[str, str],
        served_name: str,
        endpoints: Endpoints,
        now: float,
        *,
        engine: str = "goodput",
        slo: Slo = (None, None),
    ) -> Reading: ...
    def forget(self, key: tuple[str, str]) -> None: ...
    async def close(self) -> None: ...


async def endpoint_slice_version(kube: Kube) -> str:
    for version in ("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1"):
        if await kube.has_resource(version, "endpointslices"):
            return version
    raise ApiError(404, "NotFound", "the server serves no EndpointSlices")


async def service_endpoints(kube: Kube, version: str, namespace: str, service: str) -> Endpoints:
    listing = await kube.request(
        "GET",
        f"/apis/{version}/namespaces/{namespace}/endpointslices",
        query={"labelSelector": f"kubernetes.io/service-name={service}"},
    )
    ready: list[str] = []
    for piece in (listing or {}).get("items") or ():
        ports = {p.get("name"): p.get("port") for p in piece.get("ports") or ()}
        port = ports.get("metrics") or ports.get("http")
        for endpoint in piece.get("endpoints") or ():
            conditions = endpoint.get("conditions") or {}
            if conditions.get("terminating"):
                continue
            if conditions.get("ready") is False or port is None:
                continue  # starting: the loop counts it from spec.replicas
            host = endpoint["addresses"][0]
            host = f"[{host}]" if ":" in host else host
            ready.append(f"http://{host}:{port}/metrics")
    return Endpoints(tuple(sorted(ready)))


class DirectSource:
    """Scrapes every ready pod's /metrics itself; no Prometheus needed."""

    def __init__(self, window: float, long_window: float) -> None:
        self.window, self.long_window = window, long_window
        self._history: dict[tuple[str, str], History] = {}
        self._session: aiohttp.ClientSession | None = None

    async def _scrape(self, url: str) -> PodSample:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS))
        async with self._session.get(url) as response:
            response.raise_for_status()
            return parse_pod_metrics(await response.text())

    async def read(
        self,
        key: tuple[str, str],
        served_name: str,
        endpoints: Endpoints,
        now: float,
        *,
        engine: str = "goodput",
        slo: Slo = (None, None),
    ) -> Reading:
        history = self._history.setdefault(key, History(keep_seconds=self.long_window + self.window))
        history.slo_ttft, history.slo_tpot = slo
        if not endpoints.ready:
            return Reading(0, None, "no ready pods to read metrics from")
        results = await asyncio.gather(*(self._scrape(url) for url in endpoints.ready), return_exceptions=True)
        failed = [(url, r) for url, r in zip(endpoints.ready, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            url, err = failed[0]
            return Reading(
                len(endpoints.ready),
                None,
                f"metrics of {len(failed)} of {len(endpoints.ready)} ready pods unreadable ({url}: {err})",
                failed=True,
            )
        history.add(now, {url: r for url, r in zip(endpoints.ready, results, strict=True) if isinstance(r, PodSample)})
        signals = history.signals(now, self.window, self.long_window)
        return Reading(len(endpoints.ready), signals, "" if signals else "waiting for a second scrape")

    def forget(self, key: tuple[str, str]) -> None:
        self._history.pop(key, None)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class PrometheusSource:
    """The same signals as PromQL over the series Prometheus scraped from the pods."""

    def __init__(self, url: str, window: float, long_window: float) -> None:
        self.url, self.window, self.long_window = url.rstrip("/"), window, long_window
        self._session: aiohttp.ClientSession | None = None

    async def _result(self, promql: str) -> list[dict[str, Any]]:
        """The series an instant query returns."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS))
        async with self._session.get(f"{self.url}/api/v1/query", params={"query": promql}) as response:
            response.raise_for_status()
            body: dict[str, Any] = await response.json()
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def _query(self, promql: str) -> float | None:
        result = await self._result(promql)
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if value != value else value  # NaN: 0/0, nothing finished

    async def _query_buckets(self, promql: str) -> list[tuple[float, float]]:
        """A `sum by (le)` query as sorted (le, value) pairs."""
        return sorted((float(r["metric"]["le"]), float(r["value"][1])) for r in await self._result(promql))

    async def read(
        self,
        key: tuple[str, str],
        served_name: str,
        endpoints: Endpoints,
        now: float,
        *,
        engine: str = "goodput",
        slo: Slo = (None, None),
    ) -> Reading:
        if not endpoints.ready:
            return Reading(0, None, "no ready pods to read metrics from")
        m = ENGINE_METRICS[engine]
        sel = f'namespace="{key[0]}",{m.model_label}="{served_name}"'
        w, lw = f"{self.window:.0f}s", f"{self.long_window:.0f}s"

        def first(names: tuple[str, ...], expr: Callable[[str], str], suffix: str = "") -> str:
            """The expression over the first of `names` that has series: a renamed series is read under
            whichever generation of its name the engine exports."""
            out = expr(names[0])
            for i, name in enumerate(names[1:], start=1):
                earlier = " or ".join(f"{n}{suffix}{{{sel}}}" for n in names[:i])
                out = f"{out} or ({expr(name)} unless on() count({earlier}))"
            return out

        def rate(names: tuple[str, ...], window: str) -> str:
            return " + ".join(f"(sum(rate({n}{{{sel}}}[{window}])) or vector(0))" for n in names)

        def failed(window: str) -> str:
            parts = []
            for counter, label, values in m.failed:
                match = f',{label}=~"{"|".join(values)}"' if label else ""
                parts.append(f"(sum(rate({counter}{{{sel}{match}}}[{window}])) or vector(0))")
            return " + ".join(parts) or "vector(0)"

        def buckets(names: tuple[str, ...], window: str) -> str:
            return first(names, lambda n: f"sum by (le) (rate({n}_bucket{{{sel}}}[{window}]))", "_bucket")

        def attainment(window: str) -> str:
            return f"sum(rate({m.good}{{{sel}}}[{window}])) / sum(rate({m.requests[0]}{{{sel}}}[{window}]))"

        arrivals = m.requests + m.rejected  # refused requests (429) were demand too
        scalars = [
            f"sum(rate({m.requests[0]}{{{sel}}}[{w}]))",
            rate(arrivals, w),
            rate(m.requests, lw),
            failed(w),
            failed(lw),
            first(m.waiting, lambda n: f"sum({n}{{{sel}}})"),
            first(m.running, lambda n: f"sum({n}{{{sel}}})"),
            first(m.kv_usage, lambda n: f"avg({n}{{{sel}}})"),
            f"({rate(m.requests, lw)}) * {self.long_window:.0f}",
        ]
        if m.good:
            scalars += [attainment(w), attainment(lw)]
        histograms = [buckets(m.ttft, w), buckets(m.tpot, w), buckets(m.ttft, lw), buckets(m.tpot, lw)]
        try:
            values = await asyncio.gather(*(self._query(q) for q in scalars))
            ttft, tpot, ttft_long, tpot_long = await asyncio.gather(*(self._query_buckets(q) for q in histograms))
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError) as err:
            return Reading(len(endpoints.ready), None, f"Prometheus query failed: {err!r}", failed=True)
        present, total, total_long, fail, fail_long, waiting, running, kv, finished = values[:9]
        if present is None or waiting is None:
            return Reading(len(endpoints.ready), None, f"Prometheus has no {engine} series for {sel}", failed=True)
        if m.good:
            att, att_long = values[9], values[10]
        else:  # estimated from the histograms against the SLO, as History does for direct scrapes

            def estimate(
                requests: float | None,
                failures: float | None,
                t: list[tuple[float, float]],
                p: list[tuple[float, float]],
            ) -> float | None:
                if not requests:
                    return None
                good = estimated_good(
                    max(0.0, requests - (failures or 0.0)), share_within(t, slo[0]), share_within(p, slo[1])
                )
                return min(1.0, good / requests)

            att, att_long = estimate(total, fail, ttft, tpot), estimate(total_long, fail_long, ttft_long, tpot_long)
        return Reading(
            len(endpoints.ready),
            Signals(
                arrival_rate=total or 0.0,
                attainment=att,
                attainment_long=att_long,
                waiting=round(waiting),
                running=round(running or 0),
                kv_usage=kv or 0.0,
                ttft_p90=histogram_quantile(0.9, ttft),
                tpot_p90=histogram_quantile(0.9, tpot),
                finished_long=finished,
            ),
        )

    def forget(self, key: tuple[str, str]) -> None:
        pass

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
