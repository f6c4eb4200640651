"""Desired children of an InferenceService, as plain manifests. No API calls, no clock."""

from __future__ import annotations

import re
from typing import Any

from prometheus_client.utils import floatToGoString

from goodput_contract import flags
from goodput_contract.api import GROUP, KIND, VERSION
from goodput_contract.api.model_cache_spec import STORAGE_CLASS, VOLUME_LABEL, cache_key
from goodput_contract.api.spec import ServiceSpec
from goodput_contract.metrics import ENGINE_METRICS
from goodput_operator import engines
from goodput_operator.engines import (
    LORA_MOUNT,
    MODEL_CACHE_DIR,
    NODE_CACHE_MOUNT,
    RUNTIME_PORT,
    SHUTDOWN_DELAY_SECONDS,
    SOURCE_MOUNT,
)
from goodput_operator.settings import DEFAULT_HF_ENDPOINT, Settings

SERVICE_PORT = 80
SERVICE_LABEL = f"{GROUP}/service"
MANAGED_BY = "goodput-operator"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
RUNTIME_UID = 1000
# After SIGTERM the runtime keeps admitting requests (Connection: close) with /health at 503
# for SHUTDOWN_DELAY_SECONDS (engines.py), so endpoints drop the pod before it stops accepting;
# then it drains in-flight requests for up to RUNTIME_DRAIN_SECONDS (its --shutdown-grace default).
RUNTIME_DRAIN_SECONDS = 30
TERMINATION_GRACE_SECONDS = 60  # above delay + drain, so the kubelet's SIGKILL never cuts a drain short

Manifest = dict[str, Any]


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def selector_labels(svc: ServiceSpec) -> dict[str, str]:
    return {SERVICE_LABEL: svc.name}


def labels(svc: ServiceSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "goodput-runtime",
        "app.kubernetes.io/instance": svc.name,
        "app.kubernetes.io/component": "inference",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(svc),
    }


def selector_string(svc: ServiceSpec) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(svc).items())


def deployment_name(svc: ServiceSpec) -> str:
    return f"{svc.name}-runtime"


def service_url(svc: ServiceSpec) -> str:
    return f"http://{svc.name}.{svc.namespace}.svc"


def child_metadata(svc: ServiceSpec, name: str, owner: dict[str, Any]) -> dict[str, Any]:
    """A child's metadata: its name, the service's namespace and labels, one controller owner reference."""
    return {"name": name, "namespace": svc.namespace, "labels": labels(svc), "ownerReferences": [owner]}


def runtime_args(svc: ServiceSpec) -> list[str]:
    """The engine's command-line arguments, derived from the spec by its row in engines.ENGINES; with
    pipeline stages, the runtime's flag for them (the goodput engine alone runs them: engines refuse it)."""
    args = engines.engine_of(svc).args(svc)
    if svc.pipeline_parallel > 1:
        args += [flags.PIPELINE_PARALLEL_SIZE, str(svc.pipeline_parallel)]
    return args


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
    spec = _pod_spec(svc, settings)
    container = spec["containers"][0]
    container["env"] = env + container["env"]
    container["readinessProbe"]["httpGet"]["path"] = GROUP_READINESS_PATH
    container["ports"] += [
        {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
        {"name": "heartbeat", "containerPort": RENDEZVOUS_PORT + 1, "protocol": "TCP"},
    ]
    return spec


def _template_meta(svc: ServiceSpec) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": {**svc.template.labels, **labels(svc)}}
    if svc.template.annotations:
        meta["annotations"] = dict(svc.template.annotations)
    return meta


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


def build_group_statefulset(svc: ServiceSpec, settings: Settings, owner: dict[str, Any], replica: int) -> Manifest:
    """Replica `replica` as a StatefulSet of pods_per_replica pods started together: pod i is node rank i
    (its ordinal label), pod 0 the leader that serves HTTP."""
    name = group_name(svc, replica)
    leader = f"{name}-0.{ranks_service_name(svc)}.{svc.namespace}.svc"
    meta = child_metadata(svc, name, owner)
    meta["labels"] = {**meta["labels"], f"{GROUP}/replica": str(replica)}
    template_meta = _template_meta(svc)
    template_meta["labels"][f"{GROUP}/replica"] = str(replica)
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
                "metadata": template_meta,
                "spec": _group_pod_spec(svc, settings, _group_env(svc, leader)),
            },
        },
    }


def build_leader_worker_set(svc: ServiceSpec, settings: Settings, owner: dict[str, Any]) -> Manifest:
    """All replicas as one LeaderWorkerSet: a group of pods_per_replica pods per replica, recreated as a
    whole when one of its pods restarts. LWS sets LWS_LEADER_ADDRESS and LWS_WORKER_INDEX itself; the
    runtime reads them where GOODPUT_* are absent."""
    env: list[dict[str, Any]] = [{"name": "GOODPUT_NNODES", "value": str(svc.pods_per_replica)}]
    template = {"metadata": _template_meta(svc), "spec": _group_pod_spec(svc, settings, env)}
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


def _env(svc: ServiceSpec, settings: Settings) -> list[dict[str, Any]]:
    # The root filesystem is read-only: caches go to the model cache volume and /tmp.
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": f"{MODEL_CACHE_DIR}/hf"},
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        # named here: inductor's default names the user, and the pod's uid has no passwd entry
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/tmp/torchinductor"},
    ]
    if settings.hf_endpoint != DEFAULT_HF_ENDPOINT:
        # pods download from the same Hub mirror the operator reads config.json from
        env.append({"name": "HF_ENDPOINT", "value": settings.hf_endpoint})
    if svc.model.token_secret:
        ref = {"name": svc.model.token_secret.name, "key": svc.model.token_secret.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    env += engines.engine_of(svc).env(svc)
    variable = engines.engine_of(svc).api_key_env
    if svc.auth.api_key_secret and variable:
        # from the Secret at container start: the key is in neither the pod spec nor the arguments
        ref = {"name": svc.auth.api_key_secret.name, "key": svc.auth.api_key_secret.key}
        env.append({"name": variable, "valueFrom": {"secretKeyRef": ref}})
    return env + [dict(item) for item in svc.template.env]


def node_cache_claim(svc: ServiceSpec) -> dict[str, Any]:
    """A claim on one of the local volumes the ModelCache agent publishes for each node's complete copy
    (model_cache_agent.Status.volumes): bound when the pod is scheduled, so the pod goes to such a node."""
    assert svc.model.node_cache is not None
    return {
        "metadata": {"labels": selector_labels(svc)},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": STORAGE_CLASS,
            "selector": {"matchLabels": {VOLUME_LABEL: cache_key(svc.namespace, svc.model.node_cache)}},
            "resources": {"requests": {"storage": "1"}},
        },
    }


def _volumes(svc: ServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cache: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": svc.model.cache_claim}} if svc.model.cache_claim else {"emptyDir": {}}
    )
    volumes: list[dict[str, Any]] = [{"name": "model-cache", **cache}, {"name": "tmp", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [
        {"name": "model-cache", "mountPath": MODEL_CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if svc.model.node_cache:
        volumes.append({"name": "model-node-cache", "ephemeral": {"volumeClaimTemplate": node_cache_claim(svc)}})
        mounts.append({"name": "model-node-cache", "mountPath": NODE_CACHE_MOUNT, "readOnly": True})
    if svc.model.source.scheme == "pvc":
        claim = {"claimName": svc.model.source.claim, "readOnly": True}
        volumes.append({"name": "model-source", "persistentVolumeClaim": claim})
        mounts.append({"name": "model-source", "mountPath": SOURCE_MOUNT, "readOnly": True})
    for i, adapter in enumerate(svc.model.lora.adapters if svc.model.lora else ()):
        if adapter.source.scheme == "pvc":  # each adapter's claim read-only under LORA_MOUNT/<name>
            claim = {"claimName": adapter.source.claim, "readOnly": True}
            volumes.append({"name": f"lora-{i}", "persistentVolumeClaim": claim})
            mounts.append({"name": f"lora-{i}", "mountPath": f"{LORA_MOUNT}/{adapter.name}", "readOnly": True})
    if svc.ranks > 1 or engines.engine_of(svc).shared_memory:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    volumes += [dict(v) for v in svc.template.volumes]
    mounts += [dict(m) for m in svc.template.volume_mounts]
    return volumes, mounts


def _resources(svc: ServiceSpec) -> dict[str, Any]:
    r = svc.resources
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if r.cpu is not None:
        requests["cpu"] = r.cpu
    if r.memory is not None:
        requests["memory"] = limits["memory"] = r.memory
    if r.gpu:  # a replica's GPUs shared out over its pods
        per_pod = str(r.gpu // svc.pods_per_replica)
        requests[r.gpu_resource_name] = limits[r.gpu_resource_name] = per_pod
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _probe(path: str, probe: engines.Probe) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": probe.period_seconds,
        "timeoutSeconds": 5,
        "failureThreshold": probe.failure_threshold,
    }


def _container(svc: ServiceSpec, settings: Settings, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    engine = engines.engine_of(svc)
    container: dict[str, Any] = {
        "name": "runtime",
        "image": engines.image(svc, settings),
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(engine.command),
        "args": runtime_args(svc),
        "ports": [{"name": "http", "containerPort": engine.port, "protocol": "TCP"}],
        "env": _env(svc, settings),
        "resources": _resources(svc),
        "volumeMounts": mounts,
        # The runtime writes why it cannot start to /dev/termination-log; otherwise the log's tail
        # stands in. Either becomes lastState.terminated.message, which the operator reports.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Loading weights can take many minutes; liveness waits for the first success.
        "startupProbe": _probe(engine.health_path, engine.startup),
        "readinessProbe": _probe(engine.health_path, engine.readiness),
        "livenessProbe": _probe(engine.health_path, engine.liveness),
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if engine.pre_stop_sleep:
        # no drain delay of its own: endpoints drop the pod before SIGTERM reaches the engine
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(SHUTDOWN_DELAY_SECONDS)]}}}
    return container


def _pod_spec(svc: ServiceSpec, settings: Settings) -> dict[str, Any]:
    t = svc.template
    node_selector = dict(t.node_selector)
    if svc.resources.gpu_product and svc.resources.gpu:
        node_selector.setdefault(GPU_PRODUCT_LABEL, svc.resources.gpu_product)
    volumes, mounts = _volumes(svc)
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        # above the runtime's shutdown delay and drain after SIGTERM, so in-flight requests finish
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUNTIME_UID,
            "runAsGroup": RUNTIME_UID,
            "fsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_container(svc, settings, mounts)],
        "volumes": volumes,
    }
    optional = {
        "nodeSelector": node_selector or None,
        "tolerations": [dict(x) for x in t.tolerations] or None,
        "affinity": t.affinity,
        "priorityClassName": t.priority_class_name,
        "serviceAccountName": t.service_account_name,
        "imagePullSecrets": [{"name": n} for n in t.image_pull_secrets] or None,
    }
    pod.update({k: v for k, v in optional.items() if v is not None})
    return pod


def build_deployment(svc: ServiceSpec, settings: Settings, owner: dict[str, Any]) -> Manifest:
    template_meta: dict[str, Any] = {"labels": {**svc.template.labels, **labels(svc)}}
    if svc.template.annotations:
        template_meta["annotations"] = dict(svc.template.annotations)
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
            "template": {"metadata": template_meta, "spec": _pod_spec(svc, settings)},
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


def metric_relabelings(svc: ServiceSpec) -> list[dict[str, Any]]:
    """For engines other than ours: the model's label copied to `model`, and the histogram bucket at
    each SLO target tagged slo="ttft" / slo="tpot", so the recording rules read every engine alike."""
    engine = ENGINE_METRICS[svc.engine.kind]
    if engine.good is not None:
        return []
    out: list[dict[str, Any]] = [
        {
            "sourceLabels": [engine.model_label],
            "regex": "(.+)",
            "targetLabel": "model",
            "replacement": "$1",
            "action": "replace",
        }
    ]
    for tag, target, series in (
        ("ttft", svc.slo.ttft_seconds, engine.ttft[0]),
        ("tpot", svc.slo.tpot_seconds, engine.tpot[0]),
    ):
        if target is not None:  # the engine prints `le` as prometheus_client does
            out.append(
                {
                    "sourceLabels": ["__name__", "le"],
                    "targetLabel": "slo",
                    "replacement": tag,
                    "regex": f"{re.escape(series)}_bucket;{re.escape(floatToGoString(target))}",
                    "action": "replace",
                }
            )
    return out


# The Prometheus operator's two ways to scrape the runtime: kind -> (the port it scrapes, the spec field
# listing its endpoints). A ServiceMonitor goes through the Service, a PodMonitor to the pods directly.
MONITORS = {"ServiceMonitor": ("metrics", "endpoints"), "PodMonitor": ("http", "podMetricsEndpoints")}


def build_monitor(svc: ServiceSpec, owner: dict[str, Any], kind: str) -> Manifest:
    """The ServiceMonitor or PodMonitor (`kind`) that scrapes the service's runtime pods."""
    port, endpoints = MONITORS[kind]
    endpoint: dict[str, Any] = {"port": port, "path": engines.engine_of(svc).metrics_path, "interval": "15s"}
    if relabelings := metric_relabelings(svc):
        endpoint["metricRelabelings"] = relabelings
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": kind,
        "metadata": child_metadata(svc, svc.name, owner),
        "spec": {
            "selector": {"matchLabels": selector_labels(svc)},
            endpoints: [endpoint],
        },
    }


def build_service_monitor(svc: ServiceSpec, owner: dict[str, Any]) -> Manifest:
    return build_monitor(svc, owner, "ServiceMonitor")


def build_pod_monitor(svc: ServiceSpec, owner: dict[str, Any]) -> Manifest:
    return build_monitor(svc, owner, "PodMonitor")
