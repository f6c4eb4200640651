"""A ServiceMonitor appears only where the Prometheus operator's CRDs exist."""

import pytest
from harness import wait_for

SPEC = {"model": {"source": "file:///models/tiny"}, "resources": {"gpu": 0, "memory": "2Gi"}}
SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {"kind": "ServiceMonitor", "plural": "servicemonitors", "singular": "servicemonitor"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }
        ],
    },
}


def _monitor(cluster, namespace, name):
    path = f"/apis/monitoring.coreos.com/v1/namespaces/{namespace}/servicemonitors/{name}"
    return cluster.get_or_none(cluster.raw, "GET", path)


@pytest.fixture
def prometheus_operator_crds(cluster):
    cluster.raw("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", SERVICE_MONITOR_CRD)
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/servicemonitors.monitoring.coreos.com")
    yield
    cluster.raw(
        "DELETE", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/servicemonitors.monitoring.coreos.com"
    )


def test_without_the_crd_the_service_is_served_without_a_monitor(cluster, operator, namespace):
    cluster.create_service(namespace, "plain", SPEC)
    cluster.wait_condition(namespace, "plain", "Valid", "True")
    cluster.wait_deployment(namespace, "plain")
    assert "monitoring.coreos.com" not in {g["name"] for g in cluster.raw("GET", "/apis")["groups"]}
    assert "Traceback" not in operator.log()


def test_service_monitor_when_the_crd_exists(cluster, operator, prometheus_operator_crds, namespace):
    cluster.create_service(namespace, "watched", SPEC)
    monitor = wait_for(lambda: _monitor(cluster, namespace, "watched"), 60, "a ServiceMonitor")
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    assert monitor["spec"]["selector"] == {"matchLabels": {"serving.goodput.dev/service": "watched"}}
    assert monitor["metadata"]["ownerReferences"][0]["name"] == "watched"
