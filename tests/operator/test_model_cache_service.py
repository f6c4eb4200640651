"""An InferenceService reading a ModelCache's node copies (spec.model.nodeCache), on the real API server with the
operator as a real process: the Deployment the server stores carries the ephemeral claim on the cache's local
volumes and points the runtime at it. The test cluster has no scheduler or kubelet: binding the claim at
scheduling (which places the pod on a node holding the model) is Kubernetes' own and is not run here.
Generic ephemeral volumes need Kubernetes 1.21 (beta, on by default; GA in 1.23): an older API server drops
the volume's source and refuses the Deployment, so the first test runs only on 1.21 or newer."""

from __future__ import annotations

import kubernetes
import pytest
from harness import ROOT

from goodput_contract.api import GROUP, MODEL_CACHE_PLURAL, VERSION
from goodput_contract.api.model_cache_spec import STORAGE_CLASS, VOLUME_LABEL, cache_key

SPEC = {
    "model": {"source": "hf://acme/tiny-chat", "servedName": "chat", "nodeCache": "tiny-chat"},
    "resources": {"gpu": 0, "cpu": "1", "memory": "2Gi"},
}


def server_minor(cluster) -> int:
    info = kubernetes.client.VersionApi(cluster.api).get_code()
    return int(str(info.minor).rstrip("+"))


def test_the_pods_read_the_nodes_copy_through_a_claim_on_the_caches_volumes(cluster, operator, namespace):
    if server_minor(cluster) < 21:
        pytest.skip("generic ephemeral volumes need Kubernetes 1.21; this API server is older")
    # the ModelCache it names must exist and hold its repository (test_node_cache_check.py)
    cluster.kubectl("apply", "-f", str(ROOT / "crds" / f"{GROUP}_{MODEL_CACHE_PLURAL}.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{MODEL_CACHE_PLURAL}.{GROUP}")
    cache = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ModelCache", "metadata": {"name": "tiny-chat"}}
    cache["spec"] = {"source": SPEC["model"]["source"]}
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, MODEL_CACHE_PLURAL, cache)
    cluster.create_service(namespace, "chat", SPEC)
    deployment = cluster.wait_deployment(namespace, "chat")
    pod = deployment.spec.template.spec
    volume = next(v for v in pod.volumes if v.name == "model-node-cache")
    claim = volume.ephemeral.volume_claim_template.spec
    assert claim.selector.match_labels == {VOLUME_LABEL: cache_key(namespace, "tiny-chat")}
    assert (claim.storage_class_name, claim.access_modes) == (STORAGE_CLASS, ["ReadOnlyMany"])
    container = pod.containers[0]
    mount = next(m for m in container.volume_mounts if m.name == "model-node-cache")
    assert (mount.mount_path, mount.read_only) == ("/mnt/node-cache", True)
    assert container.args[:2] == ["--model", "/mnt/node-cache"] and "--revision" not in container.args
    cluster.wait_condition(namespace, "chat", "Valid", "True")


def test_a_node_cache_with_a_claim_source_is_refused_naming_the_field(cluster, operator, namespace):
    spec = {**SPEC, "model": {**SPEC["model"], "source": "pvc://weights/tiny"}}
    cluster.create_service(namespace, "claimed", spec)
    valid = cluster.wait_condition(namespace, "claimed", "Valid", "False")
    assert valid["reason"] == "NodeCacheNeedsHubSource" and "spec.model.nodeCache" in valid["message"]
