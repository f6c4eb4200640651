"""End to end on a real one-node cluster.

The session brings up hack/cluster.sh's control plane with this machine as its node
(containerd, runc, CNI bridge, kubelet, kube-proxy, kube-scheduler), or uses the one already
running here (`make demo` leaves one; a machine has one node), builds both images
from the project's Dockerfiles with hack/images.sh and imports them into the node's
containerd, installs Goodput with `kubectl apply -k manifests/`, and puts locally made
models on a hostPath PersistentVolume. Everything a module makes lives in its own namespace,
`goodput-e2e-<module>`, and one PersistentVolume, both removed when it ends; a node the session brought
up is taken down after the last e2e module, one it found running is left running. The modules share the
node. A module's namespace goes on terminating while the next module runs (the namespace controller
waits out its pods' grace period, ~11 s, before it looks again), so the next one never waits for it;
the last module waits for its own. Nothing is mocked; needs root on Debian/Ubuntu.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import tier
from node import OPERATOR_NAMESPACE, ROOT, Node, copy_model, node_unsupported, run, wait_for

NAMESPACE = "goodput-e2e"  # each module's namespace is this and the module's name
MODELS_CLAIM = "models"
OPERATOR_READY_SECONDS = 180


pytest_collection_modifyitems = tier(__file__, "e2e")


_SHARED: dict[str, Node] = {}  # the node the session's e2e modules share, while one of them still runs


def module_namespace(request: pytest.FixtureRequest) -> str:
    """goodput-e2e-<module>: test_multinode_e2e.py works in goodput-e2e-multinode."""
    stem = request.node.path.stem.removeprefix("test_").removesuffix("_e2e").replace("_", "-")
    return f"{NAMESPACE}-{stem}"[:63].rstrip("-")


def models_volume(namespace: str) -> str:
    return f"{namespace}-models"


def later_module_needs_node(request: pytest.FixtureRequest) -> bool:
    """Whether a module after this one (in the session's run order) uses the node."""
    items = request.session.items
    here = request.node.path
    last = max((i for i, item in enumerate(items) if item.path == here), default=len(items))
    return any("node" in getattr(item, "fixturenames", ()) for item in items[last + 1 :])


@pytest.fixture(scope="module")
def node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """The node, brought up (and the images loaded) by the first e2e module and shared by the later ones:
    each module works in its own namespace (module_namespace), removed with its models volume when it
    ends, as a borrowed node's modules do. After the last module a node the session brought up goes down."""
    reason = node_unsupported()
    if reason:
        pytest.skip(f"{reason}; use kind elsewhere (make demo)")
    node = _SHARED.get("node")
    if node is None:
        # a short path: containerd's socket lives under it (108-byte limit for unix sockets)
        workdir = tmp_path_factory.mktemp("node")
        node = Node.running(workdir) or Node.up(workdir)
        try:
            node.load_images()
        except BaseException:
            if not node.borrowed:
                node.down()
            raise
        _SHARED["node"] = node
    last = True
    namespace = module_namespace(request)
    try:
        node.use_namespace(namespace)
        yield node
        last = not later_module_needs_node(request)
    finally:
        if last:
            _SHARED.pop("node", None)
        if last and not node.borrowed:
            node.down()
        else:
            node.remove(namespace, f"persistentvolume/{models_volume(namespace)}", wait=last)


@pytest.fixture(scope="module")
def installed(node: Node) -> Node:
    """Goodput installed the way the README says: `kubectl apply -k manifests/`, with a hostPath volume for
    the Batch API's store (this cluster provisions none), kept in the cluster's folder as long as it runs."""
    run(
        [str(ROOT / "hack" / "batch-volume.sh"), str(node.dir / "batch-store"), OPERATOR_NAMESPACE],
        timeout=120,
        env={**node.env, "KUBECTL": shutil.which("kubectl") or "kubectl"},
    )
    node.apply_kustomization(ROOT / "manifests")
    if node.borrowed:  # the operator may run an image older than the one just built under the same tag
        node.kubectl("rollout", "restart", "deployment/goodput-operator", "-n", OPERATOR_NAMESPACE)
        node.kubectl(
            "rollout", "status", "deployment/goodput-operator", "-n", OPERATOR_NAMESPACE, "--timeout=300s", timeout=320
        )
    wait_for(
        lambda: deployment_available(node, OPERATOR_NAMESPACE, "goodput-operator"),
        OPERATOR_READY_SECONDS,
        "the operator Deployment to become Available",
        explain=lambda: node.describe(OPERATOR_NAMESPACE),
    )
    return node


def deployment_available(node: Node, namespace: str, name: str) -> bool:
    deploy = node.get("deployment", name, namespace)
    if not deploy:
        return False
    status = deploy.get("status", {})
    return bool(status.get("availableReplicas", 0) >= 1 and status.get("updatedReplicas") == status.get("replicas"))


@pytest.fixture(scope="module")
def models(node: Node, tiny_model_dir: Path) -> dict[str, Path]:
    """A hostPath PersistentVolume on the node, bound to the claim `models` in the tests' namespace.

    Holds `tiny` (a small random-weight Llama with a locally trained tokenizer) and
    `unknown-arch` (the same files, with an architecture the runtime does not support) and
    `unreadable` (weights only root may read; the runtime runs as a non-root user).
    """
    root = node.scratch / "models"
    tiny = copy_model(tiny_model_dir, root / "tiny")
    unknown = copy_model(tiny_model_dir, root / "unknown-arch")
    config = json.loads((unknown / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (unknown / "config.json").write_text(json.dumps(config))
    unreadable = copy_model(tiny_model_dir, root / "unreadable")
    (unreadable / "model.safetensors").chmod(0o600)  # root's; the runtime runs as another user
    root.chmod(0o755)
    node.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": models_volume(node.namespace)},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadOnlyMany", "ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "",
                    "hostPath": {"path": str(root), "type": "Directory"},
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": MODELS_CLAIM},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "volumeName": models_volume(node.namespace),
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        ]
    )
    wait_for(
        lambda: (node.get("pvc", MODELS_CLAIM) or {}).get("status", {}).get("phase") == "Bound",
        60,
        "the models claim to bind",
    )
    return {"tiny": tiny, "unknown-arch": unknown, "unreadable": unreadable}
