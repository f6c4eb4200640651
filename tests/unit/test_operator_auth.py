"""spec.auth.apiKeySecretRef and spec.networkPolicy in the operator's builders."""

from __future__ import annotations

import json

import pytest

from goodput_contract.api.spec import SpecError, parse
from goodput_operator import builders, engines, network
from goodput_operator.settings import Settings

OWNER = builders.owner_reference("chat", "uid-1")
SPEC = {"model": {"source": "hf://org/model"}, "auth": {"apiKeySecretRef": {"name": "chat-keys", "key": "k"}}}


def container(spec: dict) -> dict:
    svc = parse("chat", "team", spec)
    engines.validate(svc)
    return builders.build_deployment(svc, Settings(), OWNER)["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(("kind", "variable"), [("goodput", "GOODPUT_API_KEY"), ("vllm", "VLLM_API_KEY")])
def test_the_key_reaches_the_engine_from_its_secret_only(kind: str, variable: str) -> None:
    c = container({**SPEC, "engine": {"kind": kind}})
    [entry] = [e for e in c["env"] if e["name"] == variable]
    assert entry == {"name": variable, "valueFrom": {"secretKeyRef": {"name": "chat-keys", "key": "k"}}}
    assert not any("key" in a.lower() for a in c["args"])


def test_the_default_key_name_is_api_key_and_no_auth_means_no_variable() -> None:
    c = container({**SPEC, "auth": {"apiKeySecretRef": {"name": "chat-keys"}}})
    assert {"name": "GOODPUT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "chat-keys", "key": "apiKey"}}} in c[
        "env"
    ]
    assert all(e["name"] != "GOODPUT_API_KEY" for e in container({"model": SPEC["model"]})["env"])


def test_an_engine_that_takes_keys_only_as_arguments_is_refused() -> None:
    svc = parse("chat", "team", {**SPEC, "engine": {"kind": "sglang"}, "resources": {"gpu": 1}})
    with pytest.raises(SpecError) as caught:
        engines.validate(svc)
    assert caught.value.field == "spec.auth.apiKeySecretRef"


def test_a_key_in_the_pod_environment_of_the_spec_is_refused() -> None:
    with pytest.raises(SpecError) as caught:
        parse(
            "chat",
            "team",
            {**SPEC, "template": {"env": [{"name": "A", "value": "1"}, {"name": "GOODPUT_API_KEY", "value": "sk-1"}]}},
        )
    assert caught.value.field == "spec.template.env[1]"
    assert "sk-1" not in str(caught.value)


def test_the_network_policy_admits_the_gateway_the_namespace_and_monitoring_on_the_serving_port() -> None:
    svc = parse("chat", "team", SPEC)
    settings = Settings(gateway_namespace="goodput-system", monitoring_namespace="observability")
    policy = network.build_network_policy(svc, settings, OWNER)
    assert policy["metadata"]["ownerReferences"] == [OWNER]
    assert policy["metadata"]["namespace"] == "team"
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": builders.selector_labels(svc)}
    assert spec["policyTypes"] == ["Ingress"]
    [rule] = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": engines.RUNTIME_PORT}]
    peers = json.dumps(rule["from"])
    assert rule["from"][0] == {"podSelector": {}}
    assert '"kubernetes.io/metadata.name": "goodput-system"' in peers and "goodput-gateway" in peers
    assert '"kubernetes.io/metadata.name": "observability"' in peers
    assert len(rule["from"]) == 3


def test_network_policy_is_on_by_default_and_can_be_turned_off() -> None:
    assert parse("chat", "team", SPEC).network_policy is True
    assert parse("chat", "team", {**SPEC, "networkPolicy": False}).network_policy is False
    assert Settings.from_env({"MONITORING_NAMESPACE": "prom"}).monitoring_namespace == "prom"
