"""The controller behind the kopf handlers: which event calls for a pass, and the work that runs passes.

A service's own event starts a pass when its generation moved (or it is seen for the first time);
a failed pass is queued again after RETRY_BACKOFF_SECONDS. Child, pod and config-fetch events put
the service on the side queue, which SIDE_WORKERS workers drain; the resync passes over every
service now and then. Every path ends in reconcile.py's one pass, ordered by workqueue.py's
priorities. Sized for thousands of services: see docs/operator.md, "At scale".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from goodput_contract.api import GROUP, KIND
from goodput_operator import metrics, pipelines
from goodput_operator.builders import SERVICE_LABEL
from goodput_operator.context import Context
from goodput_operator.k8s import ApiError, owner_collection, parse_timestamp
from goodput_operator.reconcile import reconcile, reconcile_by_name
from goodput_operator.workqueue import CHANGE, RESUME, RESYNC

logger = logging.getLogger(__name__)
RETRY_BACKOFF_SECONDS = 5.0
# reconciles for side triggers (a child or pod changed, a config fetched) run this many at a time
SIDE_WORKERS = 4


def start(ctx: Context) -> list[asyncio.Task[None]]:
    """The side-queue workers and the resync, running until cancelled."""
    workers = [asyncio.create_task(side_reconciles(ctx), name=f"side-{i}") for i in range(SIDE_WORKERS)]
    return [asyncio.create_task(resync_forever(ctx), name="resync"), *workers]


async def service_event(
    ctx: Context, event_type: str | None, obj: dict[str, Any], tasks: set[asyncio.Task[None]]
) -> None:
    """A service's watch event: remembered, passed on to the pipelines that call it, and a pass when one is
    needed (its retry, if it fails, joins `tasks`)."""
    ctx.observed.service_event(event_type, obj)
    try:
        await pipelines.service_event(ctx, event_type, obj)
    except ApiError as err:
        if err.status != 404 and not err.namespace_going:  # 404: the pipeline CRD is not installed
            meta = obj.get("metadata") or {}
            logger.warning(
                "Updating the pipelines that call %s/%s failed: %s", meta.get("namespace"), meta.get("name"), err
            )
    priority = pass_needed(ctx, event_type, obj)
    if priority is not None:
        await reconcile_or_retry(ctx, obj, priority, tasks)


def child_event(ctx: Context, event_type: str | None, obj: dict[str, Any]) -> None:
    """An owned child's watch event: remembered, and its owner queued as a side trigger."""
    owner = _owner_of(obj)
    if owner is not None:
        ctx.observed.child_event(event_type, obj)
        ctx.side.add(*owner)


def pod_event(ctx: Context, event_type: str | None, obj: dict[str, Any]) -> None:
    """A runtime pod's watch event: remembered, and the service its label names queued as a side trigger.
    Pods belong to ReplicaSets, not to the service."""
    meta = obj.get("metadata") or {}
    service = (meta.get("labels") or {}).get(SERVICE_LABEL)
    if service and meta.get("namespace"):
        ctx.observed.pod_event(event_type, obj, service)
        ctx.side.add(meta["namespace"], service)


def reconcile_soon(ctx: Context, services: Iterable[tuple[str, str]]) -> None:
    """Queue each (namespace, name) as a side trigger (a config they waited for was fetched)."""
    for namespace, name in services:
        ctx.side.add(namespace, name)


def pass_needed(ctx: Context, event_type: str | None, obj: dict[str, Any]) -> int | None:
    """The priority of the pass a service's event calls for, or None (a status write, a pass already made).

    Seen for the first time since start-up: a pass, as backlog when the service predates the start
    (a service created or changed since goes ahead of them). Then a pass each time the generation
    moves past the last one a pass completed."""
    meta = obj.get("metadata") or {}
    key = (meta.get("namespace", ""), meta.get("name", ""))
    if event_type == "DELETED" or meta.get("deletionTimestamp"):
        ctx.handled.pop(key, None)
        return None
    if key not in ctx.handled:
        return RESUME if _created_before(obj, ctx) else CHANGE
    return CHANGE if ctx.handled[key] != meta.get("generation", 1) else None


async def reconcile_or_retry(ctx: Context, obj: dict[str, Any], priority: int, tasks: set[asyncio.Task[None]]) -> None:
    """A pass; a failed one is logged and queued again after RETRY_BACKOFF_SECONDS (the resync also retries)."""
    meta = obj["metadata"]
    try:
        await reconcile(ctx, obj, priority)
        if priority == RESUME:
            logger.info("Resumed %s/%s: its children and status checked", meta["namespace"], meta["name"])
    except Exception as err:
        if isinstance(err, ApiError) and err.namespace_going:
            return
        logger.warning(
            "Reconciling %s/%s failed, retrying in %.0f s: %s",
            meta["namespace"],
            meta["name"],
            RETRY_BACKOFF_SECONDS,
            err,
        )

        async def later() -> None:
            await asyncio.sleep(RETRY_BACKOFF_SECONDS)
            ctx.side.add(meta["namespace"], meta["name"])

        task = asyncio.create_task(later())
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def side_reconciles(ctx: Context) -> None:
    """Reconcile services a side trigger named, each once however many triggers named it meanwhile."""
    while True:
        namespace, name = await ctx.side.next()
        await _quietly(ctx, namespace, name)


async def resync_forever(ctx: Context) -> None:
    """Reconcile every service now and then, so nothing depends on a single missed event."""
    path = owner_collection(ctx.settings.namespace)
    while True:
        await asyncio.sleep(ctx.settings.resync_seconds)
        try:
            listing = await ctx.kube.request("GET", path)
        except Exception as err:
            logger.warning("Listing InferenceServices for resync failed: %s", err)
            continue
        started = time.monotonic()
        items = listing.get("items") or ()
        ctx.forget_failures_except({(i["metadata"]["namespace"], i["metadata"]["name"]) for i in items})
        for item in items:
            await asyncio.sleep(0)  # an unchanged service makes no API call: let other work in between
            if not item["metadata"].get("deletionTimestamp"):
                try:
                    await reconcile(ctx, item, RESYNC)
                except Exception as err:
                    meta = item["metadata"]
                    logger.warning("Resync of %s/%s failed: %s", meta["namespace"], meta["name"], err)
        metrics.RESYNCS.inc()
        metrics.RESYNC_SECONDS.set(time.monotonic() - started)


async def _quietly(ctx: Context, namespace: str, name: str) -> None:
    """Reconcile for a side trigger; failures are logged and left to the next resync."""
    try:
        await reconcile_by_name(ctx, namespace, name)
    except ApiError as err:
        if not err.namespace_going:
            logger.warning("Reconciling %s/%s failed, will retry on resync: %s", namespace, name, err)
    except Exception as err:
        logger.warning("Reconciling %s/%s failed, will retry on resync: %s", namespace, name, err)


def _owner_of(child: Any) -> tuple[str, str] | None:
    for ref in child.get("metadata", {}).get("ownerReferences") or ():
        if ref.get("kind") == KIND and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/"):
            return child["metadata"]["namespace"], ref["name"]
    return None


def _created_before(body: dict[str, Any], ctx: Context) -> bool:
    """Whether the service was created before the operator started (timestamps are whole seconds)."""
    stamp = body["metadata"].get("creationTimestamp")
    if not stamp:
        return False
    created = parse_timestamp(stamp).timestamp()
    return created < ctx.started_at - 1.0
