"""A replica spanning pods: a StatefulSet per replica behind a headless Service, or one LeaderWorkerSet."""

from __future__ import annotations

from typing import Any

from goodput_contract.api import GROUP
from goodput_contract.api.spec import ServiceSpec
from goodput_operator.children import Manifest, child_metadata, deployment_name, selector_labels
from goodput_operator.runtime_pod import pod_spec, template_meta
from goodput_operator.settings import Settings

# --- A replica spanning pods ------------------------------------------------------------------------
# Mode of a multi-node replica, as status.placement.mode records it
POD, STATEFUL_SET, LEADER_WORKER_SET = "Pod", "StatefulSet", "LeaderWorkerSet"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
RENDEZVOUS_PORT = 29500  # torch.distributed's store at the leader; the pods' heartbeats on the next port
# A worker pod answers its readiness probe (this path) with 503 forever: it takes no requests, so the
# client Service's ready endpoints are the groups' leaders alone (on every Kubernetes version, where
# the pod-index label needs 1.28), and a leader is ready only once every rank of its group joined.
GROUP_READINESS_PATH = "/health?serving"


def group_name(svc: ServiceSpec, replica: int) -> str:
    """The StatefulSet of replica `replica`: its pods are <name>-0 (the leader), <name>-1, ..."""
    return f"{svc.name}-runtime-{replica}"


def ranks_service_name(svc: ServiceSpec) -> str:
    return f"{svc.name}-ranks"


def leader_service_name(svc: ServiceSpec, replica: int) -> str:
    """The ClusterIP Service that reaches replica `replica`'s leader pod (named as its StatefulSet)."""
    return group_name(svc, replica)


def placement(svc: ServiceSpec, lws_installed: bool) -> dict[str, Any]:
    """status.placement: how one replica maps to pods."""
    mode = POD if not svc.multi_node else LEADER_WORKER_SET if lws_installed else STATEFUL_SET
    return {"mode": mode, "podsPerReplica": svc.pods_per_replica, "ranksPerPod": svc.ranks // svc.pods_per_replica}


def _group_env(svc: ServiceSpec, leader_host: str) -> list[dict[str, Any]]:
    """Node count and leader address; the node rank is the ordinal ending the pod's name."""
    return [
        {"name": "GOODPUT_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "GOODPUT_NNODES", "value": str(svc.pods_per_replica)},
        {"name": "GOODPUT_LEADER_ADDRESS", "value": f"{leader_host}:{RENDEZVOUS_PORT}"},
    ]


def _group_pod_spec(svc: ServiceSpec, settings: Settings, env: list[dict[str, Any]]) -> dict[str, Any]:
    spec = pod_spec(svc, settings)
    container = spec["containers"][0]
    container["env"] = env + container["env"]
    container["readinessProbe"]["httpGet"]["path"] = GROUP_READINESS_PATH
    container["ports"] += [
        {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
        {"name": "heartbeat", "containerPort": RENDEZVOUS_PORT + 1, "protocol": "TCP"},
    ]
    return spec


def build_ranks_service(svc: ServiceSpec, owner: dict[str, Any]) -> Manifest:
    """The headless Service that gives each pod of a group a DNS name (<pod>.<svc>-ranks), not-ready
    pods included: the ranks meet before any of them is ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(svc, ranks_service_name(svc), owner),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(svc),
            "ports": [
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT, "protocol": "TCP"}
            ],
        },
    }


def build_leader_service(svc: ServiceSpec, owner: dict[str, Any], replica: int) -> Manifest:
    """A ClusterIP Service selecting replica `replica`'s leader pod (<group>-0), not-ready included: the
    group's pods meet at its ClusterIP. A ClusterIP is fixed for the Service's life and needs no cluster
    DNS, nor a DNS answer for a pod that does not exist yet (which resolvers cache as absent)."""
    name = leader_service_name(svc, replica)
    meta = child_metadata(svc, name, owner)
    meta["labels"] = {**meta["labels"], f"{GROUP}/replica": str(replica)}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": "ClusterIP",
            "publishNotReadyAddresses": True,
            "selector": {**selector_labels(svc), "statefulset.kubernetes.io/pod-name": f"{group_name(svc, replica)}-0"},
            "ports": [
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT, "protocol": "TCP"},
                {
                    "name": "heartbeat",
                    "port": RENDEZVOUS_PORT + 1,
                    "targetPort": RENDEZVOUS_PORT + 1,
                    "protocol": "TCP",
                },
            ],
        },
    }


def build_group_statefulset(
    svc: ServiceSpec, settings: Settings, owner: dict[str, Any], replica: int, leader_ip: str
) -> Manifest:
    """Replica `replica` as a StatefulSet of pods_per_replica pods started together: pod i is node rank i
    (its ordinal label), pod 0 the leader that serves HTTP; all meet at `leader_ip`, the ClusterIP of
    the group's leader Service (build_leader_service)."""
    name = group_name(svc, replica)
    meta = child_metadata(svc, name, owner)
    meta["labels"] = {**meta["labels"], f"{GROUP}/replica": str(replica)}
    pod_meta = template_meta(svc)
    pod_meta["labels"][f"{GROUP}/replica"] = str(replica)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            "replicas": svc.pods_per_replica,
            "serviceName": ranks_service_name(svc),
            # every pod at once: the ranks meet at the leader, none is ready before all are
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {**selector_labels(svc), f"{GROUP}/replica": str(replica)}},
            "template": {
                "metadata": pod_meta,
                "spec": _group_pod_spec(svc, settings, _group_env(svc, leader_ip)),
            },
        },
    }


def build_leader_worker_set(svc: ServiceSpec, settings: Settings, owner: dict[str, Any]) -> Manifest:
    """All replicas as one LeaderWorkerSet: a group of pods_per_replica pods per replica, recreated as a
    whole when one of its pods restarts. LWS sets LWS_LEADER_ADDRESS and LWS_WORKER_INDEX itself; the
    runtime reads them where GOODPUT_* are absent."""
    env: list[dict[str, Any]] = [{"name": "GOODPUT_NNODES", "value": str(svc.pods_per_replica)}]
    template = {"metadata": template_meta(svc), "spec": _group_pod_spec(svc, settings, env)}
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": child_metadata(svc, deployment_name(svc), owner),
        "spec": {
            "replicas": svc.desired_replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": svc.pods_per_replica,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": template,
            },
        },
    }


def group_ingress(svc: ServiceSpec) -> dict[str, Any]:
    """The NetworkPolicy rule that lets a group's pods reach each other: the leader's store (29500) and
    heartbeat (29501), then gloo's or NCCL's connections between ranks, on ports they pick. It admits
    the service's own pods on every port; the serving port's rule stays as it is for everyone else."""
    return {"from": [{"podSelector": {"matchLabels": selector_labels(svc)}}]}
