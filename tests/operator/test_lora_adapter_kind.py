"""The LoraAdapter kind on a real API server, with the operator as a real process and real runtime processes.

The test cluster has no kubelet, so the service's "pods" are `python -m goodput_runtime` processes on the
tiny model (live_pods.Pod), each published as a ready endpoint of the service's EndpointSlices as the
EndpointSlice controller would; the operator finds them there and loads the adapter (made with peft)
through each one's /v1/load_lora_adapter, with the service's API key from its Secret.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from autoscaling_helpers import delete_endpoint, host_address, put_endpoint
from harness import OperatorProcess, wait_for
from kubernetes.client.exceptions import ApiException
from live_pods import Pod

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from lora_adapters import ALL, make_adapter

from goodput_contract.api import GROUP, LORA_PLURAL, VERSION

KEY = "sk-lora-kind-7d1e"
RESYNC_SECONDS = "1"
WAIT = 60
SERVICE_SPEC: dict[str, Any] = {
    "model": {"source": "file:///models/tiny", "servedName": "tiny", "lora": {"runtimeUpdates": True}},
    "resources": {"gpu": 0, "memory": "2Gi"},
    "replicas": 2,
    "auth": {"apiKeySecretRef": {"name": "keys"}},
}
RUNTIME_FLAGS = ("--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating", "--api-key", KEY)


@pytest.fixture(scope="module")
def lora_operator(cluster, hub, tmp_path_factory):
    """The operator, passing over every LoraAdapter each second (replicas that restarted are found sooner)."""
    log = tmp_path_factory.mktemp("lora-operator") / "operator.log"
    os.environ["LORA_RESYNC_SECONDS"] = RESYNC_SECONDS
    try:
        process = OperatorProcess(cluster.kubeconfig, log, hub.endpoint).start()
    finally:
        del os.environ["LORA_RESYNC_SECONDS"]
    yield process
    process.__exit__(None, None, None)


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir) -> Path:
    return make_adapter(tiny_model_dir, "all8", 8, ALL)


@pytest.fixture(scope="module")
def other_adapter_dir(tiny_model_dir) -> Path:
    return make_adapter(tiny_model_dir, "qvd4", 4, ["q_proj", "v_proj", "down_proj"], rslora=True, seed=1)


def adapter_url(cluster, namespace: str, name: str | None = None) -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{LORA_PLURAL}"
    return f"{base}/{name}" if name else base


def create_adapter(cluster, namespace: str, name: str, spec: dict[str, Any]) -> None:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LoraAdapter", "metadata": {"name": name}, "spec": spec}
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, LORA_PLURAL, body)


def adapter(cluster, namespace: str, name: str) -> dict[str, Any] | None:
    return cluster.get_or_none(cluster.raw, "GET", adapter_url(cluster, namespace, name))


def wait_phase(cluster, namespace: str, name: str, phase: str, check=lambda obj: True) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        obj = adapter(cluster, namespace, name)
        status = (obj or {}).get("status") or {}
        return obj if status.get("phase") == phase and check(obj) else None

    return wait_for(reached, WAIT, f"LoraAdapter {name} to be {phase}")


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == type_)


def cards(pod: Pod) -> dict[str, dict[str, Any]]:
    """The replica's /v1/models, by id (an adapter's card has its directory as root)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{pod.port}/v1/models", headers={"Authorization": f"Bearer {KEY}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return {m["id"]: m for m in json.load(response)["data"]}


def models(pod: Pod) -> set[str]:
    return set(cards(pod))


def complete(pod: Pod, model: str) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{pod.port}/v1/completions",
        data=json.dumps({"model": model, "prompt": "hello", "max_tokens": 4}).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


class Pods:
    """Runtime processes published as the service's ready endpoints (by address:port, as the operator names them)."""

    def __init__(self, cluster, namespace: str, model_dir: Path, log_dir: Path) -> None:
        self.cluster, self.namespace, self.model_dir, self.log_dir = cluster, namespace, model_dir, log_dir
        self.address = host_address()
        self.pods: list[Pod] = []
        self.count = 0

    def start(self) -> Pod:
        self.count += 1
        pod = Pod(f"pod-{self.count}", self.model_dir, self.log_dir / f"pod-{self.count}.log", RUNTIME_FLAGS)
        self.pods.append(pod)
        wait_for(pod.poll_ready, WAIT, f"runtime {pod.name} to be ready")
        put_endpoint(self.cluster, self.namespace, "chat", pod.name, self.address, pod.port, True, port_name="http")
        return pod

    def kill(self, pod: Pod) -> None:
        pod.process.kill()
        pod.process.wait(10)
        delete_endpoint(self.cluster, self.namespace, "chat", pod.name)
        self.pods.remove(pod)
        pod.stop()

    def replica(self, pod: Pod) -> str:
        return f"{self.address}:{pod.port}"

    def stop(self) -> None:
        for pod in self.pods:
            pod.stop()


@pytest.fixture
def chat(cluster, lora_operator, namespace, tiny_model_dir, tmp_path):
    """InferenceService chat (runtime updates on, an API key) and its running replicas' manager."""
    cluster.core.create_namespaced_secret(namespace, {"metadata": {"name": "keys"}, "stringData": {"apiKey": KEY}})
    cluster.create_service(namespace, "chat", SERVICE_SPEC)
    pods = Pods(cluster, namespace, tiny_model_dir, tmp_path)
    yield pods
    pods.stop()


def test_refusals_name_the_field(cluster, lora_operator, namespace):
    create_adapter(cluster, namespace, "ghost", {"service": "nope", "source": "file:///a"})
    obj = wait_phase(cluster, namespace, "ghost", "Failed")
    valid = condition(obj, "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "ServiceNotFound")
    assert obj["status"]["lastError"] == "spec.service: InferenceService 'nope' not found"

    # a service with adapters but no run-time updates: the runtime would refuse every load
    plain = {**SERVICE_SPEC, "model": {"source": "file:///models/tiny", "lora": {"maxAdapters": 2}}}
    cluster.create_service(namespace, "fixed", plain)
    create_adapter(cluster, namespace, "sql", {"service": "fixed", "source": "file:///a"})
    obj = wait_phase(cluster, namespace, "sql", "Failed")
    assert condition(obj, "Valid")["reason"] == "RuntimeUpdatesOff"
    assert obj["status"]["lastError"].startswith("spec.service: InferenceService 'fixed' does not load adapters")

    # once the service allows it, the same adapter is no longer refused (Pending: no replica is ready)
    cluster.patch_service(namespace, "fixed", {"spec": {"model": {"lora": {"runtimeUpdates": True}}}})
    obj = wait_phase(cluster, namespace, "sql", "Pending")
    assert condition(obj, "Valid")["status"] == "True"
    assert condition(obj, "Ready")["reason"] == "NoReadyReplicas"

    # a claim the service's pods do not mount
    create_adapter(cluster, namespace, "unmounted", {"service": "fixed", "source": "pvc://other/sql"})
    obj = wait_phase(cluster, namespace, "unmounted", "Failed")
    assert obj["status"]["lastError"].startswith("spec.source: claim 'other' is not mounted")

    # a source no engine reads (a Hub repository needs its organisation): refused by the API server itself
    with pytest.raises(ApiException) as refused:
        create_adapter(cluster, namespace, "hub", {"service": "fixed", "source": "hf://sql-lora"})
    assert refused.value.status == 422 and "spec.source" in refused.value.body


def test_loaded_on_every_replica_again_after_a_restart_and_unloaded_on_deletion(cluster, chat, namespace, adapter_dir):
    first, second = chat.start(), chat.start()
    create_adapter(cluster, namespace, "sql", {"service": "chat", "source": f"file://{adapter_dir}"})
    both = {chat.replica(first), chat.replica(second)}
    obj = wait_phase(cluster, namespace, "sql", "Ready", lambda o: set(o["status"]["replicas"]) == both)
    assert obj["status"]["replicaCount"] == "2/2" and "lastError" not in obj["status"]
    assert condition(obj, "Ready")["status"] == "True"
    for pod in (first, second):
        assert "sql" in models(pod)
        assert complete(pod, "sql") == 200

    # one replica's process dies; its replacement comes up without the adapter and gets it
    chat.kill(second)
    third = chat.start()
    wait_phase(
        cluster,
        namespace,
        "sql",
        "Ready",
        lambda o: set(o["status"]["replicas"]) == {chat.replica(first), chat.replica(third)},
    )
    assert "sql" in models(third) and complete(third, "sql") == 200

    # deletion unloads it from every replica, then lets the resource go
    cluster.raw("DELETE", adapter_url(cluster, namespace, "sql"))
    wait_for(lambda: adapter(cluster, namespace, "sql") is None, WAIT, "the LoraAdapter to be gone")
    for pod in (first, third):
        assert models(pod) == {"tiny"}
        assert complete(pod, "sql") == 404


def test_a_count_of_replicas_a_new_source_and_a_load_the_runtime_refuses(
    cluster, chat, namespace, adapter_dir, other_adapter_dir, tmp_path
):
    pods = [chat.start(), chat.start()]
    create_adapter(cluster, namespace, "one", {"service": "chat", "source": f"file://{adapter_dir}", "replicas": 1})
    obj = wait_phase(cluster, namespace, "one", "Ready")
    assert obj["status"]["replicaCount"] == "1/1"
    [holder] = [p for p in pods if "one" in models(p)]
    assert cards(holder)["one"]["root"] == str(adapter_dir)

    # a new source is loaded in place on the replica holding it, under the same name
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, LORA_PLURAL, "one", {"spec": {"source": f"file://{other_adapter_dir}"}}
    )
    wait_phase(cluster, namespace, "one", "Ready", lambda o: o["status"].get("loadedGeneration") == 2)
    assert cards(holder)["one"]["root"] == str(other_adapter_dir)
    assert [("one" in models(p)) for p in pods].count(True) == 1

    # a directory with no adapter in it: the runtime answers 400, and the adapter fails with its reason
    (tmp_path / "empty").mkdir()
    create_adapter(cluster, namespace, "broken", {"service": "chat", "source": f"file://{tmp_path / 'empty'}"})
    obj = wait_phase(cluster, namespace, "broken", "Failed")
    assert condition(obj, "Valid")["status"] == "True"
    assert condition(obj, "Ready")["reason"] == "LoadRefused"
    assert "adapter_config.json" in obj["status"]["lastError"], obj["status"]["lastError"]
    assert all("broken" not in models(p) for p in pods)
