"""`kubectl apply -k manifests/` and the samples, checked by the server (dry run)."""

import json
import os
import shutil
import subprocess

import pytest
from harness import ROOT


def _modern_kubectl(cluster):
    """A kubectl whose kustomize takes directories as resources (1.21 or newer)."""
    for candidate in (os.environ.get("KUBECTL"), shutil.which("kubectl"), cluster.kubectl_path):
        if not candidate:
            continue
        out = subprocess.run([candidate, "version", "--client", "-o", "json"], capture_output=True, text=True)
        if out.returncode != 0:
            continue
        version = json.loads(out.stdout)["clientVersion"]
        if (int(version["major"]), int(version["minor"].rstrip("+"))) >= (1, 21):
            return candidate
    pytest.skip("needs kubectl 1.21 or newer for kustomize directories")


def test_kustomization_passes_a_server_side_dry_run(cluster):
    kubectl = _modern_kubectl(cluster)
    # the namespace must exist for the namespaced objects to be checked
    cluster.kubectl("apply", "-f", str(ROOT / "manifests" / "namespace.yaml"))
    rendered = cluster.kubectl("kustomize", str(ROOT / "manifests"), kubectl=kubectl).stdout
    if "policy/v1" not in cluster.kubectl("api-versions", kubectl=kubectl).stdout.split():
        rendered = rendered.replace("apiVersion: policy/v1\n", "apiVersion: policy/v1beta1\n")  # before 1.21
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input_text=rendered, kubectl=kubectl)
    for kind in (
        "customresourcedefinition",
        "serviceaccount",
        "clusterrole",
        "clusterrolebinding",
        "deployment",
        "service",
    ):
        assert kind in result.stdout.lower(), result.stdout
    for name in (
        "deployment.apps/goodput-gateway",
        "service/goodput-gateway",
        "serviceaccount/goodput-gateway",
        "poddisruptionbudget.policy/goodput-gateway",
        "clusterrole.rbac.authorization.k8s.io/goodput-gateway",
        # the Batch API on by default: its gateway, Service and SQLite store's claim
        "deployment.apps/goodput-gateway-batch",
        "service/goodput-gateway-batch",
        "persistentvolumeclaim/goodput-gateway-batch",
    ):
        assert name in result.stdout, result.stdout


def test_apply_manifests_script_installs_the_same_on_this_server(cluster):
    kubectl = _modern_kubectl(cluster)
    result = subprocess.run(
        [str(ROOT / "hack" / "apply-manifests.sh"), "--dry-run=server"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KUBECTL": kubectl, "KUBECONFIG": str(cluster.kubeconfig)},
    )
    assert result.returncode == 0, result.stderr
    assert "poddisruptionbudget.policy/goodput-gateway" in result.stdout


def test_samples_pass_a_server_side_dry_run(cluster, namespace):
    result = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(ROOT / "manifests" / "samples"))
    assert "inferenceservice.serving.goodput.dev/chat" in result.stdout
