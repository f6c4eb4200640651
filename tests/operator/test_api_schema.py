"""The CRD as a user meets it: the server refuses bad specs and explains good ones."""

import pytest
from kubernetes.client.exceptions import ApiException

GOOD = {"model": {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct"}}


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"model": {"source": "s3://bucket/model"}}, "spec.model.source"),
        ({"model": {"source": "hf://org/name", "dtype": "float8"}}, "spec.model.dtype"),
        ({"model": {"source": "hf://org/name", "quantization": "int4"}}, "spec.model.quantization"),
        ({**GOOD, "replicas": -1}, "spec.replicas"),
        ({**GOOD, "slo": {"ttft": "half a second"}}, "spec.slo.ttft"),
        ({**GOOD, "slo": {"attainment": 1.5}}, "spec.slo.attainment"),
        ({**GOOD, "engine": {"gpuMemoryUtilization": 1.2}}, "spec.engine.gpuMemoryUtilization"),
        ({**GOOD, "parallelism": {"tensor": 0}}, "spec.parallelism.tensor"),
        ({**GOOD, "autoscaling": {"mode": "magic"}}, "spec.autoscaling.mode"),
        ({**GOOD, "routing": {"policy": "round-robin"}}, "spec.routing.policy"),
        ({**GOOD, "resources": {"memory": "lots"}}, "spec.resources.memory"),
        ({"engine": {"maxNumSeqs": 8}}, "spec.model"),
    ],
)
def test_server_refuses_invalid_specs_naming_the_field(cluster, namespace, spec, field):
    with pytest.raises(ApiException) as err:
        cluster.create_service(namespace, "bad", spec)
    assert err.value.status == 422
    assert field in err.value.body


def test_defaults_are_filled_in_by_the_server(cluster, namespace):
    created = cluster.create_service(namespace, "defaults", GOOD)
    assert created["spec"]["model"]["revision"] == "main"
    assert created["spec"]["model"]["dtype"] == "auto"
    assert created["spec"]["model"]["quantization"] == "none"
    with_routing = cluster.create_service(namespace, "routed", {**GOOD, "routing": {}})
    assert with_routing["spec"]["routing"]["policy"] == "prefix"


def test_short_name_and_printer_columns(cluster, namespace):
    cluster.create_service(namespace, "chat", GOOD)
    out = cluster.kubectl("get", "gsvc", "-n", namespace).stdout
    header = out.splitlines()[0].split()
    assert header == ["NAME", "MODEL", "REPLICAS", "READY", "STATUS", "ATTAINMENT", "AGE"]
    assert "hf://Qwen/Qwen2.5-0.5B-Instruct" in out


def test_kubectl_explain_teaches_the_slo(cluster):
    out = cluster.kubectl("explain", "inferenceservice.spec.slo").stdout
    assert "latency objective" in out
    assert "ttft" in out and "500ms" in out
    assert "attainment" in out


def test_scale_subresource_sets_spec_replicas(cluster, namespace):
    cluster.create_service(namespace, "scaled", GOOD)
    cluster.kubectl("scale", "gsvc/scaled", "--replicas=3", "-n", namespace)
    assert cluster.get_service(namespace, "scaled")["spec"]["replicas"] == 3


def test_status_is_a_subresource_users_cannot_write_through_spec(cluster, namespace):
    cluster.create_service(namespace, "st", GOOD)
    patched = cluster.patch_service(namespace, "st", {"status": {"url": "http://elsewhere"}})
    assert "url" not in (patched.get("status") or {})
