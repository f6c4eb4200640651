"""`kubectl apply -k manifests/` and the samples, checked by the server (dry run)."""

import json
import os
import shutil
import subprocess

import pytest
from harness import ROOT

pytestmark = pytest.mark.apiserver


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
    result = cluster.kubectl("apply", "--dry-run=server", "-k", str(ROOT / "manifests"), kubectl=kubectl)
    for kind in ("customresourcedefinition", "serviceaccount", "clusterrole", "clusterrolebinding",
                 "deployment", "service"):
        assert kind in result.stdout.lower(), result.stdout


def test_samples_pass_a_server_side_dry_run(cluster, namespace):
    result = cluster.kubectl("apply", "--dry-run=server", "-n", namespace,
                             "-f", str(ROOT / "manifests" / "samples"))
    assert "inferenceservice.serving.goodput.dev/chat" in result.stdout
