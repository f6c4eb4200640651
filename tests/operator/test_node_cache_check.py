"""spec.model.nodeCache checked against the ModelCache it names, on the real API server with the operator as a real
process: a ModelCache that does not exist, or that holds another repository or revision, is refused with the Valid
condition and a Warning Event naming the field, and no pod is made; the check runs again when the ModelCache
appears, changes or goes (the operator watches ModelCaches).

Generic ephemeral volumes need Kubernetes 1.21: on an older API server the Deployment of a service whose ModelCache
matches is refused by the server (the field's documented limit), so the step that turns the service valid runs only
on 1.21 or newer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
from harness import ROOT, wait_for

from goodput_contract.api import GROUP, MODEL_CACHE_PLURAL, VERSION

CRD_FILE = ROOT / "crds" / f"{GROUP}_modelcaches.yaml"
SPEC = {
    "model": {"source": "hf://acme/tiny-chat", "servedName": "chat", "nodeCache": "tiny-chat"},
    "resources": {"gpu": 0, "cpu": "1", "memory": "2Gi"},
}


@pytest.fixture(scope="module")
def model_cache_crd(cluster) -> Iterator[None]:
    cluster.kubectl("apply", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{MODEL_CACHE_PLURAL}.{GROUP}")
    yield


def server_minor(cluster) -> int:
    info = kubernetes.client.VersionApi(cluster.api).get_code()
    return int(str(info.minor).rstrip("+"))


def put_cache(cluster, namespace: str, name: str, spec: dict[str, Any]) -> None:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ModelCache", "metadata": {"name": name}, "spec": spec}
    try:
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, MODEL_CACHE_PLURAL, body)
    except kubernetes.client.ApiException as err:
        if err.status != 409:
            raise
        cluster.custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, MODEL_CACHE_PLURAL, name, {"spec": spec}
        )


def refusal(cluster, namespace: str, name: str, reason: str, *words: str) -> dict[str, Any]:
    """The Valid condition once it is False for `reason` with every word in its message."""

    def check() -> dict[str, Any] | None:
        valid = cluster.condition(namespace, name, "Valid") or {}
        ok = valid.get("status") == "False" and valid.get("reason") == reason
        return valid if ok and all(w in valid.get("message", "") for w in words) else None

    return wait_for(check, 60, f"Valid False, {reason}, naming {words}")


def test_a_missing_or_mismatched_model_cache_is_refused_naming_the_field_and_rechecked_as_it_changes(
    cluster, model_cache_crd, operator, namespace
):
    cluster.create_service(namespace, "chat", SPEC)
    valid = refusal(cluster, namespace, "chat", "NodeCacheNotFound", "spec.model.nodeCache", "'tiny-chat'")
    assert "does not exist" in valid["message"], valid
    events = wait_for(
        lambda: [e for e in cluster.events(namespace, "chat") if e.type == "Warning" and e.reason == "Invalid"],
        30,
        "a Warning Event",
    )
    assert "spec.model.nodeCache" in events[-1].message
    assert cluster.deployment(namespace, "chat") is None  # no pod left Pending for a volume that never comes

    # it appears, holding another repository: checked again without any change to the service
    put_cache(cluster, namespace, "tiny-chat", {"source": "hf://acme/other-model"})
    valid = refusal(cluster, namespace, "chat", "NodeCacheMismatch", "spec.model.nodeCache", "hf://acme/other-model")
    assert "hf://acme/tiny-chat" in valid["message"]

    # the right repository, but the service asks for a revision the ModelCache does not hold
    put_cache(cluster, namespace, "tiny-chat", {"source": "hf://acme/tiny-chat", "revision": "v2"})
    cluster.patch_service(namespace, "chat", {"spec": {"model": {"revision": "v1"}}})
    refusal(cluster, namespace, "chat", "NodeCacheMismatch", "spec.model.nodeCache", "'v2'", "'v1'")

    if server_minor(cluster) >= 21:  # a Deployment with a generic ephemeral volume: 1.21 and newer
        cluster.patch_service(namespace, "chat", {"spec": {"model": {"revision": "v2"}}})
        cluster.wait_condition(namespace, "chat", "Valid", "True")
        assert cluster.wait_deployment(namespace, "chat") is not None

    # the ModelCache deleted: refused again
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, MODEL_CACHE_PLURAL, "tiny-chat")
    refusal(cluster, namespace, "chat", "NodeCacheNotFound", "spec.model.nodeCache")
    assert "Traceback" not in operator.log()


def test_a_service_naming_no_model_cache_is_not_held_by_the_check(cluster, model_cache_crd, operator, namespace):
    cluster.create_service(namespace, "plain", {**SPEC, "model": {"source": "hf://acme/tiny-chat"}})
    cluster.wait_condition(namespace, "plain", "Valid", "True")
    assert cluster.wait_deployment(namespace, "plain") is not None
