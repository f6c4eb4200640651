"""hpa and keda modes: the external autoscaler's object points at the scale subresource."""

import pytest

from goodput_contract.api.spec import SpecError, parse
from goodput_operator.autoscaling.external import build_hpa, build_scaled_object
from goodput_operator.builders import owner_reference

OWNER = owner_reference("chat", "uid-1")
MODEL = {"source": "hf://Qwen/Qwen2.5-7B-Instruct", "servedName": "qwen"}
TARGET = {"apiVersion": "serving.goodput.dev/v1alpha1", "kind": "InferenceService", "name": "chat"}


def test_hpa_holds_the_service_at_the_goodput_laws_desired_replicas():
    svc = parse(
        "chat",
        "ns",
        {"model": MODEL, "autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 6, "scaleDownWindow": "10m"}},
    )
    hpa = build_hpa(svc, OWNER, "autoscaling/v2beta2")
    assert hpa["apiVersion"] == "autoscaling/v2beta2"
    assert hpa["spec"]["scaleTargetRef"] == TARGET
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 6)
    # an AverageValue target of 1 makes HPA's desired count equal the metric's value
    assert hpa["spec"]["metrics"] == [
        {
            "type": "External",
            "external": {
                "metric": {
                    "name": "goodput_autoscaler_desired_replicas",
                    "selector": {"matchLabels": {"namespace": "ns", "name": "chat"}},
                },
                "target": {"type": "AverageValue", "averageValue": "1"},
            },
        }
    ]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600
    assert build_scaled_object(svc, OWNER) is None


def test_keda_follows_the_goodput_laws_desired_replicas_from_prometheus():
    svc = parse(
        "chat",
        "ns",
        {
            "model": MODEL,
            "autoscaling": {
                "mode": "keda",
                "minReplicas": 0,
                "maxReplicas": 4,
                "prometheusAddress": "http://prom:9090",
            },
        },
    )
    scaled = build_scaled_object(svc, OWNER)
    assert scaled["spec"]["scaleTargetRef"] == TARGET
    assert scaled["spec"]["minReplicaCount"] == 0
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["metadata"] == {
        "serverAddress": "http://prom:9090",
        "query": 'max(goodput_autoscaler_desired_replicas{namespace="ns",name="chat"})',
        "threshold": "1",
    }
    assert build_hpa(svc, OWNER) is None


@pytest.mark.parametrize(
    ("autoscaling", "field", "reason"),
    [
        ({"mode": "hpa", "minReplicas": 0, "maxReplicas": 2}, "spec.autoscaling.minReplicas", "HPACannotScaleToZero"),
        ({"mode": "keda", "maxReplicas": 2}, "spec.autoscaling.prometheusAddress", "PrometheusAddressMissing"),
    ],
)
def test_mode_specific_mistakes_name_the_field(autoscaling, field, reason):
    with pytest.raises(SpecError) as err:
        parse("chat", "ns", {"model": MODEL, "autoscaling": autoscaling})
    assert (err.value.field, err.value.reason) == (field, reason)
