"""hpa and keda modes: an autoscaler object aimed at the scale subresource, and only in its mode."""

from harness import wait_for

SPEC = {
    "model": {"source": "file:///models/tiny"},
    "resources": {"gpu": 0, "memory": "2Gi"},
    "autoscaling": {"mode": "hpa", "minReplicas": 2, "maxReplicas": 5},
}


def _hpa(cluster, namespace, name):
    path = cluster.path("autoscaling", namespace, "horizontalpodautoscalers", name)
    return cluster.get_or_none(cluster.raw, "GET", path)


def test_hpa_mode_targets_the_scale_subresource_and_goes_with_the_mode(cluster, operator, namespace):
    cluster.create_service(namespace, "auto", SPEC)
    hpa = wait_for(lambda: _hpa(cluster, namespace, "auto"), what="a HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "serving.goodput.dev/v1alpha1",
        "kind": "InferenceService",
        "name": "auto",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    # spec.replicas is unset: the Deployment starts at minReplicas until the HPA writes it
    wait_for(lambda: cluster.deployment(namespace, "auto").spec.replicas == 2, what="2 replicas")

    cluster.patch_service(namespace, "auto", {"spec": {"autoscaling": {"mode": "none"}}})
    wait_for(lambda: _hpa(cluster, namespace, "auto") is None, what="the HPA to go")


def test_keda_mode_without_keda_is_reported(cluster, operator, namespace):
    spec = {**SPEC, "autoscaling": {"mode": "keda", "maxReplicas": 3, "prometheusAddress": "http://prom:9090"}}
    cluster.create_service(namespace, "keda", spec)
    valid = cluster.wait_condition(namespace, "keda", "Valid", "False")
    assert valid["reason"] == "KEDANotInstalled"
    assert cluster.deployment(namespace, "keda") is None
