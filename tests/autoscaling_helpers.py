"""Shared by the autoscaler tests: EndpointSlices standing in for a kubelet's ready pods, the scale subresource."""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

from harness import GROUP, PLURAL, VERSION, Cluster


def host_address() -> str:
    """A non-loopback address of this machine (the API server refuses loopback endpoints)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
            return str(probe.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def slice_version(cluster: Cluster) -> str:
    groups = cluster.raw("GET", "/apis")["groups"]
    return str(next(g["preferredVersion"]["groupVersion"] for g in groups if g["name"] == "discovery.k8s.io"))


def slice_path(cluster: Cluster, namespace: str, name: str | None = None) -> str:
    base = f"/apis/{slice_version(cluster)}/namespaces/{namespace}/endpointslices"
    return f"{base}/{name}" if name else base


def put_endpoint(
    cluster: Cluster,
    namespace: str,
    service: str,
    pod: str,
    address: str,
    port: int,
    ready: bool,
    *,
    port_name: str = "metrics",
    terminating: bool = False,
) -> None:
    """What the EndpointSlice controller publishes for one pod of the service (create or replace)."""
    conditions = {"ready": ready, **({"terminating": True} if terminating else {})}
    if terminating and slice_version(cluster).endswith("v1beta1"):
        conditions = {"ready": False}  # 1.20's v1beta1 has the terminating condition behind a feature gate
    body: dict[str, Any] = {
        "apiVersion": slice_version(cluster),
        "kind": "EndpointSlice",
        # the EndpointSlice controller copies the Service's labels, the operator's service label among them
        "metadata": {
            "name": f"{service}-{pod}",
            "labels": {
                "kubernetes.io/service-name": service,
                "serving.goodput.dev/service": service,
                "endpointslice.kubernetes.io/managed-by": "goodput-tests",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": conditions}],
    }
    path = slice_path(cluster, namespace, f"{service}-{pod}")
    live = cluster.get_or_none(cluster.raw, "GET", path)
    if live is None:
        cluster.raw("POST", slice_path(cluster, namespace), body)
    else:
        body["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        cluster.raw("PUT", path, body)


def delete_endpoint(cluster: Cluster, namespace: str, service: str, pod: str) -> None:
    cluster.get_or_none(cluster.raw, "DELETE", slice_path(cluster, namespace, f"{service}-{pod}"))


def scale_replicas(cluster: Cluster, namespace: str, name: str) -> int:
    scale = cluster.raw("GET", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/scale")
    return int(scale["spec"].get("replicas") or 0)


def operator_metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
