"""engine.kind against a real API server: the schema's enum and default, the operator's pod for vLLM, refusals."""

import json

import pytest
from kubernetes.client.exceptions import ApiException

from goodput_operator.settings import DEFAULT_VLLM_IMAGE

SPEC = {
    "model": {"source": "hf://acme/tiny-chat", "servedName": "chat", "maxModelLen": 2048},
    "engine": {"kind": "vllm", "maxNumSeqs": 16, "prefixCaching": True},
    "resources": {"gpu": 1, "memory": "8Gi"},
    "slo": {"ttft": "500ms", "tpot": "50ms"},
}


def test_a_vllm_service_gets_a_deployment_running_vllm(cluster, operator, namespace):
    cluster.create_service(namespace, "chat", SPEC)
    deployment = cluster.wait_deployment(namespace, "chat")
    container = deployment.spec.template.spec.containers[0]
    assert container.image == DEFAULT_VLLM_IMAGE
    assert container.command == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    args = container.args
    assert args[:4] == ["--model", "acme/tiny-chat", "--served-model-name", "chat"]
    assert args[args.index("--max-num-seqs") + 1] == "16" and "--enable-prefix-caching" in args
    assert "--slo-ttft" not in args  # our runtime's flag; vLLM gets the SLO as histogram boundaries
    buckets = json.loads(args[args.index("--custom-histogram-buckets") + 1])
    assert 0.5 in buckets["time_to_first_token"] and 0.05 in buckets["inter_token_latency"]
    for probe in (container.startup_probe, container.readiness_probe, container.liveness_probe):
        assert (probe.http_get.path, probe.http_get.port) == ("/health", "http")
    assert container.startup_probe.period_seconds * container.startup_probe.failure_threshold >= 1800
    assert [(p.name, p.container_port) for p in container.ports] == [("http", 8000)]
    assert container.lifecycle.pre_stop._exec.command == ["sleep", "5"]
    service = cluster.wait_kube_service(namespace, "chat")
    assert {p.name: p.port for p in service.spec.ports} == {"http": 80, "metrics": 8000}
    cluster.wait_condition(namespace, "chat", "Valid", "True")


def test_the_schema_defaults_the_engine_and_refuses_an_unknown_one(cluster, operator, namespace):
    created = cluster.create_service(
        namespace, "plain", {"model": {"source": "hf://acme/tiny-chat"}, "engine": {"maxNumSeqs": 4}}
    )
    assert created["spec"]["engine"]["kind"] == "goodput"
    with pytest.raises(ApiException) as err:
        cluster.create_service(
            namespace, "tgi", {"model": {"source": "hf://acme/tiny-chat"}, "engine": {"kind": "tgi"}}
        )
    assert err.value.status == 422 and "spec.engine.kind" in err.value.body


def test_a_field_vllm_cannot_honour_is_refused_and_builds_nothing(cluster, operator, namespace):
    spec = {**SPEC, "engine": {**SPEC["engine"], "maxQueue": 8}}
    cluster.create_service(namespace, "queued", spec)
    valid = cluster.wait_condition(namespace, "queued", "Valid", "False")
    assert valid["reason"] == "EngineUnsupportedField"
    assert valid["message"].startswith("spec.engine.maxQueue: cannot be honoured by engine.kind vllm")
    assert cluster.deployment(namespace, "queued") is None
