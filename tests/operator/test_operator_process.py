"""The operator process itself: one namespace by flag, a liveness endpoint, its own metrics."""

import socket
import time
import urllib.request
import uuid

import pytest
from harness import OperatorProcess, wait_for

SPEC = {"model": {"source": "file:///models/tiny"}, "resources": {"gpu": 0, "memory": "2Gi"}}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url):
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, response.read().decode()


@pytest.fixture(scope="module")
def watched(cluster):
    name = f"w-{uuid.uuid4().hex[:8]}"
    cluster.core.create_namespace({"metadata": {"name": name}})
    yield name
    cluster.core.delete_namespace(name)


@pytest.fixture(scope="module")
def operator(cluster, hub, watched, tmp_path_factory):
    ports = {"liveness": _free_port(), "metrics": _free_port()}
    log = tmp_path_factory.mktemp("operator-ns") / "operator.log"
    process = OperatorProcess(
        cluster.kubeconfig,
        log,
        hub.endpoint,
        "--namespace",
        watched,
        "--liveness-port",
        str(ports["liveness"]),
        "--metrics-port",
        str(ports["metrics"]),
    ).start()
    process.ports = ports
    yield process
    process.stop()


def test_only_the_named_namespace_is_watched(cluster, operator, watched, namespace):
    cluster.create_service(namespace, "elsewhere", SPEC)
    cluster.create_service(watched, "here", SPEC)
    cluster.wait_deployment(watched, "here")
    time.sleep(2)
    assert cluster.deployment(namespace, "elsewhere") is None
    assert not (cluster.get_service(namespace, "elsewhere").get("status") or {}).get("conditions")


def test_liveness_endpoint_answers(operator):
    status, _ = wait_for(
        lambda: _get(f"http://127.0.0.1:{operator.ports['liveness']}/healthz"), 30, "the liveness endpoint"
    )
    assert status == 200


def test_metrics_count_reconciles_and_writes(cluster, operator, watched):
    cluster.create_service(watched, "counted", SPEC)
    cluster.wait_condition(watched, "counted", "Valid", "True")
    _, text = _get(f"http://127.0.0.1:{operator.ports['metrics']}/metrics")
    assert 'goodput_operator_reconciles_total{result="ok"}' in text
    assert "goodput_operator_reconcile_duration_seconds_bucket" in text
    assert 'goodput_operator_child_writes_total{action="created",kind="Deployment"}' in text
