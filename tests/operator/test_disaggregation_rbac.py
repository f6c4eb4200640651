"""spec.disaggregation under the operator's own ServiceAccount (manifests/ RBAC, not an admin): the prefill
role is made, its replicas handed to the autoscaler's field manager, and removed with the field."""

import pytest
from harness import OperatorProcess, service_account_kubeconfig, wait_for

SPEC = {
    "model": {"source": "file:///models/tiny"},
    "resources": {"gpu": 0, "memory": "2Gi"},
    "autoscaling": {"mode": "goodput", "minReplicas": 1, "maxReplicas": 3},
    "disaggregation": {"prefill": {"minReplicas": 1, "maxReplicas": 2}, "decode": {"minReplicas": 1}},
}


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


def _prefill(cluster, namespace):
    return cluster.get_or_none(cluster.apps.read_namespaced_deployment, "pd-prefill", namespace)


def test_both_roles_come_and_go_under_the_operators_own_role(cluster, operator, operator_kubeconfig, namespace):
    cluster.create_service(namespace, "pd", SPEC)
    prefill = wait_for(lambda: _prefill(cluster, namespace), what="Deployment pd-prefill")
    assert prefill.spec.replicas == 1
    wait_for(
        lambda: "serving.goodput.dev/replicas-manager" in (_prefill(cluster, namespace).metadata.annotations or {}),
        what="the prefill replicas handed to the autoscaler",
    )
    wait_for(lambda: cluster.get_or_none(cluster.core.read_namespaced_service, "pd-prefill", namespace), what="Service")
    # the autoscaler's write: the prefill Deployment's scale subresource, which the role allows
    scaled = cluster.kubectl(
        "scale", "deployment/pd-prefill", "--replicas=2", "-n", namespace, kubeconfig=operator_kubeconfig, check=False
    )
    assert scaled.returncode == 0, scaled.stderr

    cluster.patch_service(namespace, "pd", {"spec": {"disaggregation": None}})
    wait_for(lambda: _prefill(cluster, namespace) is None, what="Deployment pd-prefill deleted")
    wait_for(
        lambda: cluster.get_or_none(cluster.core.read_namespaced_service, "pd-prefill", namespace) is None,
        what="Service pd-prefill deleted",
    )
    log = operator.log()
    assert 'User "system:serviceaccount:goodput-system:goodput-operator" cannot' not in log, log[-4000:]
