"""The operator process itself: one namespace by flag, a liveness endpoint, its own metrics."""

import time
import urllib.request

import pytest
from autoscaling_helpers import free_port
from harness import OperatorProcess, wait_for

SPEC = {"model": {"source": "file:///models/tiny"}, "resources": {"gpu": 0, "memory": "2Gi"}}


def _get(url):
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, response.read().decode()


@pytest.fixture(scope="module")
def watched(cluster):
    with cluster.scratch_namespace("w") as name:
        yield name


@pytest.fixture(scope="module")
def operator(cluster, hub, watched, tmp_path_factory):
    ports = {"liveness": free_port(), "metrics": free_port()}
    log = tmp_path_factory.mktemp("operator-ns") / "operator.log"
    flags = ("--namespace", watched, "--liveness-port", str(ports["liveness"]), "--metrics-port", str(ports["metrics"]))
    with OperatorProcess(cluster.kubeconfig, log, hub.endpoint, *flags) as process:
        process.ports = ports
        yield process


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
