"""Desired children of an InferenceService, as plain manifests. No API calls, no clock.

The pieces live by idea in children.py (labels, names, metadata), runtime_pod.py (the pod), groups.py
(replicas spanning pods), monitors.py (Prometheus scraping) and roles.py (disaggregated prefill and
decode); this module builds the Deployment, Service and PodDisruptionBudget, and names them all.
"""

from __future__ import annotations

from typing import Any

from goodput_contract.api.spec import ServiceSpec
from goodput_operator.children import (
    GPU_PRODUCT_LABEL,
    MANAGED_BY,
    RUNTIME_DRAIN_SECONDS,
    RUNTIME_UID,
    SERVICE_LABEL,
    SERVICE_PORT,
    TERMINATION_GRACE_SECONDS,
    Manifest,
    child_metadata,
    deployment_name,
    labels,
    owner_reference,
    selector_labels,
    selector_string,
    service_url,
)
from goodput_operator.engines import (
    LORA_MOUNT,
    MODEL_CACHE_DIR,
    NODE_CACHE_MOUNT,
    RUNTIME_PORT,
    SHUTDOWN_DELAY_SECONDS,
    SOURCE_MOUNT,
)
from goodput_operator.groups import (
    GROUP_READINESS_PATH,
    LEADER_WORKER_SET,
    LWS_API_VERSION,
    POD,
    RENDEZVOUS_PORT,
    STATEFUL_SET,
    build_group_statefulset,
    build_leader_service,
    build_leader_worker_set,
    build_ranks_service,
    group_name,
    leader_service_name,
    placement,
    ranks_service_name,
)
from goodput_operator.monitors import (
    MONITORS,
    build_monitor,
    build_pod_monitor,
    build_service_monitor,
    metric_relabelings,
)
from goodput_operator.runtime_pod import node_cache_claim, pod_spec, runtime_args, template_meta
from goodput_operator.settings import Settings

__all__ = [
    "GPU_PRODUCT_LABEL",
    "GROUP_READINESS_PATH",
    "LEADER_WORKER_SET",
    "LORA_MOUNT",
    "LWS_API_VERSION",
    "MANAGED_BY",
    "MODEL_CACHE_DIR",
    "MONITORS",
    "NODE_CACHE_MOUNT",
    "POD",
    "RENDEZVOUS_PORT",
    "RUNTIME_DRAIN_SECONDS",
    "RUNTIME_PORT",
    "RUNTIME_UID",
    "SERVICE_LABEL",
    "SERVICE_PORT",
    "SHUTDOWN_DELAY_SECONDS",
    "SOURCE_MOUNT",
    "STATEFUL_SET",
    "TERMINATION_GRACE_SECONDS",
    "Manifest",
    "build_deployment",
    "build_group_statefulset",
    "build_leader_service",
    "build_leader_worker_set",
    "build_monitor",
    "build_pdb",
    "build_pod_monitor",
    "build_ranks_service",
    "build_service",
    "build_service_monitor",
    "child_metadata",
    "deployment_name",
    "group_name",
    "labels",
    "leader_service_name",
    "metric_relabelings",
    "node_cache_claim",
    "owner_reference",
    "placement",
    "ranks_service_name",
    "runtime_args",
    "selector_labels",
    "selector_string",
    "service_url",
]


def build_deployment(svc: ServiceSpec, settings: Settings, owner: dict[str, Any]) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(svc, deployment_name(svc), owner),
        "spec": {
            # a replica spanning pods runs as groups of pods instead (build_group_statefulset): none here
            "replicas": 0 if svc.multi_node else svc.desired_replicas,
            "selector": {"matchLabels": selector_labels(svc)},
            # A new pod must be ready before an old one goes: capacity never dips.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": template_meta(svc), "spec": pod_spec(svc, settings)},
        },
    }


def build_service(svc: ServiceSpec, owner: dict[str, Any]) -> Manifest:
    """The client Service: its ready endpoints are the replicas' pods, or the groups' leaders alone
    (GROUP_READINESS_PATH)."""
    selector = selector_labels(svc)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(svc, svc.name, owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                {"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "metrics", "port": RUNTIME_PORT, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def build_pdb(svc: ServiceSpec, owner: dict[str, Any], api_version: str = "policy/v1") -> Manifest | None:
    """One pod may be voluntarily evicted at a time; none for a single replica (it would block drains),
    nor for replicas spanning pods (their workers are never ready, so it would block every eviction)."""
    running = svc.replicas if svc.replicas is not None else svc.autoscaling.min_replicas  # kept while suspended
    if running <= 1 or svc.multi_node:
        return None
    return {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(svc, deployment_name(svc), owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(svc)}},
    }
