"""The goodput control loop against a real API server: its writes, its status, its refusal to guess.

No runtime pods here (the live proof is test_autoscaler_live.py): the service's
EndpointSlices are written by the test as the EndpointSlice controller would.
"""

import pytest
from autoscaling_helpers import free_port, host_address, operator_metric, put_endpoint, scale_replicas
from harness import ROOT, wait_for
from kubernetes.client.exceptions import ApiException
from live_pods import autoscaling_operator

SPEC = {
    "model": {"source": "file:///models/tiny", "servedName": "tiny"},
    "resources": {"gpu": 0, "memory": "2Gi"},
    "slo": {"ttft": "500ms", "tpot": "50ms", "attainment": 0.9},
    "autoscaling": {"mode": "goodput", "minReplicas": 2, "maxReplicas": 4, "scaleDownWindow": "10s"},
}


@pytest.fixture(scope="module")
def autoscaling(cluster, hub, tmp_path_factory):
    """The operator with a 1 s control period and a 3 s window, and the port of its metrics."""
    process, port = autoscaling_operator(cluster, hub, tmp_path_factory.mktemp("operator-autoscaler"), 1, 3)
    yield process, port
    process.stop()


@pytest.fixture(scope="module")
def operator(autoscaling):
    return autoscaling[0]


@pytest.fixture(scope="module")
def metrics_port(autoscaling):
    return autoscaling[1]


def test_replicas_outside_the_bounds_are_brought_in_through_the_scale_subresource(cluster, operator, namespace):
    cluster.create_service(namespace, "auto", {**SPEC, "replicas": 7})
    wait_for(lambda: scale_replicas(cluster, namespace, "auto") == 4, 20, "4 replicas written")
    decision = wait_for(
        lambda: (cluster.get_service(namespace, "auto").get("status") or {}).get("autoscaler", {}).get("lastDecision"),
        20,
        "status.autoscaler.lastDecision",
    )
    assert (decision["from"], decision["to"]) == (7, 4)
    assert "outside [2, 4]" in decision["reason"]
    wait_for(
        lambda: any(e.reason == "ScaledDown" and "7 → 4" in e.message for e in cluster.events(namespace, "auto")),
        20,
        "a ScaledDown event",
    )
    wait_for(lambda: cluster.deployment(namespace, "auto").spec.replicas == 4, 20, "the Deployment at 4")


def test_no_ready_pods_holds_at_min_without_writing(cluster, operator, namespace):
    cluster.create_service(namespace, "idle", SPEC)  # spec.replicas left out, as under GitOps
    autoscaler = wait_for(
        lambda: (cluster.get_service(namespace, "idle").get("status") or {}).get("autoscaler"), 20, "status.autoscaler"
    )
    assert autoscaler["message"] == "holding 2 replicas: no ready pods to read metrics from"
    assert (autoscaler["currentReplicas"], autoscaler["desiredReplicas"]) == (2, 2)
    assert "replicas" not in cluster.get_service(namespace, "idle")["spec"]


def test_unreadable_metrics_hold_the_count_and_are_counted(cluster, operator, namespace, metrics_port):
    cluster.create_service(namespace, "dark", {**SPEC, "replicas": 3})
    closed = free_port()  # nothing listens there: a pod whose metrics cannot be read
    for pod in ("a", "b"):
        put_endpoint(cluster, namespace, "dark", pod, host_address(), closed, ready=True)
    errors_before = operator_metric(metrics_port, "goodput_autoscaler_metric_errors_total")

    def message() -> str:
        return ((cluster.get_service(namespace, "dark").get("status") or {}).get("autoscaler") or {}).get("message", "")

    wait_for(lambda: "metrics of 2 of 2 ready pods unreadable" in message(), 20, "the hold to be explained")
    wait_for(
        lambda: operator_metric(metrics_port, "goodput_autoscaler_metric_errors_total") > errors_before,
        10,
        "goodput_autoscaler_metric_errors_total to count it",
    )
    assert scale_replicas(cluster, namespace, "dark") == 3  # held, not read as zero load
    assert operator_metric(metrics_port, 'goodput_autoscaler_desired_replicas{name="dark"') == 3


def test_in_hpa_mode_the_law_decides_and_the_hpa_alone_writes(cluster, operator, namespace, metrics_port):
    spec = {**SPEC, "replicas": 7, "autoscaling": {**SPEC["autoscaling"], "mode": "hpa"}}
    cluster.create_service(namespace, "advised", spec)
    autoscaler = wait_for(
        lambda: (cluster.get_service(namespace, "advised").get("status") or {}).get("autoscaler"),
        20,
        "status.autoscaler",
    )
    assert autoscaler["desiredReplicas"] == 4
    assert autoscaler["message"].startswith("hpa follows goodput_autoscaler_desired_replicas: ")
    assert "lastDecision" not in autoscaler
    wait_for(
        lambda: operator_metric(metrics_port, 'goodput_autoscaler_desired_replicas{name="advised"') == 4,
        20,
        "the decision exported for the HPA",
    )
    hpa = cluster.kubectl("get", "hpa", "advised", "-n", namespace, "-o", "json")  # any served version
    assert "goodput_autoscaler_desired_replicas" in hpa.stdout
    assert scale_replicas(cluster, namespace, "advised") == 7  # the operator wrote nothing


def test_the_operators_role_allows_what_the_loop_does_and_no_more(cluster):
    for part in ("namespace.yaml", "service_account.yaml", "rbac.yaml"):
        cluster.kubectl("apply", "-f", str(ROOT / "manifests" / part))
    who = "--as=system:serviceaccount:goodput-system:goodput-operator"

    def can(*args: str) -> bool:
        result = cluster.kubectl("auth", "can-i", *args, who, "-n", "default", check=False)
        return result.stdout.strip() == "yes"

    assert wait_for(
        lambda: can("patch", "inferenceservices.serving.goodput.dev", "--subresource=scale"),
        20,
        "the scale subresource to be granted",
    )
    assert can("get", "inferenceservices.serving.goodput.dev", "--subresource=scale")
    assert can("list", "endpointslices.discovery.k8s.io")
    assert not can("update", "inferenceservices.serving.goodput.dev", "--subresource=scale")
    assert not can("get", "pods")
    assert not can("watch", "endpointslices.discovery.k8s.io")


@pytest.mark.parametrize(
    ("field", "value"), [("capacityPerReplica", 0), ("targetUtilization", 1.5), ("idlePeriod", "soon")]
)
def test_the_server_refuses_bad_autoscaler_settings(cluster, namespace, field, value):
    spec = {**SPEC, "autoscaling": {**SPEC["autoscaling"], field: value}}
    with pytest.raises(ApiException) as refused:
        cluster.create_service(namespace, "bad", spec)
    assert refused.value.status == 422 and field in refused.value.body
