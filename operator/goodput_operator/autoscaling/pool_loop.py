"""The control loop's part for a disaggregated service (spec.disaggregation, autoscaling.mode goodput).

Per period: read each pool's ready pods (the Service `<name>` carries the decode role, `<name>-prefill`
the prefill role), decide both counts with pools.decide_pools, write the decode count to the
InferenceService's scale subresource as for any service and the prefill count to the `<name>-prefill`
Deployment's scale subresource, under the autoscaler's field manager; record status.autoscaler.pools,
an Event per change naming the pool and the term that decided, and, once requests have finished,
status.autoscaler.split: the split model's recommendation (split.py) for the observed length mix.

The pools are read from their pods directly (DirectSource) also where the autoscaler otherwise asks
Prometheus: both roles export the same series under the same model label, and only the EndpointSlices
tell the pools apart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from goodput_contract.api.spec import ServiceSpec
from goodput_operator import metrics
from goodput_operator.autoscaling import pool_metrics
from goodput_operator.autoscaling.gateway import GatewayView
from goodput_operator.autoscaling.law import Decision
from goodput_operator.autoscaling.policy import FIELD_MANAGER, WriteFailed, policy_for
from goodput_operator.autoscaling.pools import DECODE, PREFILL, PoolDecision, PoolMemory, PoolReading, decide_pools
from goodput_operator.autoscaling.sources import DirectSource, Reading, service_endpoints
from goodput_operator.autoscaling.split import Mix, Recommendation, StepModel, recommend, slo_class, slo_for
from goodput_operator.autoscaling.startup import StartupClock
from goodput_operator.autoscaling.state import Policy
from goodput_operator.k8s import ApiError

# `auto` below is the loop's Autoscaler (loop.py imports this module, so it is not named here): its kube
# client, window, ctx, pools, pool_source, _slice_version and _write_replicas are used
Autoscaler = Any
logger = logging.getLogger(__name__)
MIX_CHANGE = 0.2  # the split is recomputed when the observed mean lengths move this much


@dataclass
class PoolState:
    """What the loop keeps per disaggregated service between periods."""

    memories: dict[str, PoolMemory] = field(default_factory=dict)
    startups: dict[str, StartupClock] = field(default_factory=lambda: {PREFILL: StartupClock(), DECODE: StartupClock()})
    handoff: float | None = None  # the hand-off's last measured mean seconds
    mix: tuple[float, float] | None = None  # (prompt, output) mean tokens the split was computed for
    split: dict[str, Any] | None = None


def prefill_name(name: str) -> str:
    return f"{name}-prefill"


def _deployment_scale_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/deployments/{prefill_name(name)}/scale"


def pool_policies(base: Policy, svc: ServiceSpec) -> dict[str, Policy]:
    dis = svc.disaggregation
    assert dis is not None
    return {
        role: replace(base, min_replicas=pool.min_replicas, max_replicas=pool.max_replicas, batch_max_replicas=0)
        for role, pool in ((PREFILL, dis.prefill), (DECODE, dis.decode))
    }


def _pool_reading(pool: str, current: int, reading: Reading) -> PoolReading:
    s = reading.signals
    if s is None:
        return PoolReading(current, reading.ready, None, missing=reading.missing)
    within = s.ttft_within if pool == PREFILL else s.tpot_within
    rate = (s.prompt_tokens_rate if pool == PREFILL else s.output_tokens_rate) or 0.0
    per_request = rate / s.arrival_rate if s.arrival_rate > 0 and rate > 0 else None
    # the pool's own target decides its attainment; no long window: the law's long check is end to end
    signals = replace(s, attainment=within if within is not None else s.attainment, attainment_long=None)
    return PoolReading(current, reading.ready, signals, rate, per_request)


async def _prefill_current(auto: Autoscaler, namespace: str, name: str) -> int | None:
    """The prefill Deployment's replicas, None while it does not exist yet (the reconcile makes it)."""
    try:
        scale = await auto.kube.request("GET", _deployment_scale_path(namespace, name))
    except ApiError as err:
        if err.status == 404:
            return None
        raise
    return int((scale.get("spec") or {}).get("replicas") or 0)


def _observed_mix(state: PoolState, prefill: Reading, decode: Reading) -> tuple[float, float] | None:
    d, p = decode.signals, prefill.signals
    if d is None or not d.finished or d.arrival_rate <= 0 or not d.output_tokens_rate:
        return None
    prompt_rate = max((p.prompt_tokens_rate or 0.0) if p else 0.0, d.prompt_tokens_rate or 0.0)
    if prompt_rate <= 0:
        return None
    return prompt_rate / d.arrival_rate, d.output_tokens_rate / d.arrival_rate


async def _split(state: PoolState, mix: tuple[float, float] | None, svc: ServiceSpec) -> dict[str, Any] | None:
    """The split model's recommendation for the observed mix, recomputed only when the mix moved: on the
    committed profile, with targets of the class the service's own SLO is shaped like (split.slo_class)."""
    if mix is None:
        return state.split
    if state.mix is not None and all(abs(a - b) <= MIX_CHANGE * b for a, b in zip(mix, state.mix, strict=True)):
        return state.split
    model = StepModel.reference()
    observed = Mix.fixed("observed", max(1, round(mix[0])), max(1, round(mix[1])))
    klass = slo_class(svc.slo.ttft_seconds, svc.slo.tpot_seconds)
    slo = slo_for(model, observed, klass)
    r: Recommendation = await asyncio.to_thread(recommend, model, observed, slo)
    state.mix, state.split = mix, {**r.as_dict(), "sloClass": klass, "profile": StepModel.reference_machine()}
    return state.split


async def scale_pools(auto: Autoscaler, body: dict[str, Any], svc: ServiceSpec, gateway: GatewayView | None) -> None:
    namespace, name = svc.namespace, svc.name
    key = (namespace, name)
    state = auto.pools.setdefault(key, PoolState())
    base, _ = policy_for(svc)
    policies = pool_policies(replace(base, window_seconds=auto.window, dispersion=auto.dispersion), svc)
    if auto._slice_version is None:
        from goodput_operator.autoscaling.sources import endpoint_slice_version

        auto._slice_version = await endpoint_slice_version(auto.kube)
    prefill_current = await _prefill_current(auto, namespace, name)
    if prefill_current is None:
        logger.info("Autoscaling %s/%s: waiting for the Deployment %s", namespace, name, prefill_name(name))
        return
    decode_current = svc.desired_replicas
    source = auto.pool_source
    assert source is not None  # made in Autoscaler.__post_init__
    now = time.monotonic()
    decode_eps = await service_endpoints(auto.kube, auto._slice_version, namespace, name)
    decode = await source.read(
        key, svc.model.served_name, decode_eps, now, engine=svc.engine.kind, slo=(None, svc.slo.tpot_seconds)
    )
    if decode.signals is not None and decode.signals.handoff_seconds is not None:
        state.handoff = decode.signals.handoff_seconds
    ttft = svc.slo.ttft_seconds
    net = None if ttft is None else max(0.0, ttft - (state.handoff or 0.0))
    prefill_eps = await service_endpoints(auto.kube, auto._slice_version, namespace, prefill_name(name))
    prefill = await source.read(
        (namespace, prefill_name(name)),
        svc.model.served_name,
        prefill_eps,
        now,
        engine=svc.engine.kind,
        slo=(net, None),
    )
    readings = {
        PREFILL: _pool_reading(PREFILL, prefill_current, prefill),
        DECODE: _pool_reading(DECODE, decode_current, decode),
    }
    for pool, reading in readings.items():
        startup = state.startups[pool].observe(now, reading.current, reading.ready)
        if startup is not None:
            policies[pool] = replace(policies[pool], startup_seconds=startup)
    held = gateway.held if gateway is not None else None
    decisions = decide_pools(policies, readings, state.memories, now, held)
    state.memories = {pool: d.memory for pool, d in decisions.items()}
    for pool, d in decisions.items():
        if d.desired == readings[pool].current:
            continue
        try:
            await _write_pool(auto, body, svc, pool, readings[pool].current, d)
        except Exception as err:
            metrics.AUTOSCALER_WRITE_ERRORS.labels(target="replicas").inc()
            raise WriteFailed(f"writing {d.desired} {pool} replicas failed: {err}") from err
    split = await _split(state, _observed_mix(state, prefill, decode), svc)
    try:
        await _write_status(auto, body, readings, decisions, split)
    except Exception as err:
        metrics.AUTOSCALER_WRITE_ERRORS.labels(target="status").inc()
        raise WriteFailed(f"writing status.autoscaler failed: {err}") from err
    metrics.AUTOSCALER_DESIRED.labels(namespace=namespace, name=name).set(decisions[DECODE].desired)
    for pool, d in decisions.items():
        pool_metrics.POOL_REPLICAS.labels(namespace=namespace, name=name, pool=pool, kind="desired").set(d.desired)
        pool_metrics.POOL_REPLICAS.labels(namespace=namespace, name=name, pool=pool, kind="ready").set(
            readings[pool].ready
        )
        if d.attainment is not None:
            pool_metrics.POOL_ATTAINMENT.labels(namespace=namespace, name=name, pool=pool).set(d.attainment)
        mu, unit = d.memory.memory.capacity_per_replica, d.memory.unit
        if mu is not None and unit:
            pool_metrics.POOL_CAPACITY.labels(namespace=namespace, name=name, pool=pool).set(mu * unit)
        pool_metrics.POOL_DEMAND.labels(namespace=namespace, name=name, pool=pool).set(readings[pool].token_rate)


async def _write_pool(
    auto: Autoscaler, body: dict[str, Any], svc: ServiceSpec, pool: str, current: int, d: PoolDecision
) -> None:
    message = f"{pool} pool: {current} → {d.desired} replicas ({d.term}): {d.reason}"
    verb = "ScaledUp" if d.desired > current else "ScaledDown"
    if pool == DECODE:  # the InferenceService's scale subresource, as for any service
        decision = Decision(d.desired, d.direction, d.term, message, d.memory.memory)
        await auto._write_replicas(body, svc, current, decision, event=False)
    else:
        await auto.kube.request(
            "PATCH",
            _deployment_scale_path(svc.namespace, svc.name),
            body={"spec": {"replicas": d.desired}},
            query={"fieldManager": FIELD_MANAGER},
            content_type="application/merge-patch+json",
        )
    logger.info("%s %s/%s %s", verb, svc.namespace, svc.name, message)
    metrics.AUTOSCALER_SCALE_EVENTS.labels(direction="up" if d.desired > current else "down", reason=d.term).inc()
    await auto.ctx.event(body, "Normal", verb, message)


async def _write_status(
    auto: Autoscaler,
    body: dict[str, Any],
    readings: dict[str, PoolReading],
    decisions: dict[str, PoolDecision],
    split: dict[str, Any] | None,
) -> None:
    meta = body["metadata"]
    pools = {
        pool: {
            "desiredReplicas": d.desired,
            "term": d.term,
            **({} if d.attainment is None else {"attainment": round(d.attainment, 4)}),
        }
        for pool, d in decisions.items()
    }
    decode = decisions[DECODE]
    autoscaler: dict[str, Any] = {
        "desiredReplicas": decode.desired,
        "currentReplicas": readings[DECODE].current,
        "readyReplicas": readings[DECODE].ready,
        "message": "; ".join(f"{pool} pool ({d.term}): {d.reason}" for pool, d in decisions.items()),
        "pools": pools,
    }
    if split is not None:
        autoscaler["split"] = split
    status: dict[str, Any] = {"autoscaler": autoscaler}
    s = readings[DECODE].signals
    if s is not None:
        status["slo"] = {
            "window": f"{auto.window:.0f}s",
            "attainment": None if s.attainment is None else round(s.attainment, 4),
            "ttftP90": None if s.ttft_p90 is None else round(s.ttft_p90, 4),
            "tpotP90": None if s.tpot_p90 is None else round(s.tpot_p90, 4),
        }
    before = body.get("status") or {}
    old = before.get("autoscaler") or {}
    if all(old.get(k) == v for k, v in autoscaler.items()) and status.get("slo") in (None, before.get("slo")):
        return
    await auto.kube.patch_status(meta["namespace"], meta["name"], status)


def pool_source(window: float) -> DirectSource:
    return DirectSource(window, window * 5)
