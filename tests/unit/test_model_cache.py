"""ModelCache without a cluster: the spec's parsing (a refusal names the field), the status summary
`kubectl get modelcaches` shows, the checksums the agent compares with the Hub's, and the agent's chart
template (its namespace is the only one not restricted, and why)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from pod_security import violations

from goodput_contract.api.model_cache_spec import STORAGE_CLASS, VOLUME_LABEL, node_label, parse_model_cache
from goodput_contract.api.spec import SpecError, parse
from goodput_operator import builders
from goodput_operator.model_cache_agent import FetchError, file_digest, safe_path, summary
from goodput_operator.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_spec_parses_and_refusals_name_the_field():
    spec = parse_model_cache("m", {"source": "hf://org/model", "revision": "v1", "files": ["*.safetensors"]})
    assert (spec.repo, spec.revision) == ("org/model", "v1")
    assert spec.wants("model-00001-of-00002.safetensors") and not spec.wants("pytorch_model.bin")
    assert parse_model_cache("m", {"source": "hf://org/model"}).wants("anything")
    for raw, field in (
        ({}, "source"),
        ({"source": "pvc://claim/path"}, "source"),
        ({"source": "hf://org/model/file.gguf"}, "source"),
        ({"source": "hf://org/model", "revision": "../x"}, "revision"),
        ({"source": "hf://org/model", "files": "*.json"}, "files"),
    ):
        with pytest.raises(SpecError) as err:
            parse_model_cache("m", raw)
        assert err.value.field == f"spec.{field}", raw


def test_the_node_label_is_a_valid_label_key_for_any_name():
    assert node_label("models", "llama-70b") == "modelcache.goodput.dev/models.llama-70b"
    long = node_label("a" * 63, "b" * 253)
    name = long.split("/", 1)[1]
    assert len(name) <= 63 and name[0].isalnum() and name[-1].isalnum()
    assert long != node_label("a" * 63, "b" * 252)


def node(phase: str, done: int, total: int, rate: int = 0, eta: int | None = None, error: str = "") -> dict[str, Any]:
    entry: dict[str, Any] = {"phase": phase, "bytesDone": done, "bytesTotal": total, "bytesPerSecond": rate}
    if eta is not None:
        entry["etaSeconds"] = eta
    if error:
        entry["lastError"] = error
    return entry


def test_summary_over_nodes():
    both = summary(
        {
            "a": node("Ready", 100, 100),
            "b": node("Downloading", 50, 100, 2_500_000, 20),
            "c": node("Downloading", 0, 100, 500_000, 125),
        }
    )
    assert both["phase"] == "Downloading" and both["nodesReady"] == "1/3" and both["progress"] == "50%"
    assert (both["rate"], both["eta"]) == ("3.0MB/s", "2m5s") and "lastError" not in both
    failed = summary({"a": node("Ready", 1, 1), "b": node("Failed", 0, 1, error="w.bin: HTTP 503")})
    assert failed["phase"] == "Failed" and failed["lastError"] == "b: w.bin: HTTP 503"
    assert summary({"a": node("Ready", 1, 1)})["phase"] == "Ready"
    assert summary({})["phase"] == "Pending"


def test_checksums_are_the_hubs(tmp_path):
    data = b"{}\n"
    path = tmp_path / "config.json"
    path.write_bytes(data)
    assert file_digest(path, "sha256", len(data)) == hashlib.sha256(data).hexdigest()
    # the git blob hash the Hub gives for files not in LFS (`git hash-object config.json`)
    assert file_digest(path, "git-sha1", len(data)) == "0967ef424bce6791893e9a57bb952f80fd536e93"


@pytest.mark.parametrize("bad", ["../etc/passwd", "/abs", "a/../../b", "w.bin.partial"])
def test_a_file_path_may_not_leave_the_models_directory(tmp_path, bad):
    with pytest.raises(FetchError):
        safe_path(tmp_path, bad)
    assert safe_path(tmp_path, "sub/w.bin") == tmp_path / "sub" / "w.bin"


def render(values: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    with helm.Chart.load(ROOT / "charts" / "goodput") as chart:
        out = chart.render(values, name="goodput", namespace="goodput-system", is_install=True)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for path, text in out.items():
        for doc in yaml.safe_load_all(text) if path.endswith(".yaml") else ():
            if isinstance(doc, dict):
                by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def test_the_agent_is_off_by_default_and_runs_in_its_own_privileged_namespace():
    assert "DaemonSet" not in render({})
    objects = render({"modelCache": {"enabled": True, "maxBytesPerSecond": 1000, "tokenSecretName": "hf"}})
    (daemonset,) = objects["DaemonSet"]
    namespaces = {n["metadata"]["name"]: n["metadata"]["labels"] for n in objects["Namespace"]}
    assert namespaces["goodput-system"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert namespaces["goodput-model-cache"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert daemonset["metadata"]["namespace"] == "goodput-model-cache"
    pod = daemonset["spec"]["template"]["spec"]
    # the hostPath is the one thing the restricted profile refuses (and running as root, to write there)
    problems = violations(pod)
    assert problems and all("hostPath" in p or "runAsNonRoot" in p or "runAsUser" in p for p in problems), problems
    assert pod["volumes"][0]["hostPath"] == {"path": "/var/lib/goodput/models", "type": "DirectoryOrCreate"}
    (container,) = pod["containers"]
    assert container["command"] == ["python3", "-m", "goodput_operator.model_cache_agent"]
    assert "--max-bytes-per-second=1000" in container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    (role,) = [r for r in objects["ClusterRole"] if r["metadata"]["name"] == "goodput-model-cache-agent"]
    assert {(tuple(r["resources"]), tuple(r["verbs"])) for r in role["rules"]} == {
        (("modelcaches",), ("get", "list")),
        (("modelcaches/status",), ("get", "update")),
        (("nodes",), ("get", "patch")),
        (("persistentvolumes",), ("get", "list", "create", "patch", "delete")),
    }
    assert "--host-path=/var/lib/goodput/models" in container["args"]
    (storage_class,) = objects["StorageClass"]
    assert storage_class["volumeBindingMode"] == "WaitForFirstConsumer"
    assert storage_class["metadata"]["name"] == STORAGE_CLASS


def test_a_service_reading_a_nodes_copy_through_its_local_volumes_stays_restricted():
    """spec.model.nodeCache: a generic ephemeral volume whose claim selects the cache's local volumes (the
    agent publishes them per node, of the StorageClass that binds at scheduling), so the pod lands on a node
    holding the model and reads it there without a hostPath, and the runtime is given that directory."""
    spec = {
        "model": {"source": "hf://meta-llama/Llama-3.1-70B-Instruct", "nodeCache": "llama-70b"},
        "resources": {"gpu": 0, "memory": "2Gi"},
    }
    svc = parse("chat", "models", spec)
    pod = builders.build_deployment(svc, Settings(), builders.owner_reference("chat", "uid-1"))["spec"]["template"]
    assert violations(pod["spec"]) == []
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "model-node-cache")
    claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["selector"]["matchLabels"] == {VOLUME_LABEL: "models.llama-70b"}
    assert (claim["storageClassName"], claim["accessModes"]) == (STORAGE_CLASS, ["ReadOnlyMany"])
    (container,) = pod["spec"]["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "model-node-cache")
    assert mount == {"name": "model-node-cache", "mountPath": "/mnt/node-cache", "readOnly": True}
    args = container["args"]
    assert args[args.index("--model") + 1] == "/mnt/node-cache" and "--revision" not in args, args
    without = parse("chat", "models", {**spec, "model": {"source": spec["model"]["source"]}})
    plain = builders.build_deployment(without, Settings(), builders.owner_reference("chat", "uid-1"))
    assert "model-node-cache" not in str(plain)


@pytest.mark.parametrize(
    "model",
    [
        {"source": "pvc://weights/llama", "nodeCache": "llama-70b"},
        {"source": "hf://org/m/model.Q4_K_M.gguf", "nodeCache": "llama-70b"},
        {"source": "hf://org/m", "nodeCache": "Not_A_Name"},
    ],
)
def test_a_node_cache_the_pods_cannot_read_is_refused_naming_the_field(model):
    with pytest.raises(SpecError) as err:
        parse("chat", "models", {"model": model, "resources": {"gpu": 0}})
    assert err.value.field == "spec.model.nodeCache", err.value
