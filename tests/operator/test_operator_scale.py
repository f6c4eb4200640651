"""Many services at small scale: a resync of unchanged services writes nothing, and makes no API call per service."""

from __future__ import annotations

import urllib.request

import pytest
from autoscaling_helpers import free_port
from harness import OperatorProcess, wait_for

COUNT = 30
RESYNC = 'trigger="resync"'  # the writes the resync passes sent (a side trigger follows a changed child)


def metric(port: int, name: str, having: str = "") -> float:
    """The sum of `name`'s series whose labels contain `having`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in " {" and having in line
    )


@pytest.fixture
def counted_operator(cluster, hub, tmp_path, namespace):
    """An operator of the test's namespace alone: services other tests left behind in the shared cluster
    (their namespaces still being deleted) are neither visited nor counted."""
    port = free_port()
    flags = ("--metrics-port", str(port), "--resync-seconds", "3", "--namespace", namespace)
    with OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", hub.endpoint, *flags) as process:
        yield process, port


def test_a_resync_of_unchanged_services_writes_nothing(cluster, counted_operator, namespace):
    _, port = counted_operator
    for i in range(COUNT):
        cluster.create_service(
            namespace,
            f"svc-{i:02d}",
            {"model": {"source": f"file:///models/m{i}"}, "resources": {"gpu": 0, "memory": "1Gi"}},
        )
    wait_for(
        lambda: len(cluster.apps.list_namespaced_deployment(namespace).items) == COUNT, 240, f"{COUNT} Deployments"
    )

    def settled() -> bool:
        items = cluster.custom.list_namespaced_custom_object(
            "serving.goodput.dev", "v1alpha1", namespace, "inferenceservices"
        )["items"]
        return all((i.get("status") or {}).get("observedGeneration") for i in items)

    wait_for(settled, 240, "every service to have a status")
    # two full resyncs after the last write: the second one starts from a settled state. The controller
    # manager may still move a Deployment's status now and then (and the operator rightly follows it), so
    # look for a window of two resyncs that wrote nothing; a resync that writes unchanged services never
    # gives one.
    start = metric(port, "goodput_operator_resyncs_total")
    wait_for(lambda: metric(port, "goodput_operator_resyncs_total") >= start + 2, 120, "two resyncs")
    windows = []
    for _ in range(5):
        writes = metric(port, "goodput_operator_api_writes_total", RESYNC)
        reconciles = metric(port, "goodput_operator_reconciles_total")
        mark = metric(port, "goodput_operator_resyncs_total")
        wait_for(lambda mark=mark: metric(port, "goodput_operator_resyncs_total") >= mark + 2, 120, "two more resyncs")
        windows.append(
            (
                metric(port, "goodput_operator_reconciles_total") - reconciles,
                metric(port, "goodput_operator_api_writes_total", RESYNC) - writes,
            )
        )
        if windows[-1][1] == 0:
            break
    visited, written = windows[-1]
    assert visited >= COUNT, windows  # each service was visited
    assert written == 0, windows  # ... and nothing was written
    # a new service still gets its Deployment
    cluster.create_service(
        namespace, "late", {"model": {"source": "file:///models/late"}, "resources": {"gpu": 0, "memory": "1Gi"}}
    )
    cluster.wait_deployment(namespace, "late")
