"""The goodput control loop: every period, for each service in goodput mode, read → decide → act → record.

One loop per operator process; the operator runs as one replica (Deployment strategy
Recreate), so exactly one writer of replicas exists. It writes only the scale
subresource, under its own field manager, and status.autoscaler and status.slo.
In hpa and keda modes it decides but does not act: the HPA or ScaledObject follows the
decision through goodput_autoscaler_desired_replicas and is the one writer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from goodput_contract.api.spec import ServiceSpec, SpecError, parse
from goodput_contract.metrics import AUTOSCALER_DESIRED_REPLICAS as DESIRED_METRIC
from goodput_operator import metrics
from goodput_operator.autoscaling import pool_metrics
from goodput_operator.autoscaling.arrival import forecast
from goodput_operator.autoscaling.gateway import GatewayReader, GatewayView, RefusalRate, with_gateway_demand
from goodput_operator.autoscaling.law import SCALE_CAUSES, UP, Decision, decide
from goodput_operator.autoscaling.policy import FIELD_MANAGER, WriteFailed, policy_for
from goodput_operator.autoscaling.pool_loop import PoolState, pool_source, scale_pools
from goodput_operator.autoscaling.sources import (
    DirectSource,
    PrometheusSource,
    Reading,
    Source,
    endpoint_slice_version,
    service_endpoints,
)
from goodput_operator.autoscaling.startup import StartupClock
from goodput_operator.autoscaling.state import Memory, Observation, Signals, start_memory
from goodput_operator.context import Context
from goodput_operator.k8s import ApiError, Kube, load_config, now_timestamp, owner_collection, owner_path

logger = logging.getLogger(__name__)
DECIDING_MODES = ("goodput", "hpa", "keda")


@dataclass
class Autoscaler:
    ctx: Context
    kube: Kube  # its own client: servers before 1.22 name a scale write's manager after the user agent
    source: Source
    period: float
    window: float
    memories: dict[tuple[str, str], Memory] = field(default_factory=dict)
    startups: dict[tuple[str, str], StartupClock] = field(default_factory=dict)
    gateway: GatewayReader | None = None  # requests held and refused there, last request times, batch lines
    refusals: dict[tuple[str, str], RefusalRate] = field(default_factory=dict)
    _slice_version: str | None = None
    pools: dict[tuple[str, str], PoolState] = field(default_factory=dict)  # disaggregated services (pool_loop.py)
    pool_source: DirectSource | None = None
    dispersion: bool = True  # the law plans with the measured peakedness (--autoscaler-dispersion)

    @classmethod
    def from_context(cls, ctx: Context) -> Autoscaler:
        s = ctx.settings
        long_window = s.autoscaler_window_seconds * 5
        source: Source = (
            PrometheusSource(s.prometheus_url, s.autoscaler_window_seconds, long_window)
            if s.prometheus_url
            else DirectSource(s.autoscaler_window_seconds, long_window)
        )
        api = load_config()
        api.user_agent = FIELD_MANAGER
        kube = Kube(api, FIELD_MANAGER, on_write=metrics.count_write)
        return cls(
            ctx,
            kube,
            source,
            s.autoscaler_period_seconds,
            s.autoscaler_window_seconds,
            gateway=GatewayReader(kube, s.gateway_namespace, s.gateway_urls),
            dispersion=s.autoscaler_dispersion,
        )

    def __post_init__(self) -> None:
        if self.pool_source is None:
            self.pool_source = pool_source(self.window)
        for direction, causes in SCALE_CAUSES.items():
            for cause in causes:
                metrics.AUTOSCALER_SCALE_EVENTS.labels(direction=direction, reason=cause)

    async def run_forever(self) -> None:
        try:
            while True:
                started = time.monotonic()
                await self.tick()
                await asyncio.sleep(max(0.0, self.period - (time.monotonic() - started)))
        finally:
            await self.source.close()
            if self.pool_source is not None:
                await self.pool_source.close()
            if self.gateway is not None:
                await self.gateway.close()

    async def tick(self) -> None:
        try:
            listing = await self.kube.request("GET", owner_collection(self.ctx.settings.namespace))
        except Exception as err:
            logger.warning("Listing InferenceServices for the autoscaler failed: %s", err)
            return
        seen = set()
        views = None
        if self.gateway is not None and listing.get("items"):
            views = await self.gateway.read()
        for body in listing.get("items") or ():
            meta = body["metadata"]
            key = (meta["namespace"], meta["name"])
            if meta.get("deletionTimestamp"):
                continue
            try:
                svc = parse(meta["name"], meta["namespace"], body.get("spec") or {})
            except SpecError:
                if key in self.memories:
                    seen.add(key)  # the reconcile reports it as Valid=False; keep what was learnt meanwhile
                continue
            if svc.autoscaling.mode not in DECIDING_MODES:
                continue
            seen.add(key)
            try:
                if svc.disaggregation is not None and svc.autoscaling.mode == "goodput":
                    await scale_pools(self, body, svc, None if views is None else views.get(key, GatewayView()))
                    continue
                if self.pools.pop(key, None) is not None:  # no longer disaggregated: its pools' series go
                    pool_metrics.forget(*key)
                await self.scale(body, svc, None if views is None else views.get(key, GatewayView()))
            except WriteFailed as err:
                logger.warning("Autoscaling %s/%s: %s", *key, err)
            except Exception as err:
                metrics.AUTOSCALER_METRIC_ERRORS.inc()
                logger.warning("Autoscaling %s/%s failed, holding replicas: %s", *key, err)
        for key in set(self.memories) - seen:
            self.memories.pop(key, None)
            self.startups.pop(key, None)
            self.refusals.pop(key, None)
            self.source.forget(key)
            _forget_series(*key)
        for key in set(self.pools) - seen:
            self.pools.pop(key, None)
            pool_metrics.forget(*key)
            if self.pool_source is not None:
                self.pool_source.forget(key)
                self.pool_source.forget((key[0], f"{key[1]}-prefill"))

    async def scale(self, body: dict[str, Any], svc: ServiceSpec, gateway: GatewayView | None = None) -> Decision:
        namespace, name = svc.namespace, svc.name
        key = (namespace, name)
        policy, configured = policy_for(svc)
        policy = replace(policy, window_seconds=self.window, dispersion=self.dispersion)
        memory = self.memories.get(key) or start_memory(configured)
        if self._slice_version is None:
            self._slice_version = await endpoint_slice_version(self.kube)
        # spec.replicas unset: the Deployment runs minReplicas (builders.py), so that is the current count
        current = svc.desired_replicas
        endpoints = await service_endpoints(self.kube, self._slice_version, namespace, name)
        now = time.monotonic()
        reading = await self.source.read(
            key,
            svc.model.served_name,
            endpoints,
            now,
            engine=svc.engine.kind,
            slo=(svc.slo.ttft_seconds, svc.slo.tpot_seconds),
        )
        if reading.failed:
            metrics.AUTOSCALER_METRIC_ERRORS.inc()
        startup = self.startups.setdefault(key, StartupClock()).observe(now, current, reading.ready)
        if startup is not None:  # the forecast looks ahead by the start-up measured for this service
            policy = replace(policy, startup_seconds=startup)
            metrics.AUTOSCALER_STARTUP.labels(namespace=namespace, name=name).set(startup)
        held = age = batch = None
        signals = reading.signals
        if gateway is not None:
            held, batch = gateway.held, gateway.batch_pending
            age = None if gateway.last_request is None else max(0.0, time.time() - gateway.last_request)
            refused = self.refusals.setdefault(key, RefusalRate()).observe(now, gateway.refused, self.window)
            if signals is not None:  # requests waiting or turned away at the gateway are demand the pods miss
                signals = with_gateway_demand(signals, gateway.held, refused)
        decision = decide(
            policy,
            Observation(
                now,
                current,
                reading.ready,
                signals,
                reading.missing,
                held=held,
                last_request_age=age,
                batch_pending=batch,
            ),
            memory,
        )
        self.memories[key] = decision.memory
        if decision.desired != current and svc.autoscaling.mode == "goodput":
            try:
                await self._write_replicas(body, svc, current, decision)
            except Exception as err:
                metrics.AUTOSCALER_WRITE_ERRORS.labels(target="replicas").inc()
                raise WriteFailed(f"writing {decision.desired} replicas failed: {err}") from err
        try:
            await self._write_status(body, svc, current, decision, reading)
        except Exception as err:
            metrics.AUTOSCALER_WRITE_ERRORS.labels(target="status").inc()
            raise WriteFailed(f"writing status.autoscaler failed: {err}") from err
        metrics.AUTOSCALER_DESIRED.labels(namespace=namespace, name=name).set(decision.desired)
        for kind, value in (
            ("current", current),
            ("ready", reading.ready),
            ("min", policy.min_replicas),
            ("max", policy.max_replicas),
            ("starting", max(0, current - reading.ready)),
        ):
            metrics.AUTOSCALER_REPLICAS.labels(namespace=namespace, name=name, kind=kind).set(value)
        if decision.memory.capacity_per_replica is not None:
            metrics.AUTOSCALER_CAPACITY.labels(namespace=namespace, name=name).set(decision.memory.capacity_per_replica)
        if reading.signals is not None and reading.signals.attainment is not None:
            metrics.AUTOSCALER_ATTAINMENT.labels(namespace=namespace, name=name).set(reading.signals.attainment)
        ahead = forecast(decision.memory, policy, self.period)
        for kind, rate in (
            ("observed", signals.arrival_rate if signals else None),
            ("smoothed", decision.memory.level),
            ("forecast", ahead),
        ):
            if rate is not None:
                metrics.AUTOSCALER_ARRIVAL.labels(namespace=namespace, name=name, kind=kind).set(rate)
        for kind, measured in _dispersion(signals, decision).items():
            metrics.AUTOSCALER_DISPERSION.labels(namespace=namespace, name=name, kind=kind).set(measured)
        return decision

    async def _write_replicas(
        self, body: dict[str, Any], svc: ServiceSpec, current: int, decision: Decision, event: bool = True
    ) -> None:
        meta = body["metadata"]
        path = owner_path(meta["namespace"], meta["name"])
        patch = {"spec": {"replicas": decision.desired}}
        try:
            await self.kube.request(
                "PATCH",
                path + "/scale",
                body=patch,
                query={"fieldManager": FIELD_MANAGER},
                content_type="application/merge-patch+json",
            )
        except ApiError as err:
            # API servers before 1.21 refuse the scale subresource of a custom resource whose spec.replicas
            # is unset; that first write sets it on the object itself, under the same field manager.
            if not (err.status == 500 and "does not exist" in err.message and svc.replicas is None):
                raise
            await self.kube.request(
                "PATCH",
                path,
                body=patch,
                query={"fieldManager": FIELD_MANAGER},
                content_type="application/merge-patch+json",
            )
        if not event:  # the caller names what changed (pool_loop.py)
            return
        verb = "ScaledUp" if decision.direction == UP else "ScaledDown"
        message = f"{current} → {decision.desired} replicas: {decision.reason}"
        logger.info("%s %s/%s %s", verb, meta["namespace"], meta["name"], message)
        metrics.AUTOSCALER_SCALE_EVENTS.labels(direction=decision.direction, reason=decision.cause).inc()
        await self.ctx.event(body, "Normal", verb, message)

    async def _write_status(
        self, body: dict[str, Any], svc: ServiceSpec, current: int, decision: Decision, reading: Reading
    ) -> None:
        meta = body["metadata"]
        before = body.get("status") or {}
        mode = svc.autoscaling.mode
        acting = mode == "goodput"
        autoscaler: dict[str, Any] = {
            "desiredReplicas": decision.desired,
            "currentReplicas": current,
            "readyReplicas": reading.ready,
            "message": decision.reason if acting else f"{mode} follows {DESIRED_METRIC}: {decision.reason}",
        }
        mu = decision.memory.capacity_per_replica
        if mu is not None:
            autoscaler["capacityPerReplica"] = round(mu, 3)
        clock = self.startups.get((svc.namespace, svc.name))
        if clock is not None and clock.seconds is not None:
            autoscaler["startupSeconds"] = round(clock.seconds, 1)
        dispersion = _dispersion(reading.signals, decision)
        if dispersion:
            autoscaler["dispersion"] = {kind: round(value, 2) for kind, value in dispersion.items()}
        if decision.desired != current and acting:
            autoscaler["lastDecision"] = {
                "time": now_timestamp(),
                "from": current,
                "to": decision.desired,
                "reason": decision.reason,
            }
        status: dict[str, Any] = {"autoscaler": autoscaler}
        s = reading.signals
        if s is not None:
            slo = {
                "window": f"{self.window:.0f}s",
                "goodputRequestsPerSecond": round(s.arrival_rate * (s.attainment or 0.0), 3),
                "attainment": None if s.attainment is None else round(s.attainment, 4),
                "ttftP90": None if s.ttft_p90 is None else round(s.ttft_p90, 4),
                "tpotP90": None if s.tpot_p90 is None else round(s.tpot_p90, 4),
            }
            status["slo"] = slo
        old = before.get("autoscaler") or {}
        if all(old.get(k) == v for k, v in autoscaler.items()) and status.get("slo") in (None, before.get("slo")):
            return
        await self.kube.patch_status(meta["namespace"], meta["name"], status)


def _dispersion(signals: Signals | None, decision: Decision) -> dict[str, float]:
    """What the loop exports and shows of the traffic's burstiness: the measured index of dispersion of
    arrivals and the peakedness the law planned with, once the counts are enough to say; the spread of
    request sizes once requests have finished."""
    out: dict[str, float] = {}
    if signals is not None and signals.dispersion is not None:
        out["arrivals"] = signals.dispersion
        out["peakedness"] = decision.memory.peakedness
    if signals is not None and signals.size_cv2 is not None:
        out["sizes"] = signals.size_cv2
    return out


def _forget_series(namespace: str, name: str) -> None:
    """A service gone from goodput mode leaves no stale gauges behind."""
    for gauge in (
        metrics.AUTOSCALER_DESIRED,
        metrics.AUTOSCALER_ATTAINMENT,
        metrics.AUTOSCALER_CAPACITY,
        metrics.AUTOSCALER_STARTUP,
    ):
        try:
            gauge.remove(namespace, name)
        except KeyError:
            pass
    for gauge, kinds in (
        (metrics.AUTOSCALER_REPLICAS, ("current", "ready", "starting", "min", "max")),
        (metrics.AUTOSCALER_ARRIVAL, ("observed", "smoothed", "forecast")),
        (metrics.AUTOSCALER_DISPERSION, ("arrivals", "peakedness", "sizes")),
    ):
        for kind in kinds:
            try:
                gauge.remove(namespace, name, kind)
            except KeyError:
                pass
