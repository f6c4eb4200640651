"""InferencePipeline status: Valid (the checks the schema cannot make) and Ready (every service it calls is).

The operator creates nothing for a pipeline (the gateway serves it); it only keeps the
status current: on the pipeline's own changes, and whenever an InferenceService in its
namespace changes, since a service appearing, going or turning Ready flips Ready.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from goodput_operator import conditions
from goodput_operator.conditions import FALSE, READY, TRUE, VALID, Condition
from goodput_operator.context import Context
from goodput_operator.k8s import ApiError, now_timestamp, owner_path
from goodput_operator.pipeline_spec import PipelineSpec, SpecError, parse_pipeline
from goodput_operator.settings import GROUP, PLURAL, VERSION

logger = logging.getLogger(__name__)
PIPELINES = "inferencepipelines"


def pipeline_path(namespace: str, name: str | None = None) -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PIPELINES}"
    return f"{base}/{name}" if name else base


def service_ready(service: dict[str, Any] | None) -> tuple[bool, str]:
    """(Ready, why not) for one InferenceService as the API server holds it (None: absent)."""
    if service is None:
        return False, "does not exist"
    ready = conditions.find((service.get("status") or {}).get("conditions"), READY)
    if ready is None:
        return False, "has no status yet"
    if ready.get("status") != TRUE:
        return False, f"is not Ready ({ready.get('reason') or 'Unknown'}: {ready.get('message') or ''})".replace(
            ": )", ")")
    return True, ""


def pipeline_conditions(spec: PipelineSpec | SpecError,
                        services: dict[str, dict[str, Any] | None]) -> tuple[list[Condition], list[dict[str, Any]]]:
    """Pure: the conditions and the per-service list, from the parsed spec and the services it names."""
    if isinstance(spec, SpecError):
        return [Condition(VALID, FALSE, spec.reason, str(spec)),
                Condition(READY, FALSE, spec.reason, "the spec is not valid")], []
    listed, missing, waiting = [], [], []
    for name in spec.services:
        ready, why = service_ready(services.get(name))
        listed.append({"name": name, "ready": ready})
        if services.get(name) is None:
            missing.append(name)
        elif not ready:
            waiting.append(f"InferenceService '{name}' {why}")
    valid = Condition(VALID, TRUE, "Valid", f"{len(spec.steps)} steps")
    if missing:
        names = ", ".join(f"'{n}'" for n in missing)
        noun = "InferenceService" if len(missing) == 1 else "InferenceServices"
        return [valid, Condition(READY, FALSE, "ServiceNotFound", f"{noun} {names} not found")], listed
    if waiting:
        return [valid, Condition(READY, FALSE, "ServiceNotReady", "; ".join(waiting))], listed
    return [valid, Condition(READY, TRUE, "Serving", f"every service is Ready: {', '.join(spec.services)}")], listed


async def reconcile_pipeline(ctx: Context, body: dict[str, Any]) -> None:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    try:
        spec: PipelineSpec | SpecError = parse_pipeline(name, namespace, body.get("spec") or {})
    except SpecError as err:
        spec = err
    services: dict[str, dict[str, Any] | None] = {}
    if isinstance(spec, PipelineSpec):
        for service in spec.services:
            services[service] = await ctx.kube.get(owner_path(namespace, service))
    current, listed = pipeline_conditions(spec, services)
    status = body.get("status") or {}
    generation = int(meta.get("generation") or 0)
    merged = conditions.merge(status.get("conditions"), current, generation, now_timestamp())
    new: dict[str, Any] = {"observedGeneration": generation, "conditions": merged, "services": listed}
    if isinstance(spec, PipelineSpec):
        new["steps"] = spec.summary
    if all(status.get(k) == v for k, v in new.items()):
        return
    await ctx.kube.request("PATCH", pipeline_path(namespace, name) + "/status", body={"status": new},
                           content_type="application/merge-patch+json")
    ready = conditions.find(merged, READY) or {}
    logger.info("InferencePipeline %s/%s: Ready=%s (%s)", namespace, name, ready.get("status"), ready.get("message"))


async def reconcile_namespace(ctx: Context, namespace: str, service: str) -> None:
    """Every pipeline in the namespace that calls `service`."""
    listing = await ctx.kube.request("GET", pipeline_path(namespace))
    for item in (listing or {}).get("items") or ():
        try:
            spec = parse_pipeline(item["metadata"]["name"], namespace, item.get("spec") or {})
        except SpecError:
            continue
        if service in spec.services:
            await reconcile_pipeline(ctx, item)


def register(registry: kopf.OperatorRegistry) -> None:
    @kopf.on.resume(GROUP, VERSION, PIPELINES, id="pipeline", registry=registry)
    @kopf.on.create(GROUP, VERSION, PIPELINES, id="pipeline", registry=registry)
    @kopf.on.update(GROUP, VERSION, PIPELINES, id="pipeline", registry=registry)
    async def pipeline_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        await reconcile_pipeline(memo.ctx, {"metadata": dict(body.metadata), "spec": dict(body.spec),
                                            "status": dict(body.status)})

    @kopf.on.event(GROUP, VERSION, PLURAL, id="pipelines-of-service", registry=registry)
    async def service_event(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        namespace, name = body.metadata.namespace, body.metadata.name
        if not namespace or not name or getattr(memo, "ctx", None) is None:
            return
        try:
            await reconcile_namespace(memo.ctx, namespace, name)
        except ApiError as err:
            if err.status != 404 and not err.namespace_going:  # 404: the CRD is not installed
                logger.warning("Updating pipelines that call %s/%s failed: %s", namespace, name, err)
