"""What every child of an InferenceService shares: its labels, names, owner reference and metadata."""

from __future__ import annotations

from typing import Any

from goodput_contract.api import GROUP, KIND, VERSION
from goodput_contract.api.spec import ServiceSpec

SERVICE_PORT = 80
SERVICE_LABEL = f"{GROUP}/service"
ROLE_LABEL = f"{GROUP}/role"  # prefill | decode, with spec.disaggregation (roles.py)
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
    """status.selector, the scale subresource's pods: the decode role's when disaggregated."""
    chosen = selector_labels(svc)
    if svc.disaggregation is not None:
        chosen = {**chosen, ROLE_LABEL: "decode"}
    return ",".join(f"{k}={v}" for k, v in chosen.items())


def deployment_name(svc: ServiceSpec) -> str:
    return f"{svc.name}-runtime"


def service_url(svc: ServiceSpec) -> str:
    return f"http://{svc.name}.{svc.namespace}.svc"


def child_metadata(svc: ServiceSpec, name: str, owner: dict[str, Any]) -> dict[str, Any]:
    """A child's metadata: its name, the service's namespace and labels, one controller owner reference."""
    return {"name": name, "namespace": svc.namespace, "labels": labels(svc), "ownerReferences": [owner]}
