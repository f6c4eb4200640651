"""The NetworkPolicy of a service's runtime pods (spec.networkPolicy, on by default).

Their serving port (the API, /health and /metrics alike) accepts connections only from the
gateways (goodput-gateway, and goodput-gateway-batch running the Batch API's lines) and the
operator (whose autoscaler reads each pod's /metrics), from pods of the service's own namespace,
and from the monitoring namespace (Prometheus). With spec.disaggregation, the service's decode
pods also reach its pods' kv port (the KV hand-off, pulled from the prefill pods; with vLLM's
NIXL, every port: roles.kv_ingress). The pods of a replica spanning pods reach each other on
every port (the ranks' rendezvous and collectives: groups.group_ingress). Nothing else is
admitted on any port. It binds only where
the cluster's CNI plugin enforces NetworkPolicies.
"""

from __future__ import annotations

from typing import Any

from goodput_contract.api.spec import ServiceSpec
from goodput_operator import engines, groups, roles
from goodput_operator.builders import Manifest, child_metadata, deployment_name, selector_labels
from goodput_operator.settings import Settings

API_VERSION = "networking.k8s.io/v1"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server (1.21+)
# their pods' app.kubernetes.io/name; goodput-gateway-batch runs the Batch API's lines
SYSTEM_COMPONENTS = ("goodput-gateway", "goodput-gateway-batch", "goodput-operator")


def namespace_selector(namespace: str) -> dict[str, Any]:
    return {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}}


def build_network_policy(svc: ServiceSpec, settings: Settings, owner: dict[str, Any]) -> Manifest:
    peers: list[dict[str, Any]] = [
        {"podSelector": {}},  # this namespace
        {
            "namespaceSelector": namespace_selector(settings.gateway_namespace),
            "podSelector": {
                "matchExpressions": [
                    {"key": "app.kubernetes.io/name", "operator": "In", "values": list(SYSTEM_COMPONENTS)}
                ]
            },
        },
        {"namespaceSelector": namespace_selector(settings.monitoring_namespace)},
    ]
    return {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": child_metadata(svc, deployment_name(svc), owner),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(svc)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": engines.engine_of(svc).port}]}]
            + ([roles.kv_ingress(svc)] if svc.disaggregation is not None else [])
            + ([groups.group_ingress(svc)] if svc.multi_node else []),
        },
    }
