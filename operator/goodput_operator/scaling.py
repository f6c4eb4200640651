"""External autoscalers pointed at the InferenceService's scale subresource (hpa and keda modes).

Both hold the runtime's `goodput_requests_waiting` gauge at `autoscaling.targetWaitingRequests`
per replica; HPA reads it through a custom-metrics adapter (e.g. prometheus-adapter),
KEDA straight from Prometheus. They write `spec.replicas`; the operator copies it to the
Deployment like any other scale.
"""

from __future__ import annotations

from typing import Any

from goodput_operator.builders import Manifest, labels
from goodput_operator.settings import GROUP, KIND, VERSION
from goodput_operator.spec import ServiceSpec

WAITING_METRIC = "goodput_requests_waiting"


def _target_ref(svc: ServiceSpec) -> dict[str, str]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": svc.name}


def _metadata(svc: ServiceSpec, owner: dict[str, Any]) -> dict[str, Any]:
    return {"name": svc.name, "namespace": svc.namespace, "labels": labels(svc), "ownerReferences": [owner]}


def _quantity(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{int(value * 1000)}m"


def build_hpa(svc: ServiceSpec, owner: dict[str, Any], api_version: str = "autoscaling/v2") -> Manifest | None:
    a = svc.autoscaling
    if a.mode != "hpa":
        return None
    return {
        "apiVersion": api_version,
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(svc, owner),
        "spec": {
            "scaleTargetRef": _target_ref(svc),
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": [{
                "type": "Pods",
                "pods": {
                    "metric": {"name": WAITING_METRIC},
                    "target": {"type": "AverageValue", "averageValue": _quantity(a.target_waiting)},
                },
            }],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": int(a.scale_up_window_seconds)},
                "scaleDown": {
                    "stabilizationWindowSeconds": int(a.scale_down_window_seconds),
                    # one replica at a time: a GPU replica is expensive to bring back
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
                },
            },
        },
    }


def build_scaled_object(svc: ServiceSpec, owner: dict[str, Any]) -> Manifest | None:
    a = svc.autoscaling
    if a.mode != "keda":
        return None
    query = f'sum({WAITING_METRIC}{{namespace="{svc.namespace}",model="{svc.model.served_name}"}})'
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _metadata(svc, owner),
        "spec": {
            "scaleTargetRef": _target_ref(svc),
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "cooldownPeriod": int(a.scale_down_window_seconds),
            "triggers": [{
                "type": "prometheus",
                "metadata": {
                    "serverAddress": a.prometheus_address,
                    "query": query,
                    "threshold": f"{a.target_waiting:g}",
                },
            }],
        },
    }
