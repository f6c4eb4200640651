"""Disaggregated prefill and decode (spec.disaggregation): the two roles' Deployments, Services and PDBs.

The decode role keeps the names of an aggregated service: the Deployment <name>-runtime (whose
replicas follow spec.replicas, within decode's bounds) behind the Service <name>, so everything that
knows them keeps working. The prefill role is the Deployment and Service <name>-prefill. Pods and
Services carry `serving.goodput.dev/role`; both Services carry the labels an aggregated Service
carries, so the gateway's EndpointSlice watch and the ServiceMonitor see both.

The decode Deployment's selector stays the aggregated one (a Deployment's selector cannot change):
it also matches prefill pods, which is harmless because Deployments and ReplicaSets own pods through
their controller references and each ReplicaSet selects its own template hash. Every selector made
here for one role (its Service, its PodDisruptionBudget) names the role.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from goodput_contract.api import GROUP
from goodput_contract.api.spec import ServiceSpec
from goodput_operator import builders, engines
from goodput_operator.children import ROLE_LABEL, Manifest, child_metadata, deployment_name, selector_labels
from goodput_operator.engines import KV_PORT
from goodput_operator.settings import Settings

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
KV_PORT_NAME = "kv"
# The autoscaler's field manager: in goodput mode it alone writes the prefill Deployment's replicas
AUTOSCALER_FIELD_MANAGER = "goodput-autoscaler"
# On a prefill Deployment whose replicas the operator handed to the autoscaler (reconcile_roles.py)
REPLICAS_HANDED_OVER = f"{GROUP}/replicas-manager"


def prefill_name(svc: ServiceSpec) -> str:
    """The prefill role's Deployment, Service and PodDisruptionBudget."""
    return f"{svc.name}-prefill"


def role_selector(svc: ServiceSpec, role: str) -> dict[str, str]:
    return {**selector_labels(svc), ROLE_LABEL: role}


def role_spec(svc: ServiceSpec, role: str) -> ServiceSpec:
    """The service as one role's replicas run it: the pool's tensor-parallel size, and its GPUs."""
    assert svc.disaggregation is not None
    tensor = svc.disaggregation.pool(role).tensor or svc.tensor_parallel
    if tensor == svc.tensor_parallel:
        return svc
    gpu = tensor * svc.pipeline_parallel if svc.resources.gpu else 0
    return replace(svc, tensor_parallel=tensor, resources=replace(svc.resources, gpu=gpu))


def prefill_replicas(svc: ServiceSpec) -> int:
    """What the reconcile sets the prefill Deployment to (outside goodput mode, and at its creation)."""
    assert svc.disaggregation is not None
    return 0 if svc.suspend else svc.disaggregation.prefill.min_replicas


def reconcile_owns_prefill_replicas(svc: ServiceSpec) -> bool:
    """In goodput mode the autoscaler writes the prefill Deployment's replicas; in every other, the reconcile."""
    return svc.autoscaling.mode != "goodput" or svc.suspend


def kv_args(svc: ServiceSpec, role: str) -> list[str]:
    """The engine's flags for its role in the KV hand-off (its row in engines.ENGINES)."""
    render = engines.engine_of(svc).kv_args
    assert render is not None  # the contract refuses disaggregation on an engine without them
    return render(svc, role)


def kv_env(svc: ServiceSpec) -> list[dict[str, Any]]:
    """POD_IP from the downward API (the address a prefill pod advertises to decode pods), then the engine's."""
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    return [pod_ip, *engines.engine_of(svc).kv_env(svc)]


def as_role(deployment: Manifest, svc: ServiceSpec, role: str) -> Manifest:
    """A Deployment built for the role's spec (builders.build_deployment of role_spec) made that role's:
    its name, labels, replicas, the engine's hand-off flags, the kv port and POD_IP."""
    assert svc.disaggregation is not None
    meta, spec = deployment["metadata"], deployment["spec"]
    meta["labels"] = {**meta["labels"], ROLE_LABEL: role}
    spec["template"]["metadata"]["labels"][ROLE_LABEL] = role
    if role == PREFILL:
        meta["name"] = prefill_name(svc)
        spec["selector"] = {"matchLabels": role_selector(svc, PREFILL)}
        if reconcile_owns_prefill_replicas(svc):
            spec["replicas"] = prefill_replicas(svc)
        else:
            spec.pop("replicas", None)  # the autoscaler's (reconcile_roles.py hands it over at creation)
    container = spec["template"]["spec"]["containers"][0]
    container["args"] = container["args"] + kv_args(svc, role)
    container["ports"] = container["ports"] + [{"name": KV_PORT_NAME, "containerPort": KV_PORT, "protocol": "TCP"}]
    container["env"] = kv_env(svc) + container["env"]
    return deployment


def as_role_service(service: Manifest, svc: ServiceSpec, role: str) -> Manifest:
    """builders.build_service made the role's: the same labels plus the role, a selector naming it."""
    meta = service["metadata"]
    meta["labels"] = {**meta["labels"], ROLE_LABEL: role}
    if role == PREFILL:
        meta["name"] = prefill_name(svc)
    service["spec"]["selector"] = role_selector(svc, role)
    return service


def build_role_pdb(svc: ServiceSpec, owner: dict[str, Any], role: str, api_version: str) -> Manifest | None:
    """One pod of the role may be voluntarily evicted at a time; none for a pool whose floor is a single
    replica (it would block drains). The decode pool's floor is its replicas, the prefill pool's its minimum."""
    assert svc.disaggregation is not None
    running = svc.replicas if svc.replicas is not None else svc.disaggregation.decode.min_replicas
    floor = svc.disaggregation.decode.clamp(running) if role == DECODE else svc.disaggregation.prefill.min_replicas
    if floor <= 1:
        return None
    name = deployment_name(svc) if role == DECODE else prefill_name(svc)
    meta = child_metadata(svc, name, owner)
    meta["labels"][ROLE_LABEL] = role
    return {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": meta,
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": role_selector(svc, role)}},
    }


def lost_role(manifest: Manifest, live: dict[str, Any] | None) -> bool:
    """Whether the live child carries a role its manifest no longer gives it."""
    had = ROLE_LABEL in (((live or {}).get("metadata") or {}).get("labels") or {})
    return had and ROLE_LABEL not in (manifest["metadata"].get("labels") or {})


def kv_ingress(svc: ServiceSpec) -> dict[str, Any]:
    """The NetworkPolicy rule that lets the service's decode pods reach its prefill pods' kv port. vLLM's
    NIXL moves the blocks over UCX, whose TCP transport listens on ports it picks: there the rule admits
    the service's own pods (both roles) on every port; RDMA does not pass through the CNI at all."""
    if svc.engine.kind == engines.VLLM:
        return {"from": [{"podSelector": {"matchLabels": selector_labels(svc)}}]}
    return {
        "from": [{"podSelector": {"matchLabels": role_selector(svc, DECODE)}}],
        "ports": [{"protocol": "TCP", "port": KV_PORT}],
    }


def build_prefill(svc: ServiceSpec, settings: Settings, owner: dict[str, Any]) -> tuple[Manifest, Manifest]:
    """The prefill role's Deployment and Service."""
    deployment = as_role(builders.build_deployment(role_spec(svc, PREFILL), settings, owner), svc, PREFILL)
    return deployment, as_role_service(builders.build_service(svc, owner), svc, PREFILL)


def build_decode(svc: ServiceSpec, settings: Settings, owner: dict[str, Any]) -> tuple[Manifest, Manifest]:
    """The decode role's Deployment and Service: the aggregated service's, made the role's."""
    deployment = as_role(builders.build_deployment(role_spec(svc, DECODE), settings, owner), svc, DECODE)
    return deployment, as_role_service(builders.build_service(svc, owner), svc, DECODE)
