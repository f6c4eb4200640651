"""The gateway under its own ServiceAccount, bound by manifests/gateway-rbac.yaml: it reads what it
routes by and nothing more."""

import pytest
from gateway_helpers import Started, publish, tiny_spec
from harness import service_account_kubeconfig, wait_for

USER = "system:serviceaccount:goodput-system:goodput-gateway"


@pytest.fixture(scope="module")
def gateway_kubeconfig(cluster, tmp_path_factory):
    return service_account_kubeconfig(
        cluster,
        ("namespace.yaml", "gateway-rbac.yaml"),
        "goodput-gateway",
        tmp_path_factory.mktemp("gateway-sa") / "gateway.kubeconfig",
    )


def test_the_gateway_discovers_services_with_its_own_role(cluster, gateway_kubeconfig, namespace, tmp_path):
    cluster.create_service(namespace, "chat", tiny_spec("chat-model"))
    publish(cluster, namespace, "chat", "p0", 8000)
    with Started() as started:
        gateway = started.gateway(gateway_kubeconfig, tmp_path / "gateway.log")
        wait_for(
            lambda: any(m["id"] == "chat-model" and m["ready_replicas"] == 1 for m in gateway.models()),
            20,
            "the service and its endpoint in /v1/models",
        )
        assert "forbidden" not in gateway.log().lower(), gateway.log()[-3000:]


def test_verbs_the_role_lacks_are_refused(cluster, gateway_kubeconfig, namespace):
    cluster.create_service(namespace, "other", tiny_spec())
    for args in (
        ["get", "inferenceservice", "other", "-n", namespace],  # list and watch only
        ["patch", "inferenceservice", "other", "-n", namespace, "--type=merge", "-p", '{"spec":{}}'],
        ["get", "secrets", "-n", namespace],
        ["get", "pods", "-n", namespace],
        ["get", "services", "-n", namespace],
        ["delete", "endpointslice", "other-p0", "-n", namespace],
    ):
        result = cluster.kubectl(*args, check=False, kubeconfig=gateway_kubeconfig)
        assert result.returncode != 0 and f'User "{USER}" cannot' in result.stderr, (args, result.stderr)
