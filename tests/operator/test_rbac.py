"""The operator under its own ServiceAccount, bound by manifests/ RBAC, not as an admin."""

import pytest
from harness import OperatorProcess, service_account_kubeconfig, wait_for

SPEC = {"model": {"source": "file:///models/tiny"}, "resources": {"gpu": 0, "memory": "2Gi"}}


@pytest.fixture(scope="module")
def operator_kubeconfig(cluster, tmp_path_factory):
    return service_account_kubeconfig(
        cluster,
        ("namespace.yaml", "service_account.yaml", "rbac.yaml"),
        "goodput-operator",
        tmp_path_factory.mktemp("sa") / "operator.kubeconfig",
    )


@pytest.fixture(scope="module")
def operator(cluster, hub, operator_kubeconfig, tmp_path_factory):
    log = tmp_path_factory.mktemp("operator-sa") / "operator.log"
    with OperatorProcess(operator_kubeconfig, log, hub.endpoint) as process:
        yield process


def test_full_flow_works_with_the_operators_own_role(cluster, operator, namespace):
    cluster.create_service(namespace, "chat", SPEC)
    cluster.wait_deployment(namespace, "chat")
    wait_for(lambda: cluster.get_or_none(cluster.core.read_namespaced_service, "chat", namespace), what="the Service")
    cluster.wait_condition(namespace, "chat", "Valid", "True")
    wait_for(lambda: any(e.reason == "Created" for e in cluster.events(namespace, "chat")), what="events")

    cluster.kubectl("scale", "gsvc/chat", "--replicas=2", "-n", namespace)
    pdb_path = cluster.path("policy", namespace, "poddisruptionbudgets", "chat-runtime")
    wait_for(lambda: cluster.get_or_none(cluster.raw, "GET", pdb_path), what="a PodDisruptionBudget")
    cluster.kubectl("scale", "gsvc/chat", "--replicas=1", "-n", namespace)
    wait_for(lambda: cluster.get_or_none(cluster.raw, "GET", pdb_path) is None, what="the PDB to go")

    first = cluster.deployment(namespace, "chat")
    cluster.apps.delete_namespaced_deployment("chat-runtime", namespace)
    wait_for(
        lambda: (d := cluster.deployment(namespace, "chat")) and d.metadata.uid != first.metadata.uid,
        30,
        "the Deployment to be recreated",
    )
    log = operator.log()
    # what RBAC says when it refuses (other 403s, such as a terminating namespace, are not RBAC)
    assert 'User "system:serviceaccount:goodput-system:goodput-operator" cannot' not in log, log[-4000:]


def test_verbs_the_role_lacks_are_refused(cluster, operator_kubeconfig, namespace):
    for args in (
        ["get", "secrets", "-n", namespace],  # get one by name, never list
        ["create", "configmap", "x", "-n", namespace],
        ["delete", "secret", "hf-token", "-n", namespace],
        ["get", "pod", "chat-runtime-x", "-n", namespace],  # pods: list and watch only
        ["delete", "pod", "chat-runtime-x", "-n", namespace],
    ):
        result = cluster.kubectl(*args, check=False, kubeconfig=operator_kubeconfig)
        assert result.returncode != 0 and "forbidden" in result.stderr.lower(), (args, result.stderr)
        assert 'User "system:serviceaccount:goodput-system:goodput-operator" cannot' in result.stderr
