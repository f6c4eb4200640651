"""The ModelCache agent as a real process (`python -m goodput_operator.model_cache_agent`) against the real API
server, downloading over real HTTP into a real directory standing for one node's disk.

The Hugging Face Hub cannot be reached from the tests: a local HTTP server stands in for it, answering the
Hub's own API (`/api/models/<repo>/revision/<rev>?blobs=true`, with sizes, LFS SHA-256 and git blob hashes)
and downloads (`/<repo>/resolve/<commit>/<file>`, Range requests included), with faults on demand. The
agent finds it through HF_ENDPOINT, as every hub client does.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from harness import ROOT, wait_for

from goodput_contract.api import GROUP, MODEL_CACHE_PLURAL, VERSION
from goodput_contract.api.model_cache_spec import STORAGE_CLASS, VOLUME_LABEL, cache_key, node_label

CRD_FILE = ROOT / "crds" / f"{GROUP}_modelcaches.yaml"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
WEIGHTS = os.urandom(3 * 1024 * 1024)  # an LFS file: checked by SHA-256
CONFIG = json.dumps({"model_type": "llama", "hidden_size": 64}).encode()  # a plain file: the git blob hash
THROTTLE = 1_000_000  # bytes a second: the weights take ~3 s, long enough to watch the progress


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub(BaseHTTPRequestHandler):
    """The Hub's API and downloads for repos {repo: {file: bytes}}; faults: {file: [what the next tries get]}."""

    repos: dict[str, dict[str, bytes]] = {}
    faults: dict[str, list[str]] = {}
    sent: dict[str, int] = {}  # file -> bytes of its content sent
    ranges: list[tuple[str, str]] = []  # (file, Range header) of resumed downloads
    lock = threading.Lock()

    def do_GET(self) -> None:
        if match := re.match(r"^/api/models/(?P<repo>.+)/revision/(?P<rev>[^/?]+)\?blobs=true$", self.path):
            files = self.repos.get(match["repo"])
            if files is None:
                return self._plain(404, b"no such repo")
            siblings = []
            for name, data in files.items():
                item: dict[str, Any] = {"rfilename": name, "size": len(data), "blobId": blob_id(data)}
                if name.endswith((".safetensors", ".bin")):
                    item["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                siblings.append(item)
            return self._plain(200, json.dumps({"sha": COMMIT, "siblings": siblings}).encode())
        match = re.match(rf"^/(?P<repo>.+)/resolve/{COMMIT}/(?P<file>.+)$", self.path)
        files = self.repos.get(match["repo"]) if match else None
        if not match or files is None or match["file"] not in files:
            return self._plain(404, b"not found")
        name, data = match["file"], files[match["file"]]
        with self.lock:
            fault = self.faults.get(name, []).pop(0) if self.faults.get(name) else ""
        if fault == "503":
            return self._plain(503, b"busy")
        start = 0
        if header := self.headers.get("Range"):
            start = int(re.match(r"bytes=(\d+)-", header)[1])  # type: ignore[index]
            with self.lock:
                self.ranges.append((name, header))
        body = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body)))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if fault == "cut":  # the connection drops halfway
            body = body[: len(body) // 2]
        for offset in range(0, len(body), 65536):
            self.wfile.write(body[offset : offset + 65536])
            with self.lock:
                self.sent[name] = self.sent.get(name, 0) + len(body[offset : offset + 65536])

    def _plain(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture(scope="module")
def hub() -> Iterator[str]:
    FakeHub.repos = {"org/cached": {"config.json": CONFIG, "model.safetensors": WEIGHTS, "README.md": b"# not wanted"}}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def node_root(tmp_path_factory) -> Path:
    """node-a's disk, kept across the module's tests (the agents come and go, as pods do)."""
    return tmp_path_factory.mktemp("node-a")


@pytest.fixture(scope="module")
def ns(cluster) -> Iterator[str]:
    cluster.kubectl("apply", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{MODEL_CACHE_PLURAL}.{GROUP}")
    core = kubernetes.client.CoreV1Api(cluster.api)
    # the Node object the agent labels (the test cluster has no kubelet to register one)
    core.create_node({"metadata": {"name": "node-a"}})
    try:
        with cluster.scratch_namespace("cache") as name:
            yield name
    finally:
        core.delete_node("node-a")


def volumes(cluster, namespace: str, name: str) -> list[Any]:
    core = kubernetes.client.CoreV1Api(cluster.api)
    items = core.list_persistent_volume(label_selector=f"{VOLUME_LABEL}={cache_key(namespace, name)}").items
    return sorted(items, key=lambda v: v.metadata.name)


def labels(cluster) -> dict[str, str]:
    return kubernetes.client.CoreV1Api(cluster.api).read_node("node-a").metadata.labels or {}


def agent(cluster, hub: str, root: Path, namespace: str, name: str, *flags: str) -> subprocess.Popen[str]:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "HF_ENDPOINT": hub}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    command = [sys.executable, "-m", "goodput_operator.model_cache_agent", "--node", "node-a", "--root", str(root)]
    command += ["--namespace", namespace, "--name", name, "--report-seconds", "0.3", "--volumes-per-node", "2", *flags]
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str]:
    out, _ = process.communicate(timeout=timeout)
    return process.returncode, out


def create(cluster, namespace: str, name: str, source: str) -> None:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ModelCache",
        "metadata": {"name": name},
        "spec": {"source": source, "files": ["*.json", "*.safetensors", "*.bin"]},
    }
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, MODEL_CACHE_PLURAL, body)


def status(cluster, namespace: str, name: str) -> dict[str, Any]:
    body = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, MODEL_CACHE_PLURAL, name)
    return dict(body.get("status") or {})


def test_progress_shows_during_a_throttled_download(cluster, hub, ns, node_root):
    root = node_root
    create(cluster, ns, "llama", "hf://org/cached")
    started = time.monotonic()
    process = agent(cluster, hub, root, ns, "llama", "--once", "--max-bytes-per-second", str(THROTTLE))
    seen: list[dict[str, Any]] = []
    columns: list[str] = []

    def midway() -> bool:
        node = (status(cluster, ns, "llama").get("nodes") or {}).get("node-a") or {}
        if node.get("phase") == "Downloading" and 0 < node.get("bytesDone", 0) < node.get("bytesTotal", 0):
            seen.append(node)
            table = cluster.kubectl("get", "modelcaches", "-n", ns, "llama").stdout
            columns.append(table)
            return node.get("bytesPerSecond", 0) > 0 and "etaSeconds" in node
        return False

    try:
        wait_for(midway, 30, "progress midway through the download")
    finally:
        code, out = finish(process)
        print(out)
    assert code == 0, out
    print(f"first fetch: {time.monotonic() - started:.2f} s")
    node = seen[-1]
    total = len(WEIGHTS) + len(CONFIG)
    assert node["bytesTotal"] == total and node["files"] == 2
    # the throttle holds: the rate shown is near 1 MB/s, not the loopback's speed
    assert 0.3 * THROTTLE < node["bytesPerSecond"] < 2 * THROTTLE, node
    header, row = columns[-1].splitlines()[:2]
    assert header.split()[:7] == ["NAME", "SOURCE", "PHASE", "NODES", "PROGRESS", "RATE", "ETA"], header
    assert row.split()[2:4] == ["Downloading", "0/1"], row
    # the RATE column is the same rate in a unit a reader takes in (about 1 MB/s, or a little under as kB/s)
    rate = re.fullmatch(r"([0-9.]+)(kB|MB)/s", row.split()[5])
    assert rate, row
    assert 0.3 * THROTTLE < float(rate[1]) * {"kB": 1e3, "MB": 1e6}[rate[2]] < 2 * THROTTLE, row
    done = status(cluster, ns, "llama")
    assert (done["phase"], done["nodesReady"], done["progress"]) == ("Ready", "1/1", "100%")
    final = done["nodes"]["node-a"]
    assert (final["downloadedBytes"], final["reusedBytes"], final["revision"]) == (total, 0, COMMIT)
    cached = root / ns / "llama"
    assert (cached / "model.safetensors").read_bytes() == WEIGHTS and (cached / "config.json").read_bytes() == CONFIG
    assert not (cached / "README.md").exists()  # not matched by spec.files
    # the node says it holds the model, for the serving pods' node affinity
    assert labels(cluster)[node_label(ns, "llama")] == "ready"
    # and publishes its copy as local volumes bound to the node: a serving pod's claim on them reads the
    # files without a hostPath of its own, on a node that holds them
    published = volumes(cluster, ns, "llama")
    assert len(published) == 2, published
    for volume in published:
        assert volume.spec.local.path == str(cached) and volume.spec.access_modes == ["ReadOnlyMany"]
        assert volume.spec.storage_class_name == STORAGE_CLASS
        (term,) = volume.spec.node_affinity.required.node_selector_terms
        assert term.match_expressions[0].values == ["node-a"]


def test_a_second_fetch_on_the_same_node_downloads_nothing(cluster, hub, ns, node_root):
    root = node_root
    # a pod that used one of the node's volumes went away: its claim is gone, the volume Released
    core = kubernetes.client.CoreV1Api(cluster.api)
    used = volumes(cluster, ns, "llama")[0].metadata.name
    gone = {
        "kind": "PersistentVolumeClaim",
        "namespace": ns,
        "name": "gone",
        "uid": "9f0e0c1c-0000-4000-8000-000000000001",
    }
    core.patch_persistent_volume(used, {"spec": {"claimRef": gone}})
    wait_for(lambda: core.read_persistent_volume(used).status.phase == "Released", 30, "the volume to be released")
    before = sum(FakeHub.sent.values())
    started = time.monotonic()
    code, out = finish(agent(cluster, hub, root, ns, "llama", "--once", "--max-bytes-per-second", str(THROTTLE)))
    elapsed = time.monotonic() - started
    assert code == 0, out
    node = status(cluster, ns, "llama")["nodes"]["node-a"]
    assert node["downloadedBytes"] == 0 and node["reusedBytes"] == len(WEIGHTS) + len(CONFIG), node
    assert sum(FakeHub.sent.values()) == before  # not a byte of a file crossed the network
    # the released volume is offered to the next pod on the node
    assert core.read_persistent_volume(used).spec.claim_ref is None
    wait_for(lambda: core.read_persistent_volume(used).status.phase == "Available", 30, "the volume to be available")
    print(f"second fetch: {node['downloadedBytes']} bytes downloaded, {node['reusedBytes']} reused, {elapsed:.2f} s")


def test_a_corrupted_file_is_detected_and_fetched_again(cluster, hub, ns, node_root):
    root = node_root
    weights = root / ns / "llama" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000] ^= 0xFF  # one flipped byte, same size
    weights.write_bytes(bytes(data))
    started = time.monotonic()
    code, out = finish(agent(cluster, hub, root, ns, "llama", "--once"))
    assert code == 0, out
    print(f"repair: {time.monotonic() - started:.2f} s")
    node = status(cluster, ns, "llama")["nodes"]["node-a"]
    assert node["repairedFiles"] == ["model.safetensors"], node
    assert node["downloadedBytes"] == len(WEIGHTS) and node["reusedBytes"] == len(CONFIG), node
    assert weights.read_bytes() == WEIGHTS


def test_a_failing_file_is_retried_reported_by_name_and_resumed(cluster, hub, ns, tmp_path):
    FakeHub.repos["org/flaky"] = {"config.json": CONFIG, "weights.bin": WEIGHTS}
    # first pass: the connection drops halfway, then the server is busy: two tries, Failed
    # second pass: busy once more, then the rest of the file from where it stopped
    FakeHub.faults["weights.bin"] = ["cut", "503", "503"]
    FakeHub.ranges.clear()
    create(cluster, ns, "flaky", "hf://org/flaky")
    process = agent(
        cluster, hub, tmp_path, ns, "flaky", "--retries", "2", "--backoff-seconds", "0.2", "--resync-seconds", "2"
    )
    try:
        wait_for(lambda: status(cluster, ns, "flaky").get("phase") == "Failed", 30, "the pass to fail")
        failed = status(cluster, ns, "flaky")
        node = failed["nodes"]["node-a"]
        assert node["failedFile"] == "weights.bin" and node["attempts"] == 2, node
        assert "weights.bin: HTTP 503" in node["lastError"] and "after 2 tries" in node["lastError"], node
        assert failed["lastError"].startswith("node-a: weights.bin"), failed
        wide = cluster.kubectl("get", "modelcaches", "-n", ns, "flaky", "-o", "wide").stdout
        assert "weights.bin: HTTP 503" in wide, wide
        assert node_label(ns, "flaky") not in labels(cluster)
        wait_for(lambda: status(cluster, ns, "flaky").get("phase") == "Ready", 30, "the next pass to succeed")
    finally:
        process.terminate()
        process.wait(timeout=10)
    node = status(cluster, ns, "flaky")["nodes"]["node-a"]
    assert "lastError" not in node and node["bytesDone"] == node["bytesTotal"], node
    assert (tmp_path / ns / "flaky" / "weights.bin").read_bytes() == WEIGHTS
    half = len(WEIGHTS) // 2
    assert ("weights.bin", f"bytes={half}-") in FakeHub.ranges  # resumed, not fetched from the start
    assert FakeHub.faults["weights.bin"] == []


def test_a_deleted_cache_leaves_the_disk_and_the_node(cluster, hub, ns, node_root):
    assert (node_root / ns / "llama").is_dir() and node_label(ns, "llama") in labels(cluster)
    assert volumes(cluster, ns, "llama")
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, MODEL_CACHE_PLURAL, "llama")
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "HF_ENDPOINT": hub}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    command = [sys.executable, "-m", "goodput_operator.model_cache_agent", "--node", "node-a"]
    command += ["--root", str(node_root), "--namespace", ns, "--once", "--volumes-per-node", "2"]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (node_root / ns / "llama").exists()
    assert node_label(ns, "llama") not in labels(cluster) and volumes(cluster, ns, "llama") == []
    assert labels(cluster)[node_label(ns, "flaky")] == "ready"  # the other cache, on this node too now
