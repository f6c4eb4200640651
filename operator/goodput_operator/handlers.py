"""Thin kopf handlers: every trigger ends in the same reconcile."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from datetime import datetime
from typing import Any

import kopf
import prometheus_client

from goodput_contract.api import GROUP, KIND, PLURAL, VERSION
from goodput_operator import metrics, pipelines
from goodput_operator.autoscaling.loop import Autoscaler
from goodput_operator.builders import MANAGED_BY, SERVICE_LABEL
from goodput_operator.context import CHANGE, RESUME, RESYNC, Context
from goodput_operator.hub import ConfigFetcher, Waiter
from goodput_operator.k8s import ApiError, Kube, load_config, owner_collection
from goodput_operator.reconcile import reconcile, reconcile_by_name
from goodput_operator.settings import Settings

logger = logging.getLogger(__name__)
OWNED = {"app.kubernetes.io/managed-by": MANAGED_BY}
CHILD_RESOURCES = (
    {"group": "apps", "version": "v1", "plural": "deployments"},
    {"group": "", "version": "v1", "plural": "services"},
    {"group": "policy", "plural": "poddisruptionbudgets"},
)
# Runtime pods: their status says why a service does not serve (crash loop, image pull, scheduling).
POD_RESOURCE = {"group": "", "version": "v1", "plural": "pods"}
RETRY_BACKOFF_SECONDS = 5.0
# reconciles for side triggers (a child or pod changed, a config fetched) run this many at a time
SIDE_WORKERS = 4


class PipelinesDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf builds the diff base of every object on every event it sees, a deep copy of the whole object
    (managed fields and status included). Only pipelines have change handlers that read it; every other
    object gets an empty one (the operator's most frequent work at scale, otherwise)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        if body.get("kind") not in (None, "InferencePipeline"):
            return kopf.BodyEssence()
        return super().build(body=body, extra_fields=extra_fields)


def operator_settings() -> kopf.OperatorSettings:
    """Kopf keeps its bookkeeping (for pipelines; services are level-based) in our own annotations and
    posts no events of its own."""
    settings = kopf.OperatorSettings()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = PipelinesDiffBase(prefix=GROUP)
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    # Children and pods are watched through a server-side label selector: only ours are listed and sent.
    selector = ",".join(f"{key}={value}" for key, value in OWNED.items())
    for resource in (*CHILD_RESOURCES, POD_RESOURCE):
        settings.watching.label_selectors[resource["group"], resource["plural"]] = selector
    return settings


def _owner_of(child: Any) -> tuple[str, str] | None:
    for ref in child.get("metadata", {}).get("ownerReferences") or ():
        if ref.get("kind") == KIND and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/"):
            return child["metadata"]["namespace"], ref["name"]
    return None


def in_cluster_server(default: str) -> str:
    """The API server as client-go finds it in a pod: from the Service environment variables,
    which need no cluster DNS (kopf's own guess is the DNS name kubernetes.default.svc)."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        return default
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def register(registry: kopf.OperatorRegistry, settings: Settings) -> None:
    """Attach the handlers to `registry` (one registry per operator instance)."""
    background: set[asyncio.Task[None]] = set()

    def reconcile_soon(ctx: Context, waiters: set[Waiter]) -> None:
        for namespace, name in waiters:
            ctx.side.add(namespace, name)

    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        """The same credentials as our own calls: in-cluster service account, else kubeconfig."""
        try:
            in_cluster = kopf.login_with_service_account(**kwargs)
            if in_cluster is not None:
                return dataclasses.replace(in_cluster, server=in_cluster_server(in_cluster.server))
            return kopf.login_with_kubeconfig(**kwargs)
        except kopf.LoginError:
            return None

    @kopf.on.startup(id="startup", registry=registry)
    async def startup(memo: kopf.Memo, **_: Any) -> None:
        kube = Kube(load_config(), settings.field_manager, on_write=metrics.count_write)
        fetcher = ConfigFetcher(
            settings.hf_endpoint,
            settings.hub_timeout_seconds,
            on_ready=lambda waiters: reconcile_soon(memo.ctx, waiters),
        )
        memo.ctx = Context(kube, settings, fetcher, instance=os.environ.get("POD_NAME") or socket.gethostname())
        # A plain loop rather than a kopf timer: timers put a finalizer on every service.
        workers = [asyncio.create_task(side_reconciles(memo.ctx), name=f"side-{i}") for i in range(SIDE_WORKERS)]
        for task in (
            asyncio.create_task(resync_forever(memo.ctx), name="resync"),
            asyncio.create_task(Autoscaler.from_context(memo.ctx).run_forever(), name="autoscaler"),
            *workers,
        ):
            background.add(task)
            task.add_done_callback(background.discard)
        if settings.metrics_port:
            prometheus_client.start_http_server(settings.metrics_port)
        scope = f"namespace {settings.namespace}" if settings.namespace else "all namespaces"
        logger.info("Watching InferenceServices in %s; runtime image %s", scope, settings.runtime_image)

    @kopf.on.cleanup(id="cleanup", registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        for task in list(background):
            task.cancel()
        if getattr(memo, "ctx", None) is not None:
            await memo.ctx.fetcher.close()

    # Level-based on the watch alone: a service gets a pass when this process first sees it and whenever
    # its generation (its spec) moves past the last one a pass completed. No kopf change handler, so
    # kopf keeps no diff base or progress on the services: no annotation write per service, and no
    # deep copy of every service on every event.
    @kopf.on.event(GROUP, VERSION, PLURAL, id="service-watch", registry=registry)
    async def service_watched(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
        ctx = getattr(memo, "ctx", None)
        if ctx is None:
            return
        type_ = event.get("type")
        obj: dict[str, Any] = dict(event["object"])
        ctx.observed.service_event(type_, obj)
        try:
            await pipelines.service_event(ctx, type_, obj)
        except ApiError as err:
            if err.status != 404 and not err.namespace_going:  # 404: the pipeline CRD is not installed
                meta = obj.get("metadata") or {}
                logger.warning(
                    "Updating the pipelines that call %s/%s failed: %s", meta.get("namespace"), meta.get("name"), err
                )
        priority = pass_needed(ctx, type_, obj)
        if priority is not None:
            await reconcile_or_retry(ctx, obj, priority, background)

    for resource in CHILD_RESOURCES:

        @kopf.on.event(**resource, id="child", labels=OWNED, registry=registry)  # type: ignore[arg-type]
        async def child_changed(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
            owner = _owner_of(body)
            if owner is not None and getattr(memo, "ctx", None) is not None:
                memo.ctx.observed.child_event(event.get("type"), event["object"])
                memo.ctx.side.add(*owner)

    # An event handler only: kopf keeps no progress, diff base or finalizer on pods, so it
    # never writes to them (the role may not either). Pods belong to ReplicaSets, not to the
    # service; the service label names it.
    @kopf.on.event(**POD_RESOURCE, id="pod", labels=OWNED, registry=registry)  # type: ignore[arg-type]
    async def pod_changed(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        service = body.metadata.labels.get(SERVICE_LABEL)
        if service and body.metadata.namespace and getattr(memo, "ctx", None) is not None:
            memo.ctx.observed.pod_event(event.get("type"), event["object"], service)
            memo.ctx.side.add(body.metadata.namespace, service)

    pipelines.register(registry)


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


def _created_before(body: dict[str, Any], ctx: Context) -> bool:
    """Whether the service was created before the operator started (timestamps are whole seconds)."""
    stamp = body["metadata"].get("creationTimestamp")
    if not stamp:
        return False
    created = datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    return created < ctx.started_at - 1.0
