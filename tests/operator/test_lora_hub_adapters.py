"""spec.model.lora's hf:// adapters on a real API server with the operator as a real process: the schema
takes hf://org/repo[@revision] and a token reference; the Deployment hands them to the runtime's
--lora-modules and the token to HF_TOKEN from the Secret; a malformed source is refused by the API server
naming the field, and a second token by the operator naming it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from harness import wait_for
from kubernetes.client.exceptions import ApiException

from goodput_runtime.__main__ import build_parser, engine_config


def spec(adapters: list[dict[str, Any]], **model: Any) -> dict[str, Any]:
    return {
        "model": {"source": "file:///models/tiny", "servedName": "tiny", "lora": {"adapters": adapters}, **model},
        "resources": {"gpu": 0, "memory": "2Gi"},
    }


SUPPORT = {"name": "support", "source": "hf://acme/support-lora@v2", "tokenSecretRef": {"name": "hub", "key": "hf"}}


def test_hub_adapters_reach_the_runtime_flags_with_the_token_from_the_secret(cluster, operator, namespace):
    adapters = [SUPPORT, {"name": "sql", "source": "hf://acme/sql-lora"}]
    cluster.create_service(namespace, "chat", spec(adapters))
    stored = cluster.get_service(namespace, "chat")["spec"]["model"]["lora"]["adapters"]
    assert stored[0]["tokenSecretRef"] == {"name": "hub", "key": "hf"}  # kept by the schema, not pruned
    container = cluster.wait_deployment(namespace, "chat").spec.template.spec.containers[0]
    config = engine_config(build_parser().parse_args(container.args))
    assert config.lora_modules == (("support", "hf://acme/support-lora@v2"), ("sql", "hf://acme/sql-lora"))
    token = next(e for e in container.env if e.name == "HF_TOKEN")
    assert token.value is None  # by reference only
    assert (token.value_from.secret_key_ref.name, token.value_from.secret_key_ref.key) == ("hub", "hf")


@pytest.mark.parametrize("source", ["hf://no-org", "hf://acme/a/b/c", "hf://acme/a@"])
def test_a_malformed_hub_source_is_refused_by_the_api_server_naming_the_field(cluster, namespace, source):
    with pytest.raises(ApiException) as caught:
        cluster.create_service(namespace, "bad", spec([{"name": "a", "source": source}]))
    assert caught.value.status == 422
    causes = json.loads(caught.value.body)["details"]["causes"]
    # the API server names a list-map entry's field by the list (spec.model.lora.adapters.source)
    assert [c["field"] for c in causes] == ["spec.model.lora.adapters.source"], causes


def test_a_second_token_is_refused_naming_the_adapter_field(cluster, operator, namespace):
    cluster.create_service(namespace, "two-tokens", spec([SUPPORT], tokenSecretRef={"name": "model-token"}))

    def refused() -> dict[str, Any] | None:
        valid = cluster.condition(namespace, "two-tokens", "Valid") or {}
        return valid if valid.get("status") == "False" else None

    valid = wait_for(refused, 60, "Valid False")
    assert "spec.model.lora.adapters[0].tokenSecretRef" in valid["message"], valid
    assert "model.tokenSecretRef" in valid["message"] and cluster.deployment(namespace, "two-tokens") is None


def test_a_lora_adapter_of_the_kind_takes_a_hub_source(cluster, operator, namespace):
    from goodput_contract.api import GROUP, LORA_PLURAL, VERSION

    service = spec([SUPPORT])
    service["model"]["lora"]["runtimeUpdates"] = True
    cluster.create_service(namespace, "chat", service)
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LoraAdapter",
        "metadata": {"name": "sql"},
        "spec": {"service": "chat", "source": "hf://acme/sql-lora@v3"},
    }
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, LORA_PLURAL, body)

    def pending() -> dict[str, Any] | None:  # valid, waiting for a ready replica to load it on
        obj = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, LORA_PLURAL, "sql")
        conditions = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or ()}
        valid = conditions.get("Valid", {}).get("status") == "True"
        return obj if valid and (obj.get("status") or {}).get("phase") == "Pending" else None

    wait_for(pending, 60, "the LoraAdapter Pending and Valid")
