"""LoraAdapter: one LoRA adapter loaded at run time on an InferenceService's ready replicas.

A pass reads the adapter's service and the service's ready endpoints (its EndpointSlices, as the
autoscaler finds pods), asks each replica's /v1/models which adapters it holds, and loads the adapter
through the engine's /v1/load_lora_adapter on the replicas that should hold it and do not, with the
service's API key (spec.auth.apiKeySecretRef). Goodput's runtime and vLLM answer the same shapes. A
replica that restarted or was added lacks the adapter, so the next pass loads it there: passes run
on the resource's own changes and every `lora_resync_seconds`. With `replicas: N` the adapter is held
by the first N ready replicas in name order and unloaded from others. A finalizer unloads it from
every replica when the resource is deleted.

Refused by field (phase Failed, Valid False): a spec the schema lets through but cannot work, an
InferenceService that does not exist or is not valid, one that does not allow run-time updates
(spec.model.lora.runtimeUpdates), a pvc:// source whose claim the service's pods do not mount, a name
taken by the model or a spec.model.lora adapter, `pinned` on vLLM. A replica refusing the adapter
(a 4xx: a rank above the maximum, target modules the model lacks, another base model, a missing or
corrupt file) fails it too, with the engine's message as lastError; passes go on trying.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from goodput_contract.api import GROUP, LORA_PLURAL, VERSION
from goodput_contract.api.lora_adapter_spec import LoraAdapterSpec, parse_lora_adapter
from goodput_contract.api.spec import ServiceSpec, SpecError, parse
from goodput_operator.conditions import FALSE, READY, TRUE, VALID, Condition
from goodput_operator.context import Context
from goodput_operator.k8s import owner_path
from goodput_operator.lora_adapter_plan import Replica, check_service, plan
from goodput_operator.lora_adapter_status import Outcome, adapter_path, refused, status_body, write_status
from goodput_operator.lora_replicas import Engine, error_message, ready_replicas

# tests and hack/health_testdata.py import these from here
__all__ = ["Outcome", "Replica", "check_service", "error_message", "plan", "refused", "register", "status_body"]

logger = logging.getLogger(__name__)

REFUSED_RETRY_SECONDS = 60.0  # an adapter the replicas refused is tried again this often (else on a spec change)


async def service_spec(ctx: Context, namespace: str, adapter: LoraAdapterSpec) -> ServiceSpec:
    service = await ctx.kube.get(owner_path(namespace, adapter.service))
    if service is None:
        raise SpecError("service", f"InferenceService {adapter.service!r} not found", reason="ServiceNotFound")
    try:
        return parse(adapter.service, namespace, service.get("spec") or {})
    except SpecError as err:
        raise SpecError(
            "service", f"InferenceService {adapter.service!r} is not valid ({err})", "ServiceInvalid"
        ) from None


async def api_key(ctx: Context, svc: ServiceSpec) -> str | None:
    ref = svc.auth.api_key_secret
    return await ctx.kube.secret_value(svc.namespace, ref.name, ref.key) if ref else None


async def converge(
    ctx: Context, body: dict[str, Any], on_loading: Callable[[Outcome], Awaitable[None]] | None = None
) -> Outcome:
    """One pass: load where the adapter should be and is not, unload where it should not be."""
    meta = body["metadata"]
    namespace, generation = meta["namespace"], int(meta.get("generation") or 0)
    status = body.get("status") or {}
    try:
        adapter = parse_lora_adapter(meta["name"], body.get("spec") or {})
        svc = await service_spec(ctx, namespace, adapter)
        path = check_service(adapter, svc)
    except SpecError as err:
        return refused(err)
    valid = Condition(VALID, TRUE, "Valid", f"{path} on InferenceService {adapter.service!r}")
    replicas = await ready_replicas(ctx, namespace, adapter.service)
    async with aiohttp.ClientSession() as session:
        engine = Engine(session, await api_key(ctx, svc))
        answers = await asyncio.gather(*(engine.adapters(r) for r in replicas), return_exceptions=True)
        reachable = [r for r, a in zip(replicas, answers, strict=True) if not isinstance(a, BaseException)]
        holding = {r.name for r, a in zip(replicas, answers, strict=True) if isinstance(a, set) and adapter.name in a}
        keep, load, unload = plan(adapter, reachable, holding)
        wanted = adapter.wanted(len(reachable))
        # a change of spec (source, pinned) is loaded again, in place, where the adapter is held
        reload = keep if status.get("loadedGeneration") not in (None, generation) else []
        if (load or reload) and on_loading is not None:
            await on_loading(Outcome("Loading", sorted(r.name for r in keep), wanted, valid=valid))
        results = await asyncio.gather(
            *(engine.load(r, adapter.name, path, adapter.pinned, r in reload) for r in [*load, *reload]),
            *(engine.unload(r, adapter.name) for r in unload),
        )
    now_held = {r.name for r in keep}
    errors: list[str] = []
    refusals: list[str] = []
    for replica, (code, message) in zip([*load, *reload], results[: len(load) + len(reload)], strict=True):
        if code and code < 400:
            now_held.add(replica.name)
        else:
            now_held.discard(replica.name)  # a failed in-place load leaves the replica's old weights in doubt
            (refusals if 400 <= code < 500 else errors).append(f"{replica.name}: {message or code}")
    for replica, (code, message) in zip(unload, results[len(load) + len(reload) :], strict=True):
        if code == 0 or code >= 500:
            errors.append(f"unloading from {replica.name}: {message or code}")
        else:
            now_held.discard(replica.name)  # 404: it was gone already
    for replica, answer in zip(replicas, answers, strict=True):
        if isinstance(answer, BaseException):
            errors.append(f"{replica.name}: /v1/models: {type(answer).__name__}: {answer}")
    held = sorted(now_held)
    done = not refusals and not errors and len(held) >= wanted
    loaded = generation if done else status.get("loadedGeneration")
    if refusals:
        message = "; ".join(refusals)
        return Outcome("Failed", held, wanted, message, valid, Condition(READY, FALSE, "LoadRefused", message), loaded)
    if not reachable:
        message = f"InferenceService {adapter.service!r} has no ready replica"
        return Outcome(
            "Pending",
            held,
            wanted,
            "; ".join(errors),
            valid,
            Condition(READY, FALSE, "NoReadyReplicas", message),
            loaded,
        )
    if len(held) >= wanted and not [r for r in reload if r.name not in now_held]:
        message = f"held by {len(held)} of {len(reachable)} ready replicas"
        return Outcome(
            "Ready", held, wanted, "; ".join(errors), valid, Condition(READY, TRUE, "Loaded", message), loaded
        )
    message = f"held by {len(held)} of the {wanted} replicas that should" + (f": {'; '.join(errors)}" if errors else "")
    return Outcome(
        "Loading", held, wanted, "; ".join(errors), valid, Condition(READY, FALSE, "Loading", message), loaded
    )


_refused: dict[tuple[str, str, str], tuple[int, float]] = {}  # (namespace, name, uid) -> (generation, when refused)


def refused_lately(body: dict[str, Any], now: float) -> bool:
    """The replicas refused this generation of the adapter less than REFUSED_RETRY_SECONDS ago."""
    meta = body["metadata"]
    generation = int(meta.get("generation") or 0)
    seen = _refused.get((meta["namespace"], meta["name"], meta.get("uid", "")))
    return seen is not None and seen[0] == generation and now - seen[1] < REFUSED_RETRY_SECONDS


async def reconcile_adapter(ctx: Context, body: dict[str, Any]) -> None:
    meta = body["metadata"]
    async with ctx.lock(meta["namespace"], f"{LORA_PLURAL}/{meta['name']}"):
        current = await ctx.kube.get(adapter_path(meta["namespace"], meta["name"]))
        if current is None or (current["metadata"].get("deletionTimestamp")):
            return
        body = {k: current.get(k) for k in ("metadata", "spec", "status")}
        if refused_lately(body, time.monotonic()):
            return

        async def loading(outcome: Outcome) -> None:
            if (body.get("status") or {}).get("phase") != "Loading":
                await write_status(ctx, body, outcome)

        outcome = await converge(ctx, body, loading)
        key = (meta["namespace"], meta["name"], body["metadata"].get("uid", ""))
        if outcome.ready is not None and outcome.ready.reason == "LoadRefused":
            _refused[key] = (int(body["metadata"].get("generation") or 0), time.monotonic())
        else:
            _refused.pop(key, None)
        await write_status(ctx, body, outcome)


async def unload_everywhere(ctx: Context, body: dict[str, Any]) -> None:
    """On deletion: unload from every ready replica that holds it (a replica that does not answer is
    logged and let go: deletion is not held up by a replica that is gone)."""
    meta, spec = body["metadata"], body.get("spec") or {}
    namespace, name = meta["namespace"], meta["name"]
    _refused.pop((namespace, name, meta.get("uid", "")), None)
    async with ctx.lock(namespace, f"{LORA_PLURAL}/{name}"):
        try:
            adapter = parse_lora_adapter(name, spec)
            svc = await service_spec(ctx, namespace, adapter)
        except SpecError:
            return  # nothing was loaded, or the service and its pods are gone
        replicas = await ready_replicas(ctx, namespace, adapter.service)
        async with aiohttp.ClientSession() as session:
            engine = Engine(session, await api_key(ctx, svc))
            results = await asyncio.gather(*(engine.unload(r, name) for r in replicas))
        for replica, (code, message) in zip(replicas, results, strict=True):
            if code == 0 or code >= 500:
                logger.warning(
                    "LoraAdapter %s/%s: unloading from %s failed: %s", namespace, name, replica.name, message
                )
        unloaded = [r.name for r, (code, _) in zip(replicas, results, strict=True) if 200 <= code < 300]
        logger.info("LoraAdapter %s/%s deleted: unloaded from %s", namespace, name, ", ".join(unloaded) or "no replica")


def register(registry: Any, settings: Any) -> None:
    import kopf

    def current(body: kopf.Body) -> dict[str, Any]:
        return {"metadata": dict(body.metadata), "spec": dict(body.spec), "status": dict(body.status)}

    @kopf.on.event(GROUP, VERSION, LORA_PLURAL, id="lora-adapter-watch", registry=registry)
    async def adapter_watched(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
        """A pass when the spec moved past what the status describes (our own status writes do not)."""
        obj = event["object"]
        meta, status = obj.get("metadata") or {}, obj.get("status") or {}
        if event.get("type") == "DELETED" or meta.get("deletionTimestamp") or getattr(memo, "ctx", None) is None:
            return
        if status.get("observedGeneration") != meta.get("generation"):
            await reconcile_adapter(memo.ctx, dict(obj))

    @kopf.timer(
        GROUP, VERSION, LORA_PLURAL, id="lora-adapter-resync", interval=settings.lora_resync_seconds, registry=registry
    )
    async def adapter_resync(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        """Replicas that restarted or were added since the last pass get the adapter."""
        if getattr(memo, "ctx", None) is not None:
            await reconcile_adapter(memo.ctx, current(body))

    @kopf.on.delete(GROUP, VERSION, LORA_PLURAL, id="lora-adapter-unload", registry=registry)
    async def adapter_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        await unload_everywhere(memo.ctx, current(body))
