"""The children a service wants (pure manifests from builders.py and roles.py), and the paths of the
optional ones it no longer wants, from what the watches hold."""

from __future__ import annotations

import re
from typing import Any

from goodput_contract.api.spec import ServiceSpec, SpecError
from goodput_operator import builders, network, roles
from goodput_operator.autoscaling import external
from goodput_operator.context import Context
from goodput_operator.k8s import resource_path


async def desired_children(
    ctx: Context, svc: ServiceSpec, owner: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[str]]:
    """The manifests to apply, and the paths of optional children this spec no longer wants."""
    discovered = await ctx.discovery()
    mode = builders.placement(svc, discovered.leader_worker_sets)["mode"]
    desired: list[dict[str, Any]] = (
        list(roles.build_decode(svc, ctx.settings, owner))
        if svc.disaggregation is not None
        else [builders.build_deployment(svc, ctx.settings, owner), builders.build_service(svc, owner)]
    )
    replica_groups, unwanted_groups = await groups(ctx, svc, owner, mode, discovered.leader_worker_sets)
    desired += replica_groups
    if discovered.service_monitors:
        desired.append(builders.build_service_monitor(svc, owner))
    elif discovered.pod_monitors:
        desired.append(builders.build_pod_monitor(svc, owner))
    if svc.autoscaling.mode == "keda" and not discovered.scaled_objects:
        raise SpecError(
            "autoscaling.mode",
            "is keda, but the cluster serves no keda.sh/v1alpha1 ScaledObjects",
            reason="KEDANotInstalled",
        )
    pdb = (
        roles.build_role_pdb(svc, owner, roles.DECODE, discovered.pdb_api_version)
        if svc.disaggregation is not None
        else builders.build_pdb(svc, owner, discovered.pdb_api_version)
    )
    optional = [
        (
            pdb,
            resource_path(
                discovered.pdb_api_version, "PodDisruptionBudget", svc.namespace, builders.deployment_name(svc)
            ),
        ),
        *await _prefill_children(ctx, svc, owner, discovered.pdb_api_version),
        (
            external.build_hpa(svc, owner, discovered.hpa_api_version),
            resource_path(discovered.hpa_api_version, "HorizontalPodAutoscaler", svc.namespace, svc.name),
        ),
        (
            network.build_network_policy(svc, ctx.settings, owner) if svc.network_policy else None,
            resource_path(network.API_VERSION, "NetworkPolicy", svc.namespace, builders.deployment_name(svc)),
        ),
    ]
    if discovered.scaled_objects:
        optional.append(
            (
                external.build_scaled_object(svc, owner),
                resource_path("keda.sh/v1alpha1", "ScaledObject", svc.namespace, svc.name),
            )
        )
    desired += [manifest for manifest, _ in optional if manifest]
    return desired, [path for manifest, path in optional if not manifest] + unwanted_groups


async def groups(
    ctx: Context, svc: ServiceSpec, owner: dict[str, Any], mode: str, lws_installed: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    """The children of replicas spanning pods, and the paths of group children no longer wanted.

    StatefulSet mode: the headless Service, and per replica a leader Service and a StatefulSet; scaling
    adds or removes whole groups, and suspending keeps each at zero pods. A group's StatefulSet is
    written once its leader Service has a ClusterIP (the address its pods meet at): the pass that
    creates the Service leaves it out, and the Service's watch event brings the next pass.
    LeaderWorkerSet mode: one LeaderWorkerSet whose replicas are the groups.
    """
    pattern = re.compile(rf"{re.escape(builders.group_name(svc, 0)[:-1])}(\d+)")

    def replicas_of(kind: str) -> set[int]:
        return {
            int(match.group(1))
            for obj in ctx.observed.children(kind, svc.namespace, f"{svc.name}-runtime-")
            if (match := pattern.fullmatch(obj["metadata"]["name"])) and owned_by(obj, owner["uid"])
        }

    existing = sorted(replicas_of("StatefulSet"))
    leaders = replicas_of("Service")
    desired: list[dict[str, Any]] = []
    keep: set[int] = set()
    if mode == builders.STATEFUL_SET:
        desired.append(builders.build_ranks_service(svc, owner))
        keep = set(existing) if svc.suspend else set(range(svc.desired_replicas))
        for replica in sorted(keep):
            desired.append(builders.build_leader_service(svc, owner, replica))
            leader_ip = await _leader_ip(ctx, svc, replica)
            if leader_ip is None:
                continue
            group = builders.build_group_statefulset(svc, ctx.settings, owner, replica, leader_ip)
            if svc.suspend:
                group["spec"]["replicas"] = 0
            desired.append(group)
    elif mode == builders.LEADER_WORKER_SET:
        desired.append(builders.build_leader_worker_set(svc, ctx.settings, owner))
    unwanted = [
        resource_path("apps/v1", "StatefulSet", svc.namespace, builders.group_name(svc, replica))
        for replica in existing
        if replica not in keep
    ] + [
        resource_path("v1", "Service", svc.namespace, builders.leader_service_name(svc, replica))
        for replica in sorted(leaders)
        if replica not in keep
    ]
    if mode != builders.STATEFUL_SET and (existing or leaders):
        unwanted.append(resource_path("v1", "Service", svc.namespace, builders.ranks_service_name(svc)))
    if mode != builders.LEADER_WORKER_SET and lws_installed:
        unwanted.append(
            resource_path(builders.LWS_API_VERSION, "LeaderWorkerSet", svc.namespace, builders.deployment_name(svc))
        )
    return desired, unwanted


async def _leader_ip(ctx: Context, svc: ServiceSpec, replica: int) -> str | None:
    """The ClusterIP of the group's leader Service: the watches' copy, else the server's; None before it exists."""
    name = builders.leader_service_name(svc, replica)
    live = ctx.observed.child("Service", svc.namespace, name)
    path = resource_path("v1", "Service", svc.namespace, name)
    if live is None and not ctx.observed.known_absent(path):
        live = await ctx.kube.get(path)
    ip = ((live or {}).get("spec") or {}).get("clusterIP")
    return ip if ip and ip != "None" else None


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or ())


async def _prefill_children(
    ctx: Context, svc: ServiceSpec, owner: dict[str, Any], pdb_api_version: str
) -> list[tuple[dict[str, Any] | None, str]]:
    """The prefill role's Deployment, Service and PodDisruptionBudget, each with its path (None where it
    is not wanted: the service is not disaggregated, or its prefill pool's floor is one replica)."""
    name = roles.prefill_name(svc)
    paths = [
        resource_path("apps/v1", "Deployment", svc.namespace, name),
        resource_path("v1", "Service", svc.namespace, name),
        resource_path(pdb_api_version, "PodDisruptionBudget", svc.namespace, name),
    ]
    if svc.disaggregation is None:
        # the watches hold every child of ours: only what they delivered is left over (a prefill child
        # they deliver later triggers a pass that removes it), so a service never disaggregated costs no read
        kinds = ("Deployment", "Service", "PodDisruptionBudget")
        return [
            (None, path)
            for kind, path in zip(kinds, paths, strict=True)
            if ctx.observed.child(kind, svc.namespace, name)
        ]
    deployment, service = roles.build_prefill(svc, ctx.settings, owner)
    if "replicas" not in deployment["spec"]:  # goodput mode: the autoscaler's, but set at the creation
        live = ctx.observed.child("Deployment", svc.namespace, name) or await ctx.kube.get(paths[0], any_version=True)
        if live is None:
            deployment["spec"]["replicas"] = roles.prefill_replicas(svc)
    pdb = roles.build_role_pdb(svc, owner, roles.PREFILL, pdb_api_version)
    return list(zip((deployment, service, pdb), paths, strict=True))
