"""The kopf side of the operator: its settings, its login, and thin handlers that hand each event on: to
the controller (controller.py), where every trigger of a service ends in the same reconcile, or to
pipelines.py for InferencePipelines."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
from typing import Any

import kopf

from goodput_contract.api import GROUP, MODEL_CACHE_PLURAL, PIPELINE_KIND, PLURAL, VERSION
from goodput_operator import controller, lora_adapters, metrics, pipelines
from goodput_operator.autoscaling.loop import Autoscaler
from goodput_operator.builders import MANAGED_BY
from goodput_operator.context import Context
from goodput_operator.hub import ConfigFetcher
from goodput_operator.k8s import Kube, load_config
from goodput_operator.settings import Settings

logger = logging.getLogger(__name__)
OWNED = {"app.kubernetes.io/managed-by": MANAGED_BY}
CHILD_RESOURCES = (
    {"group": "apps", "version": "v1", "plural": "deployments"},
    {"group": "apps", "version": "v1", "plural": "statefulsets"},  # the groups of replicas spanning pods
    {"group": "", "version": "v1", "plural": "services"},
    {"group": "policy", "plural": "poddisruptionbudgets"},
)
# Runtime pods: their status says why a service does not serve (crash loop, image pull, scheduling).
POD_RESOURCE = {"group": "", "version": "v1", "plural": "pods"}


class PipelinesDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf builds the diff base of every object on every event it sees, a deep copy of the whole object
    (managed fields and status included). Only pipelines have change handlers that read it; every other
    object gets an empty one (the operator's most frequent work at scale, otherwise)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        if body.get("kind") not in (None, PIPELINE_KIND):
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


def in_cluster_server(default: str) -> str:
    """The API server as client-go finds it in a pod: from the Service environment variables,
    which need no cluster DNS (kopf's own guess is the DNS name kubernetes.default.svc)."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        return default
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def register(registry: kopf.OperatorRegistry, settings: Settings) -> None:
    """Attach the handlers to `registry` (one registry per operator instance)."""
    background: set[asyncio.Task[None]] = set()  # the controller's tasks and its retries

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
        background.clear()  # a run of kopf before this one (goodput_operator.__main__) left its tasks with its loop
        kube = Kube(load_config(), settings.field_manager, on_write=metrics.count_write)
        fetcher = ConfigFetcher(
            settings.hf_endpoint,
            settings.hub_timeout_seconds,
            on_ready=lambda waiters: controller.reconcile_soon(memo.ctx, waiters),
        )
        memo.ctx = Context(kube, settings, fetcher, instance=os.environ.get("POD_NAME") or socket.gethostname())
        # Plain loops rather than kopf timers: timers put a finalizer on every service.
        for task in (
            *controller.start(memo.ctx),
            asyncio.create_task(Autoscaler.from_context(memo.ctx).run_forever(), name="autoscaler"),
        ):
            background.add(task)
            task.add_done_callback(background.discard)
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
        if getattr(memo, "ctx", None) is not None:
            await controller.service_event(memo.ctx, event.get("type"), dict(event["object"]), background)

    for resource in CHILD_RESOURCES:

        @kopf.on.event(**resource, id="child", labels=OWNED, registry=registry)  # type: ignore[arg-type]
        async def child_changed(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
            if getattr(memo, "ctx", None) is not None:
                controller.child_event(memo.ctx, event.get("type"), dict(event["object"]))

    # An event handler only: kopf keeps no progress, diff base or finalizer on pods, so it
    # never writes to them (the role may not either).
    @kopf.on.event(**POD_RESOURCE, id="pod", labels=OWNED, registry=registry)  # type: ignore[arg-type]
    async def pod_changed(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
        if getattr(memo, "ctx", None) is not None:
            controller.pod_event(memo.ctx, event.get("type"), dict(event["object"]))

    pipelines.register(registry)
    lora_adapters.register(registry, settings)

    # ModelCaches: their specs kept (node_caches.py), and the services that named a changed one passed again
    @kopf.on.event(GROUP, VERSION, MODEL_CACHE_PLURAL, id="model-cache-watch", registry=registry)
    async def model_cache_watched(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
        ctx = getattr(memo, "ctx", None)
        if ctx is not None:
            controller.reconcile_soon(ctx, ctx.node_caches.event(event.get("type"), dict(event["object"])))
