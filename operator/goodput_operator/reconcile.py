"""One level-based pass: parse spec → build desired children → apply → observe → write status."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from goodput_contract.api.spec import ServiceSpec, SpecError, parse
from goodput_operator import builders, engines, metrics, node_caches, observed, pods, reconcile_roles, roles
from goodput_operator.conditions import (
    AVAILABLE,
    FALSE,
    MODEL_FITS,
    TRUE,
    VALID,
    Condition,
    derive_kstatus,
    derive_ready,
    find,
    merge,
)
from goodput_operator.context import Context
from goodput_operator.desired import desired_children, owned_by
from goodput_operator.k8s import ApiError, now_timestamp, owner_path, resource_path
from goodput_operator.model_fit import Fit, model_fit
from goodput_operator.workqueue import CHANGE, SIDE, TRIGGERS

logger = logging.getLogger(__name__)


async def reconcile_by_name(ctx: Context, namespace: str, name: str, priority: int = SIDE) -> None:
    """Reconcile the service as its watch last delivered it (after a child or a fetch changed); read from
    the server only when the watch has not delivered it yet."""
    body = ctx.observed.service(namespace, name)
    if body is None:
        async with ctx.slots.hold(priority):
            body = await ctx.kube.get(owner_path(namespace, name))
    if body is not None and not body["metadata"].get("deletionTimestamp"):
        await reconcile(ctx, body, priority)


async def reconcile(ctx: Context, body: dict[str, Any], priority: int = CHANGE) -> None:
    """One pass for the service; `priority` orders it among the passes waiting for a slot (workqueue.Slots)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    async with ctx.lock(namespace, name), ctx.slots.hold(priority):
        newer = ctx.observed.service(namespace, name)  # the watch delivered a later copy while this pass waited
        if (
            newer is not None
            and newer["metadata"].get("uid") == meta.get("uid")
            and observed.version(newer) > observed.version(body)
        ):
            body, meta = newer, newer["metadata"]
        started = time.monotonic()
        trigger = metrics.TRIGGER.set(TRIGGERS[priority])
        try:
            result = await _reconcile(ctx, body)
        except Exception as err:
            if not (isinstance(err, ApiError) and err.namespace_going):
                metrics.RECONCILES.labels(result="error").inc()
                metrics.RECONCILE_ERRORS.labels(reason=type(err).__name__).inc()
                raise
            logger.debug("Skipped %s/%s: its namespace is being deleted", namespace, name)
            result = "skipped"
        finally:
            metrics.TRIGGER.reset(trigger)
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        metrics.RECONCILES.labels(result=result).inc()
        ctx.handled[(namespace, name)] = meta.get("generation", 1)


async def _reconcile(ctx: Context, body: dict[str, Any]) -> str:
    meta = body["metadata"]
    namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation", 1)
    before = body.get("status") or {}  # the status this pass started from, read here only
    old = before.get("conditions")
    fit: Fit | None = None
    try:
        svc = parse(name, namespace, body.get("spec") or {})
        engines.validate(svc)
        _check_shape(svc)
        await node_caches.check(ctx.node_caches, ctx.kube, svc)
        fit = await model_fit(ctx, svc)
        if fit.invalid:
            raise fit.invalid
        owner = builders.owner_reference(name, meta["uid"])
        desired, unwanted = await desired_children(ctx, svc, owner)
    except SpecError as err:
        await _refuse(ctx, body, before, err, generation, fit.condition if fit else None)
        return "invalid"

    prefill: dict[str, Any] | None = None
    try:
        await reconcile_roles.settle_prefill_replicas(ctx, svc, owner["uid"], applied=False)
        deployment, prefill = await _apply_children(ctx, body, desired, unwanted, svc, owner)
        await reconcile_roles.settle_prefill_replicas(ctx, svc, owner["uid"], applied=True)
    except ChildConflict as err:
        deployment = {"kind": "Deployment"}
        available = Condition(AVAILABLE, FALSE, "ChildConflict", str(err))
        if (find(old, AVAILABLE) or {}).get("reason") != "ChildConflict":
            await ctx.event(body, "Warning", "ChildConflict", str(err))
        failure = None
    else:
        failure = pods.failure(ctx.observed.pods(namespace, svc.name))
        available = (
            Condition(AVAILABLE, FALSE, "Suspended", "spec.suspend is true: held at zero replicas until it is cleared")
            if svc.suspend
            else reconcile_roles.with_prefill(_available(deployment, svc.desired_replicas, failure), svc, prefill)
        )
    conditions = [Condition(VALID, TRUE, "SpecValid", "the spec is valid"), fit.condition, available]
    conditions.append(derive_ready(conditions))
    dstatus = deployment.get("status") or {}
    wanted = 0 if svc.suspend else svc.desired_replicas
    conditions += derive_kstatus(conditions, dstatus.get("replicas", 0), dstatus.get("readyReplicas", 0), wanted)
    status = {
        "observedGeneration": generation,
        "replicas": dstatus.get("replicas", 0),
        "readyReplicas": dstatus.get("readyReplicas", 0),
        "selector": builders.selector_string(svc),
        "url": builders.service_url(svc),
        "placement": builders.placement(svc, deployment.get("kind") == "LeaderWorkerSet"),
        "capacity": fit.capacity,
        "disaggregation": reconcile_roles.disaggregation_status(svc, deployment, prefill),
        "conditions": merge(old, conditions, generation, now_timestamp()),
    }
    if fit.capacity is not None and "pools" not in fit.capacity and "pools" in (before.get("capacity") or {}):
        status["capacity"] = {**fit.capacity, "pools": None}  # a merge patch keeps what it does not name
    if status["disaggregation"] is None and "disaggregation" not in before:
        del status["disaggregation"]
    await _write_status(ctx, body, before, status)
    if fit.condition.status == FALSE and _flipped(old, MODEL_FITS, FALSE):
        await ctx.event(body, "Warning", fit.condition.reason, fit.condition.message)
    if available.reason != "ChildConflict":
        await _report_failure(ctx, body, failure, old)
    return "ok"


async def _report_failure(
    ctx: Context, body: dict[str, Any], failure: pods.Failure | None, old: list[dict[str, Any]] | None
) -> None:
    """One Warning Event per distinct pod failure, not one per reconcile.

    Remembered in memory; after an operator restart the Available condition stands in
    for the memory (it already tells the failure when its message holds every part).
    """
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    if failure is None:
        ctx.reported_failures.pop(key, None)
        return
    if key in ctx.reported_failures:
        if ctx.reported_failures[key] == failure.key:
            return
    else:
        available = find(old, AVAILABLE) or {}
        if all(part in (available.get("message") or "") for part in failure.detail):
            ctx.reported_failures[key] = failure.key
            return
    ctx.reported_failures[key] = failure.key
    logger.warning("%s/%s: %s: %s", key[0], key[1], failure.reason, failure.message)
    metrics.RUNTIME_FAILURES.labels(reason=failure.reason).inc()
    await ctx.event(body, "Warning", failure.reason, failure.message)


async def _refuse(
    ctx: Context, body: dict[str, Any], before: dict[str, Any], err: SpecError, generation: int, fits: Condition | None
) -> None:
    """Report an invalid spec, and the model's fit where it was worked out; children stay as they are."""
    conditions = [Condition(VALID, FALSE, err.reason, str(err))]
    if fits is not None:
        conditions.append(fits)
    conditions.append(derive_ready(conditions))
    conditions += derive_kstatus(conditions, 0, 0, 0)
    old = before.get("conditions")
    status = {"observedGeneration": generation, "conditions": merge(old, conditions, generation, now_timestamp())}
    valid = find(old, VALID)
    if valid is None or valid.get("status") != FALSE or valid.get("message") != str(err):
        logger.warning("Invalid spec of %s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], err)
        await ctx.event(body, "Warning", "Invalid", str(err))
    await _write_status(ctx, body, before, status)
    # a fit problem that is itself the invalidity was just posted as Invalid
    if fits is not None and fits.status == FALSE and fits.reason != err.reason and _flipped(old, MODEL_FITS, FALSE):
        await ctx.event(body, "Warning", fits.reason, fits.message)


def _check_shape(svc: ServiceSpec) -> None:
    """Pipeline stages and replicas spanning pods are the goodput runtime's alone."""
    if svc.engine.kind == engines.GOODPUT:
        return
    for field, used in (("parallelism.pipeline", svc.pipeline_parallel > 1), ("parallelism.nodes", svc.multi_node)):
        if used:
            raise SpecError(
                field,
                f"cannot be honoured by engine.kind {svc.engine.kind}: only the goodput runtime runs pipeline "
                "stages and replicas spanning pods",
                reason="EngineUnsupportedField",
            )


def _flipped(old: list[dict[str, Any]] | None, type_: str, status: str) -> bool:
    before = find(old, type_)
    return before is None or before.get("status") != status


async def _apply_children(
    ctx: Context,
    body: dict[str, Any],
    desired: list[dict[str, Any]],
    unwanted: list[str],
    svc: ServiceSpec,
    owner: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Apply every desired child; remove the ones no longer wanted; return the live Deployment, or for
    replicas spanning pods, what stands for it: a status of groups (replicas, readyReplicas) made from the
    StatefulSets, or the live LeaderWorkerSet; and the live prefill Deployment of a disaggregated service."""

    # Look before writing anything: a name held by someone else's object stops the whole pass.
    # The watches' copy when they delivered one; else the server's (absent or predating the watch).
    # The reads, and then the writes, go out together: a pass waits for one round trip of each, not one per child.
    async def look(manifest: dict[str, Any]) -> dict[str, Any] | None:
        meta = manifest["metadata"]
        live = ctx.observed.child(manifest["kind"], svc.namespace, meta["name"])
        if live is None:  # the watches hold every child of ours they have seen, so this is mostly a new one
            live = await ctx.kube.get(
                resource_path(manifest["apiVersion"], manifest["kind"], svc.namespace, meta["name"]), any_version=True
            )
        return live

    lives = await asyncio.gather(*(look(manifest) for manifest in desired))
    for manifest, live in zip(desired, lives, strict=True):
        if live is not None and not owned_by(live, owner["uid"]):
            raise ChildConflict(
                f"{manifest['kind']} {manifest['metadata']['name']} already exists and is not owned by this "
                "service; delete it or rename the service"
            )

    deployment: dict[str, Any] = {}
    prefill: dict[str, Any] | None = None
    groups: list[dict[str, Any]] = []
    written: dict[str, list[str]] = {}  # verb -> "Kind name" of each child written, one Event per verb
    # A child that lost its role (spec.disaggregation removed) must be applied although the manifest is a
    # subset of it: the apply is what drops the role from its labels and selector.
    roleless = [roles.lost_role(manifest, live) for manifest, live in zip(desired, lives, strict=True)]
    applied = await asyncio.gather(
        *(
            ctx.kube.apply(manifest, None if lost else live)
            for manifest, live, lost in zip(desired, lives, roleless, strict=True)
        )
    )
    for manifest, (action, current), lost in zip(desired, applied, roleless, strict=True):
        meta = manifest["metadata"]
        action = "updated" if lost else action
        if action != "unchanged":
            ctx.observed.remember(current)
            ctx.observed.mark_absent(
                resource_path(manifest["apiVersion"], manifest["kind"], svc.namespace, meta["name"]), absent=False
            )
            metrics.CHILD_WRITES.labels(kind=manifest["kind"], action=action).inc()
            verb = action.capitalize()
            written.setdefault(verb, []).append(f"{manifest['kind']} {meta['name']}")
        if manifest["kind"] == "Deployment" and meta["name"] == roles.prefill_name(svc):
            prefill = current
        elif (manifest["kind"] == "Deployment" and not svc.multi_node) or manifest["kind"] == "LeaderWorkerSet":
            deployment = current
        elif manifest["kind"] == "StatefulSet":
            groups.append(current)
    # only a pass of ours creates an owned optional child, and a service without status never had one
    never_reconciled = not body.get("status")
    for path in unwanted:
        if never_reconciled:
            ctx.observed.mark_absent(path)
        if ctx.observed.known_absent(path):
            continue
        live = await ctx.kube.get(path)
        if live is None:
            ctx.observed.mark_absent(path)
        elif owned_by(live, owner["uid"]) and await ctx.kube.delete(path):
            kind, child = live["kind"], live["metadata"]["name"]
            ctx.observed.forget(kind, svc.namespace, child)
            ctx.observed.mark_absent(path)
            written.setdefault("Deleted", []).append(f"{kind} {child}")
    for verb, children in written.items():  # one log line and one Event per verb, however many children
        logger.info("%s/%s: %s %s", svc.namespace, svc.name, verb, ", ".join(children))
        await ctx.event(body, "Normal", verb, f"{verb} {', '.join(children)}")
    if svc.multi_node and deployment.get("kind") != "LeaderWorkerSet":
        deployment = {"kind": "StatefulSet", "status": _group_status(groups)}
    return deployment, prefill


def _group_status(groups: list[dict[str, Any]]) -> dict[str, int]:
    """Replicas (groups with pods) and ready replicas (groups whose leader is ready: a worker pod is
    never ready, and the leader only once every rank of the group has joined, so a group serves whole)."""
    live = [g for g in groups if (g.get("spec") or {}).get("replicas", 0) > 0]
    ready = [g for g in live if (g.get("status") or {}).get("readyReplicas", 0) >= 1]
    return {"replicas": len(live), "readyReplicas": len(ready)}


class ChildConflict(Exception):
    """A child's name is taken by an object this service does not own."""


def _available(deployment: dict[str, Any], desired: int, failure: pods.Failure | None = None) -> Condition:
    """Whether pods serve; when none does and a pod fails, why (RuntimeFailing, ImagePullFailed, ...).

    With some replicas serving, a failing pod (a rollout to a broken spec, one bad node)
    is named in the message while the service stays Available.
    """
    status = deployment.get("status") or {}
    ready = status.get("readyReplicas", 0)
    counts = f"{ready}/{desired} replicas ready"
    if desired == 0:
        return Condition(AVAILABLE, FALSE, "ScaledToZero", "spec.replicas is 0")
    if failure is not None and ready == 0:
        return Condition(AVAILABLE, FALSE, failure.reason, failure.message)
    also = f"; {failure.message}" if failure is not None else ""
    conditions = status.get("conditions") or ()
    progressing: dict[str, Any] = next((c for c in conditions if c.get("type") == "Progressing"), {})
    if progressing.get("reason") == "ProgressDeadlineExceeded":
        return Condition(
            AVAILABLE, FALSE, "ProgressDeadlineExceeded", f"{counts}; {progressing.get('message', '')}{also}"
        )
    if ready >= 1:
        return Condition(AVAILABLE, TRUE, "MinimumReplicasAvailable", counts + also)
    return Condition(AVAILABLE, FALSE, "ReplicasNotReady", counts)


async def _write_status(ctx: Context, body: dict[str, Any], before: dict[str, Any], status: dict[str, Any]) -> None:
    """Patch status only where it differs from `before`, so an unchanged service sees no writes."""
    if all(before.get(key) == value for key, value in status.items()):
        return
    meta = body["metadata"]
    current = await ctx.kube.patch_status(meta["namespace"], meta["name"], status)
    if current:
        ctx.observed.service_event(None, current)
