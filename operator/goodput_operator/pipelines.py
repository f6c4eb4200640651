"""InferencePipeline status: Valid (the checks the schema cannot make) and Ready (every service it calls is).

The operator creates nothing for a pipeline (the gateway serves it); it only keeps the
status current: on the pipeline's own changes, and whenever an InferenceService in its
namespace changes readiness (appears, goes, turns Ready or not). Which services each pipeline
calls is kept from the pipeline watch, so every other service event costs no API call.

Pipelines take kopf's change handlers (resume, create, update), not the level-based path services
take through controller.py: they are few and get only a status, so kopf's diff base and retries
cost little here (docs/operator.md, "The reconcile", says why services differ).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from goodput_contract.api import GROUP, PIPELINE_PLURAL, VERSION
from goodput_contract.api.pipeline_spec import PipelineSpec, SpecError, parse_pipeline
from goodput_operator import conditions
from goodput_operator.conditions import FALSE, READY, TRUE, VALID, Condition
from goodput_operator.context import Context
from goodput_operator.k8s import now_timestamp, owner_path

logger = logging.getLogger(__name__)


def pipeline_path(namespace: str, name: str | None = None) -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PIPELINE_PLURAL}"
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
            ": )", ")"
        )
    return True, ""


def pipeline_conditions(
    spec: PipelineSpec | SpecError, services: dict[str, dict[str, Any] | None]
) -> tuple[list[Condition], list[dict[str, Any]]]:
    """Pure: the conditions and the per-service list, from the parsed spec and the services it names."""
    if isinstance(spec, SpecError):
        return [
            Condition(VALID, FALSE, spec.reason, str(spec)),
            Condition(READY, FALSE, spec.reason, "the spec is not valid"),
        ], []
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
    await ctx.kube.request(
        "PATCH",
        pipeline_path(namespace, name) + "/status",
        body={"status": new},
        content_type="application/merge-patch+json",
    )
    ready = conditions.find(merged, READY) or {}
    logger.info("InferencePipeline %s/%s: Ready=%s (%s)", namespace, name, ready.get("status"), ready.get("message"))


def pipeline_event(ctx: Context, event_type: str | None, body: dict[str, Any]) -> None:
    """Keep which services each pipeline calls, as its watch delivers it."""
    meta = body.get("metadata") or {}
    key = (meta.get("namespace", ""), meta.get("name", ""))
    if event_type == "DELETED":
        ctx.pipeline_calls.pop(key, None)
        return
    try:
        ctx.pipeline_calls[key] = frozenset(parse_pipeline(key[1], key[0], body.get("spec") or {}).services)
    except SpecError:
        ctx.pipeline_calls[key] = frozenset()


def callers(ctx: Context, namespace: str, service: str) -> list[str]:
    return sorted(name for (ns, name), calls in ctx.pipeline_calls.items() if ns == namespace and service in calls)


async def service_event(ctx: Context, event_type: str | None, body: dict[str, Any]) -> None:
    """A service's event: the pipelines that call it are checked again when its readiness changed, with
    no API call for any other event (thousands of services, each with a burst of status writes)."""
    meta = body.get("metadata") or {}
    key = (meta.get("namespace", ""), meta.get("name", ""))
    state = service_ready(None if event_type == "DELETED" else body)
    if event_type == "DELETED":
        changed = ctx.service_states.pop(key, None) != state
    else:
        changed, ctx.service_states[key] = ctx.service_states.get(key) != state, state
    names = callers(ctx, *key) if changed else []
    for name in names:
        pipeline = await ctx.kube.get(pipeline_path(key[0], name))
        if pipeline is not None:
            await reconcile_pipeline(ctx, pipeline)


def register(registry: kopf.OperatorRegistry) -> None:
    @kopf.on.resume(GROUP, VERSION, PIPELINE_PLURAL, id="pipeline", registry=registry)
    @kopf.on.create(GROUP, VERSION, PIPELINE_PLURAL, id="pipeline", registry=registry)
    @kopf.on.update(GROUP, VERSION, PIPELINE_PLURAL, id="pipeline", registry=registry)
    async def pipeline_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        await reconcile_pipeline(
            memo.ctx, {"metadata": dict(body.metadata), "spec": dict(body.spec), "status": dict(body.status)}
        )

    @kopf.on.event(GROUP, VERSION, PIPELINE_PLURAL, id="pipeline-calls", registry=registry)
    async def pipeline_watched(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
        if getattr(memo, "ctx", None) is not None:
            pipeline_event(memo.ctx, event.get("type"), dict(event["object"]))
