"""spec.auth and spec.networkPolicy through a real API server and the operator process."""

from __future__ import annotations

import json

from harness import wait_for
from kubernetes.client.exceptions import ApiException

KEY = "sk-goodput-scan-5e0c2b7d"
SPEC = {
    "model": {"source": "hf://acme/tiny-chat", "servedName": "chat"},
    "resources": {"gpu": 0},
    "auth": {"apiKeySecretRef": {"name": "chat-keys"}},
}


def test_the_key_is_in_no_object_event_or_log_of_the_operator(cluster, operator, namespace):
    cluster.core.create_namespaced_secret(namespace, {"metadata": {"name": "chat-keys"}, "stringData": {"apiKey": KEY}})
    cluster.create_service(namespace, "chat", SPEC)
    deployment = cluster.wait_deployment(namespace, "chat")
    cluster.wait_condition(namespace, "chat", "Valid", "True")
    container = deployment.spec.template.spec.containers[0]
    [variable] = [e for e in container.env if e.name == "GOODPUT_API_KEY"]
    assert variable.value is None
    assert (variable.value_from.secret_key_ref.name, variable.value_from.secret_key_ref.key) == ("chat-keys", "apiKey")
    # a spec change, so the operator logs, posts Events and writes status once more
    cluster.patch_service(namespace, "chat", {"spec": {"engine": {"maxNumSeqs": 4}}})
    wait_for(
        lambda: "4" in cluster.deployment(namespace, "chat").spec.template.spec.containers[0].args,
        30,
        "the change to reach the Deployment",
    )
    scanned = {
        "Deployment": json.dumps(cluster.api.sanitize_for_serialization(cluster.deployment(namespace, "chat"))),
        "InferenceService": json.dumps(cluster.get_service(namespace, "chat")),
        "Events": json.dumps(
            [cluster.api.sanitize_for_serialization(e) for e in cluster.core.list_namespaced_event(namespace).items]
        ),
        "Service": json.dumps(
            cluster.api.sanitize_for_serialization(cluster.core.read_namespaced_service("chat", namespace))
        ),
        "operator log": operator.log(),
    }
    assert "Created" in scanned["Events"] and "chat" in scanned["operator log"]
    for where, text in scanned.items():
        assert KEY not in text, where


def test_a_key_written_into_the_pod_environment_of_the_spec_is_refused(cluster, operator, namespace):
    cluster.create_service(
        namespace, "leaky", {**SPEC, "template": {"env": [{"name": "GOODPUT_API_KEY", "value": KEY}]}}
    )
    valid = cluster.wait_condition(namespace, "leaky", "Valid", "False")
    assert valid["reason"] == "APIKeyInSpec"
    assert valid["message"].startswith("spec.template.env[0]: ")
    assert KEY not in valid["message"]
    assert cluster.deployment(namespace, "leaky") is None


def network_policy(cluster, namespace, name):
    try:
        return cluster.raw("GET", f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies/{name}")
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def test_the_network_policy_is_made_by_default_and_removed_when_turned_off(cluster, operator, namespace):
    cluster.create_service(namespace, "chat", SPEC)
    policy = wait_for(lambda: network_policy(cluster, namespace, "chat-runtime"), 30, "the NetworkPolicy")
    assert policy["spec"]["podSelector"] == {"matchLabels": {"serving.goodput.dev/service": "chat"}}
    assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert policy["metadata"]["ownerReferences"][0]["name"] == "chat"
    cluster.patch_service(namespace, "chat", {"spec": {"networkPolicy": False}})
    wait_for(lambda: network_policy(cluster, namespace, "chat-runtime") is None, 30, "the NetworkPolicy to go")
    reasons = [(e.reason, e.message) for e in cluster.events(namespace, "chat")]
    assert ("Deleted", "Deleted NetworkPolicy chat-runtime") in reasons
