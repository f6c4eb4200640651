"""A GitOps sync never fights the autoscaler: the scale subresource is the one writer of spec.replicas, a
manifest from Git leaves replicas out (docs/install.md), and syncing it again after the autoscaler moved
replicas changes nothing. Synced as Argo CD does, with kubectl's client-side apply (its default) and with
server-side apply (its ServerSideApply=true option), against the real operator."""

from __future__ import annotations

import time

import yaml
from harness import wait_for

MANIFEST = {
    "apiVersion": "serving.goodput.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "synced"},
    "spec": {
        "model": {"source": "hf://acme/tiny-chat", "servedName": "chat", "maxModelLen": 2048},
        "resources": {"cpu": "2", "memory": "8Gi"},
        "autoscaling": {"mode": "none", "minReplicas": 1, "maxReplicas": 4},
    },
}


def _sync(cluster, namespace: str, manifest: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input_text=manifest)
    cluster.kubectl(
        "apply",
        "--server-side",
        "--field-manager=argocd-controller",
        "-n",
        namespace,
        "-f",
        "-",
        input_text=manifest,
    )


def test_a_second_sync_after_the_autoscaler_scaled_changes_nothing(cluster, operator, namespace):
    manifest = yaml.safe_dump(MANIFEST)
    _sync(cluster, namespace, manifest)
    wait_for(lambda: cluster.deployment(namespace, "synced").spec.replicas == 1, what="1 replica")

    # the autoscaler writes replicas through the scale subresource, as the operator's autoscaler does
    cluster.kubectl("scale", "gsvc/synced", "--replicas=3", "-n", namespace)
    wait_for(lambda: cluster.deployment(namespace, "synced").spec.replicas == 3, what="3 replicas")
    before = cluster.get_service(namespace, "synced")
    deployment_generation = cluster.deployment(namespace, "synced").metadata.generation

    _sync(cluster, namespace, manifest)
    # Argo CD's diff: the live object holds nothing the manifest would change
    diff = cluster.kubectl("diff", "-n", namespace, "-f", "-", input_text=manifest, check=False)
    assert diff.returncode == 0, diff.stdout + diff.stderr

    time.sleep(3)  # a reconcile the sync would have started has had time to write
    after = cluster.get_service(namespace, "synced")
    assert after["spec"]["replicas"] == 3
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"] == before["spec"]
    deployment = cluster.deployment(namespace, "synced")
    assert deployment.spec.replicas == 3
    assert deployment.metadata.generation == deployment_generation
