"""spec.suspend: to zero and held there, status and children's definitions kept, until cleared."""

from harness import wait_for

SPEC = {"model": {"source": "file:///models/tiny"}, "resources": {"gpu": 0, "memory": "2Gi"}, "replicas": 2}
GROUPS = {**SPEC, "parallelism": {"tensor": 2, "nodes": 2}}  # on CPU: two pods of one rank each per replica


def _ready(cluster, namespace, name):
    return cluster.condition(namespace, name, "Ready") or {}


def test_suspend_holds_a_service_at_zero_and_clearing_it_restores_it(cluster, operator, namespace):
    cluster.create_service(namespace, "nap", SPEC)
    before = cluster.wait_deployment(namespace, "nap")
    assert before.spec.replicas == 2
    cluster.wait_condition(namespace, "nap", "Valid", "True")
    url = cluster.get_service(namespace, "nap")["status"]["url"]

    cluster.patch_service(namespace, "nap", {"spec": {"suspend": True}})
    wait_for(lambda: cluster.deployment(namespace, "nap").spec.replicas == 0, 30, "the Deployment at 0")
    ready = wait_for(lambda: (r := _ready(cluster, namespace, "nap")).get("reason") == "Suspended" and r, 30, "Ready")
    assert ready["status"] == "False" and "spec.suspend" in ready["message"]
    service = cluster.get_service(namespace, "nap")
    assert service["spec"]["replicas"] == 2  # what it returns to
    assert service["status"]["url"] == url  # the status is kept
    held = cluster.deployment(namespace, "nap")
    assert held.spec.template.spec.containers[0].args == before.spec.template.spec.containers[0].args
    assert cluster.wait_kube_service(namespace, "nap") is not None
    # a scale while suspended is remembered, not acted on
    cluster.patch_service(namespace, "nap", {"spec": {"replicas": 3}})
    wait_for(
        lambda: (
            (s := cluster.get_service(namespace, "nap"))["status"]["observedGeneration"] == s["metadata"]["generation"]
        ),
        30,
        "the scale reconciled",
    )
    assert cluster.deployment(namespace, "nap").spec.replicas == 0

    cluster.patch_service(namespace, "nap", {"spec": {"suspend": False}})
    wait_for(lambda: cluster.deployment(namespace, "nap").spec.replicas == 3, 30, "the Deployment back at 3")
    wait_for(lambda: _ready(cluster, namespace, "nap").get("reason") != "Suspended", 30, "Ready past Suspended")
    assert "Traceback" not in operator.log()


def test_suspend_keeps_the_groups_of_replicas_spanning_pods_at_zero_pods(cluster, operator, namespace):
    cluster.create_service(namespace, "wide", GROUPS)

    def sizes():
        items = cluster.apps.list_namespaced_stateful_set(namespace, label_selector="serving.goodput.dev/service=wide")
        return {s.metadata.name: s.spec.replicas for s in items.items}

    wait_for(lambda: sizes() == {"wide-runtime-0": 2, "wide-runtime-1": 2}, 60, "two groups of two pods")
    cluster.patch_service(namespace, "wide", {"spec": {"suspend": True}})
    wait_for(lambda: sizes() == {"wide-runtime-0": 0, "wide-runtime-1": 0}, 60, "both groups kept, at 0 pods")
    status = cluster.get_service(namespace, "wide")["status"]
    assert status["placement"] == {"mode": "StatefulSet", "podsPerReplica": 2, "ranksPerPod": 1}
    cluster.patch_service(namespace, "wide", {"spec": {"suspend": False}})
    wait_for(lambda: sizes() == {"wide-runtime-0": 2, "wide-runtime-1": 2}, 60, "both groups back")


def test_the_gateway_answers_a_suspended_services_requests_with_503_at_once(cluster, namespace, tmp_path):
    """The gateway (a real process reading the CR from the API server) refuses rather than holds."""
    import json
    import time
    import urllib.error
    import urllib.request

    from gateway_helpers import GatewayProcess

    spec = {**SPEC, "model": {**SPEC["model"], "servedName": "napping"}, "suspend": True}
    cluster.create_service(namespace, "napping", spec)
    gateway = GatewayProcess(cluster.kubeconfig, tmp_path / "gateway.log", "--hold-seconds", "30").start()
    try:
        models = wait_for(
            lambda: "napping" in urllib.request.urlopen(gateway.url + "/v1/models", timeout=5).read().decode(),
            30,
            "the gateway to list the service",
        )
        assert models
        body = json.dumps({"model": "napping", "prompt": "hi", "max_tokens": 1}).encode()
        request = urllib.request.Request(
            gateway.url + "/v1/completions", body, {"Content-Type": "application/json"}, method="POST"
        )
        started = time.monotonic()
        try:
            urllib.request.urlopen(request, timeout=20)
            raise AssertionError("a suspended service answered")
        except urllib.error.HTTPError as err:
            status, error, retry_after = err.code, json.loads(err.read())["error"], err.headers.get("Retry-After")
        assert time.monotonic() - started < 5  # not held for the 30 s hold
        assert status == 503 and error["code"] == "service_suspended" and retry_after
        assert "suspended" in error["message"] and f"{namespace}/napping" in error["message"]
    finally:
        gateway.stop()
