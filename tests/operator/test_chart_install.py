"""The Helm chart against a real API server: with no values it renders the objects `kubectl apply -k
manifests/` applies, and Helm's own library (helm-python-sdk) installs, upgrades and uninstalls it.
No node runs here, so the pods stay Pending: the e2e tier and `INSTALL=helm make demo` serve through it."""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import helm_python as helm
import pytest
import yaml
from harness import ROOT, wait_for
from kubernetes.client.rest import ApiException
from test_install import _modern_kubectl

from goodput_contract.version import VERSION

CHART = ROOT / "charts" / "goodput"
CLUSTER_SCOPED = (("ClusterRole", "goodput-operator"), ("ClusterRole", "goodput-gateway"))


def _key(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = obj["metadata"]
    return obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"]


def test_chart_with_no_values_renders_the_objects_of_kubectl_apply_k(cluster):
    kubectl = _modern_kubectl(cluster)
    kustomized = cluster.kubectl("kustomize", str(ROOT / "manifests"), kubectl=kubectl).stdout
    expected = {_key(o): o for o in yaml.safe_load_all(kustomized) if o}
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(name="goodput", namespace="goodput-system", is_install=True)
        crd_texts = [c["data"] for c in chart.crds]  # what Helm installs from crds/
    texts = [text for path, text in rendered.items() if path.endswith(".yaml")] + crd_texts
    got = {_key(o): o for text in texts for o in yaml.safe_load_all(text) if o}
    assert len(crd_texts) == len(list((ROOT / "crds").glob("serving.goodput.dev_*.yaml")))  # every kind
    assert sorted(got) == sorted(expected)
    for key, obj in expected.items():
        assert got[key] == obj, key


def _clear_cluster_scoped(cluster) -> None:
    """Other modules apply manifests/*rbac.yaml by kubectl; Helm adopts only objects it owns."""
    for kind, name in CLUSTER_SCOPED:
        for suffix in ("", "Binding"):
            cluster.kubectl("delete", f"{kind}{suffix}".lower(), name, "--ignore-not-found", check=False)


@pytest.fixture
def release_namespace(cluster):
    name = f"goodput-chart-{uuid.uuid4().hex[:6]}"
    yield name
    with contextlib.suppress(ApiException):
        cluster.core.delete_namespace(name)


def test_helm_installs_upgrades_and_uninstalls_the_chart(cluster, release_namespace):
    ns = release_namespace
    _clear_cluster_scoped(cluster)
    apps = cluster.apps
    with helm.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=ns) as cfg:
        # the namespace from --create-namespace, labelled by the chart's Namespace object
        cfg.install(CHART, "goodput", {"gateway": {"replicas": 3}}, namespace=ns, create_namespace=True, timeout=120)
        labels = cluster.core.read_namespace(ns).metadata.labels
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
        gateway = apps.read_namespaced_deployment("goodput-gateway", ns)
        assert gateway.spec.replicas == 3
        assert gateway.spec.template.spec.containers[0].image == f"ghcr.io/goodput-dev/goodput-operator:{VERSION}"
        operator = apps.read_namespaced_deployment("goodput-operator", ns)
        operator_env = {e.name: e.value for e in operator.spec.template.spec.containers[0].env}
        assert operator_env["GATEWAY_NAMESPACE"] == ns  # where the operator finds the gateway
        # the PodDisruptionBudget in the version this server serves (policy/v1beta1 before 1.21)
        pdb = cluster.kubectl("get", "pdb", "goodput-gateway", "-n", ns, "-o", "name")
        assert pdb.stdout.strip() == "poddisruptionbudget.policy/goodput-gateway"
        binding = cluster.kubectl("get", "clusterrolebinding", "goodput-operator", "-o", "yaml").stdout
        assert f"namespace: {ns}" in binding

        # an upgrade changes what its values change, in place
        uid = gateway.metadata.uid
        cfg.upgrade(
            CHART, "goodput", {"gateway": {"replicas": 2}, "images": {"operator": {"tag": "9.9.9"}}}, timeout=120
        )
        gateway = apps.read_namespaced_deployment("goodput-gateway", ns)
        assert gateway.metadata.uid == uid
        assert gateway.spec.replicas == 2
        assert gateway.spec.template.spec.containers[0].image == "ghcr.io/goodput-dev/goodput-operator:9.9.9"
        assert [r["revision"] for r in cfg.history("goodput")] == [1, 2]

        # a service in the release namespace, then uninstall: the CRDs, the namespace and the CR stay
        cluster.custom.create_namespaced_custom_object(
            "serving.goodput.dev",
            "v1alpha1",
            ns,
            "inferenceservices",
            {
                "apiVersion": "serving.goodput.dev/v1alpha1",
                "kind": "InferenceService",
                "metadata": {"name": "kept"},
                "spec": {"model": {"source": "hf://org/model"}},
            },
        )
        cfg.uninstall("goodput", timeout=120)
    wait_for(
        lambda: not apps.list_namespaced_deployment(ns).items,
        60,
        "the release's Deployments to go",
    )
    assert cluster.core.read_namespace(ns).status.phase == "Active"
    assert cluster.custom.get_namespaced_custom_object(
        "serving.goodput.dev", "v1alpha1", ns, "inferenceservices", "kept"
    )
    cluster.kubectl("get", "crd", "inferenceservices.serving.goodput.dev")
    for kind, name in CLUSTER_SCOPED:
        assert cluster.kubectl("get", kind.lower(), name, check=False).returncode != 0


@pytest.mark.parametrize(
    "values",
    [
        {
            "gateway": {"replicas": 3},
            "batch": {"store": "sqlite", "sqlite": {"size": "1Gi", "storageClassName": "local"}},
        },
        {
            "images": {"operator": {"digest": "sha256:" + "a" * 64}, "pullSecrets": ["regcred"]},
            "operator": {
                "watchNamespace": "models",
                "nodeSelector": {"pool": "system"},
                "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
                "affinity": {
                    "nodeAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "weight": 1,
                                "preference": {"matchExpressions": [{"key": "pool", "operator": "Exists"}]},
                            }
                        ]
                    }
                },
                "extraEnv": [{"name": "PROMETHEUS_URL", "value": "http://prometheus.monitoring:9090"}],
            },
            "gateway": {
                "replicas": 3,
                "service": {"type": "NodePort", "port": 8080},
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
                "extraEnv": [{"name": "LOG_LEVEL", "value": "DEBUG"}],
            },
            "batch": {"store": "postgresql", "postgresql": {"secretName": "batch-db"}},
        },
    ],
    ids=["sqlite-store", "postgresql-and-placement"],
)
def test_the_api_server_accepts_what_the_values_render(cluster, release_namespace, values):
    """Rendered by Helm, then applied with a server-side dry run: every object the values produce passes the API
    server's own validation. (Helm's own server dry run does not submit the objects.)"""
    ns = release_namespace
    cluster.core.create_namespace({"metadata": {"name": ns}})
    with helm.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=ns) as cfg, helm.Chart.load(CHART) as chart:
        rendered = cfg.render(chart, {**values, "namespace": {"create": False}}, name="goodput", namespace=ns)
    docs = [doc for path, text in rendered.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ClusterRole"} <= kinds
    assert ("PersistentVolumeClaim" in kinds) == (values["batch"]["store"] == "sqlite")
    if "policy/v1" not in cluster.kubectl("api-versions").stdout.split():
        for doc in docs:  # an offline rendering assumes policy/v1; an install asks the server (1.20: v1beta1)
            if doc["kind"] == "PodDisruptionBudget":
                doc["apiVersion"] = "policy/v1beta1"
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input_text=yaml.safe_dump_all(docs))
    assert "deployment.apps/goodput-gateway created (server dry run)" in result.stdout, result.stdout
    owner = "deployment.apps/goodput-gateway-batch created (server dry run)"
    assert (owner in result.stdout) == (values["batch"]["store"] == "sqlite"), result.stdout
    assert not cluster.apps.list_namespaced_deployment(ns).items
