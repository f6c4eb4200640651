"""External autoscalers pointed at the InferenceService's scale subresource (hpa and keda modes).

Both follow the goodput law. In these modes the operator's control loop still decides every
period but writes nothing: it exports its decision as `goodput_autoscaler_desired_replicas`
{namespace, name} on its /metrics, and the external autoscaler holds the replica count at
that value (an AverageValue target of 1 makes the count equal the metric). HPA reads it as
an external metric through an adapter (e.g. prometheus-adapter), KEDA straight from
Prometheus. They alone write `spec.replicas`; the operator copies it to the Deployment like
any other scale.
"""

from __future__ import annotations

from typing import Any

from goodput_contract.api import GROUP, KIND, VERSION
from goodput_contract.api.spec import ServiceSpec
from goodput_contract.metrics import AUTOSCALER_DESIRED_REPLICAS as DESIRED_METRIC
from goodput_operator.builders import Manifest, child_metadata


def _target_ref(svc: ServiceSpec) -> dict[str, str]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": svc.name}


def build_hpa(svc: ServiceSpec, owner: dict[str, Any], api_version: str = "autoscaling/v2") -> Manifest | None:
    a = svc.autoscaling
    if a.mode != "hpa":
        return None
    return {
        "apiVersion": api_version,
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(svc, svc.name, owner),
        "spec": {
            "scaleTargetRef": _target_ref(svc),
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "name": DESIRED_METRIC,
                            "selector": {"matchLabels": {"namespace": svc.namespace, "name": svc.name}},
                        },
                        "target": {"type": "AverageValue", "averageValue": "1"},
                    },
                }
            ],
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
    query = f'max({DESIRED_METRIC}{{namespace="{svc.namespace}",name="{svc.name}"}})'
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": child_metadata(svc, svc.name, owner),
        "spec": {
            "scaleTargetRef": _target_ref(svc),
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "cooldownPeriod": int(a.scale_down_window_seconds),
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {
                        "serverAddress": a.prometheus_address,
                        "query": query,
                        "threshold": "1",
                    },
                }
            ],
        },
    }
