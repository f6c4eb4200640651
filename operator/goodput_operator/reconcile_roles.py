"""The reconcile's part in spec.disaggregation beyond the manifests: who writes the prefill Deployment's
replicas, and status.disaggregation.

In autoscaling mode goodput the autoscaler is the one writer of the prefill Deployment's replicas (its
scale subresource, field manager goodput-autoscaler). The operator's server-side apply then leaves
`replicas` out; left at that, the API server would drop a field only the operator had set and the
Deployment would fall back to one replica. So the operator first hands the field over: it applies
the current count, with an annotation marking the hand-over, under the autoscaler's field manager.
Outside goodput mode the operator's apply sets the count again, and the hand-over is withdrawn.
"""

from __future__ import annotations

from typing import Any

from goodput_contract.api.spec import ServiceSpec
from goodput_operator import roles
from goodput_operator.conditions import Condition
from goodput_operator.context import Context
from goodput_operator.k8s import apply_body, resource_path


def _handed_over(live: dict[str, Any] | None) -> bool:
    return bool(live) and roles.REPLICAS_HANDED_OVER in ((live or {})["metadata"].get("annotations") or {})


async def _apply_as_autoscaler(ctx: Context, svc: ServiceSpec, replicas: int | None) -> dict[str, Any]:
    """Apply the autoscaler's share of the prefill Deployment: the count and the mark (None: nothing)."""
    name = roles.prefill_name(svc)
    meta: dict[str, Any] = {"name": name, "namespace": svc.namespace}
    manifest: dict[str, Any] = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta}
    if replicas is not None:
        meta["annotations"] = {roles.REPLICAS_HANDED_OVER: roles.AUTOSCALER_FIELD_MANAGER}
        manifest["spec"] = {"replicas": replicas}
    current: dict[str, Any] = await ctx.kube.request(
        "PATCH",
        resource_path("apps/v1", "Deployment", svc.namespace, name),
        body=apply_body(manifest),
        content_type="application/apply-patch+yaml",
        query={"fieldManager": roles.AUTOSCALER_FIELD_MANAGER, "force": "true"},
    )
    ctx.observed.remember(current)
    return current


async def settle_prefill_replicas(ctx: Context, svc: ServiceSpec, owner_uid: str, applied: bool) -> None:
    """Hand the prefill Deployment's replicas to the autoscaler in goodput mode (before the operator's
    apply, which leaves them out, and after the apply that created it), or withdraw the hand-over in
    every other mode once the operator's apply has set them (`applied`)."""
    if svc.disaggregation is None:
        return
    name = roles.prefill_name(svc)
    live = ctx.observed.child("Deployment", svc.namespace, name)
    if live is None:
        live = await ctx.kube.get(resource_path("apps/v1", "Deployment", svc.namespace, name))
    if live is None or not any(ref.get("uid") == owner_uid for ref in live["metadata"].get("ownerReferences") or ()):
        return  # not there yet, or someone else's (the apply reports the conflict)
    if roles.reconcile_owns_prefill_replicas(svc):
        if applied and _handed_over(live):
            await _apply_as_autoscaler(ctx, svc, None)
    elif not _handed_over(live):
        floor = roles.prefill_replicas(svc)  # at the hand-over (creation, a change of mode) at least the floor
        await _apply_as_autoscaler(ctx, svc, max(floor, int((live.get("spec") or {}).get("replicas", 0))))


def role_status(deployment: dict[str, Any] | None) -> dict[str, int]:
    status = (deployment or {}).get("status") or {}
    return {"replicas": status.get("replicas", 0), "readyReplicas": status.get("readyReplicas", 0)}


def disaggregation_status(
    svc: ServiceSpec, decode: dict[str, Any], prefill: dict[str, Any] | None
) -> dict[str, Any] | None:
    """status.disaggregation: each pool's pods; None for a service that is not disaggregated."""
    if svc.disaggregation is None:
        return None
    return {roles.PREFILL: role_status(prefill), roles.DECODE: role_status(decode)}


def with_prefill(available: Condition, svc: ServiceSpec, prefill: dict[str, Any] | None) -> Condition:
    """The Available condition (the decode pool's) with the prefill pool's count in its message: a service
    whose prefill pool is down still serves, each request prefilled on its decode replica."""
    if svc.disaggregation is None or prefill is None:
        return available
    counts = role_status(prefill)
    wanted = (prefill.get("spec") or {}).get("replicas", counts["replicas"])
    message = f"{available.message}; prefill {counts['readyReplicas']}/{wanted} replicas ready"
    return Condition(available.type, available.status, available.reason, message)
