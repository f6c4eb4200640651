"""The Prometheus operator's ServiceMonitor or PodMonitor of a service's runtime pods."""

from __future__ import annotations

import re
from typing import Any

from prometheus_client.utils import floatToGoString

from goodput_contract.api.spec import ServiceSpec
from goodput_contract.metrics import ENGINE_METRICS
from goodput_operator import engines
from goodput_operator.children import Manifest, child_metadata, selector_labels


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
