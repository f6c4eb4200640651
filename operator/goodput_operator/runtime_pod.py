"""The runtime pod: its container (command line, environment, probes, resources), volumes and security."""

from __future__ import annotations

from typing import Any

from goodput_contract import flags
from goodput_contract.api.model_cache_spec import STORAGE_CLASS, VOLUME_LABEL, cache_key
from goodput_contract.api.model_spec import lora_token
from goodput_contract.api.spec import ServiceSpec
from goodput_operator import engines
from goodput_operator.children import (
    GPU_PRODUCT_LABEL,
    RUNTIME_UID,
    TERMINATION_GRACE_SECONDS,
    labels,
    selector_labels,
)
from goodput_operator.engines import (
    LORA_MOUNT,
    MODEL_CACHE_DIR,
    NODE_CACHE_MOUNT,
    SHUTDOWN_DELAY_SECONDS,
    SOURCE_MOUNT,
)
from goodput_operator.kv_offload_pod import add_resources, add_volume
from goodput_operator.settings import DEFAULT_HF_ENDPOINT, Settings


def runtime_args(svc: ServiceSpec) -> list[str]:
    """The engine's command-line arguments, derived from the spec by its row in engines.ENGINES; with
    pipeline stages, the runtime's flag for them (the goodput engine alone runs them: engines refuse it)."""
    args = engines.engine_of(svc).args(svc)
    if svc.pipeline_parallel > 1:
        args += [flags.PIPELINE_PARALLEL_SIZE, str(svc.pipeline_parallel)]
    return args


def template_meta(svc: ServiceSpec) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": {**svc.template.labels, **labels(svc)}}
    if svc.template.annotations:
        meta["annotations"] = dict(svc.template.annotations)
    return meta


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
    # the Hub token of the model, else of spec.model.lora's hf:// adapters (the contract allows one)
    if token := svc.model.token_secret or lora_token(svc.model.lora):
        ref = {"name": token.name, "key": token.key}
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
    add_volume(svc, volumes, mounts)  # spec.engine.kvOffload's tier
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
    add_resources(svc, requests, limits)  # spec.engine.kvOffload's memory or disk
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


def pod_spec(svc: ServiceSpec, settings: Settings) -> dict[str, Any]:
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
