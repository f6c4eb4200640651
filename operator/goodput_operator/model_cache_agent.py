"""The ModelCache agent: keeps ModelCaches' files on this node's local disk and reports progress.

One agent runs per node (a DaemonSet, with the node's name in NODE_NAME and a hostPath for `--root`).
For each ModelCache it:

- lists the repository's files at the revision from the Hub's API
  (`/api/models/<repo>/revision/<rev>?blobs=true`: each file's size, and the SHA-256 of LFS files or
  the git blob hash of the others), keeping those `spec.files` matches;
- checks every file already in `<root>/<namespace>/<name>/` against its checksum: a file that matches
  is kept (`reusedBytes`), one that does not is deleted and fetched again (`repairedFiles`);
- downloads the missing files from `/<repo>/resolve/<commit>/<file>` into `<file>.partial`, resuming a
  partial file with a Range request, at most `--max-bytes-per-second`, and checks the checksum before
  renaming it into place;
- retries a failing file with exponential backoff (`--retries`, `--backoff-seconds`), reporting the
  file's name and the error in status each time; after the last try the node's phase is Failed, and
  the next pass (`--resync-seconds`) starts over, resuming what was fetched;
- writes `status.nodes.<node>` (phase, bytes done and total, rate, ETA, files) every
  `--report-seconds`, and the summary over every node (phase, nodesReady, progress, rate, ETA) that
  `kubectl get modelcaches` shows, under the object's resourceVersion so agents on other nodes do not
  overwrite each other;
- while the node holds every file, labels the Node modelcache.goodput.dev/<namespace>.<name>=ready
  and publishes the copy as `--volumes-per-node` local PersistentVolumes (read-only, this node only,
  StorageClass goodput-model-cache), which a serving pod's ephemeral claim selects: the pod is then
  placed on a node holding the model and reads it without a hostPath (the restricted profile);
- deletes the directories, label and volumes of ModelCaches that no longer exist.

Files not wanted any more (another revision, fewer patterns) are deleted. Hub requests honour
HF_ENDPOINT and HF_TOKEN like every hub client.

    python -m goodput_operator.model_cache_agent --node "$NODE_NAME" --root /var/lib/goodput/models
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import logging
import os
import shutil
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from goodput_contract.api import GROUP, MODEL_CACHE_PLURAL, VERSION
from goodput_contract.api.model_cache_spec import (
    STORAGE_CLASS,
    VOLUME_LABEL,
    ModelCacheSpec,
    cache_key,
    node_label,
    parse_model_cache,
)
from goodput_contract.api.spec import SpecError

logger = logging.getLogger("goodput_operator.model_cache_agent")

DEFAULT_ROOT = "/var/lib/goodput/models"
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
CHUNK = 256 * 1024
HTTP_TIMEOUT_SECONDS = 30.0
MAX_BACKOFF_SECONDS = 60.0
STATUS_CONFLICT_TRIES = 8
PARTIAL = ".partial"
REVISION_FILE = ".goodput-revision"
VERIFIED_FILE = ".goodput-verified.json"


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative to the repository's root, POSIX
    size: int
    algorithm: str  # "sha256" (LFS) or "git-sha1" (the git blob hash)
    digest: str


class FetchError(Exception):
    """A file could not be fetched or did not match its checksum."""


@dataclass
class Progress:
    """One node's pass over one ModelCache, as status.nodes.<node> shows it."""

    files: int = 0
    files_done: int = 0
    bytes_total: int = 0
    bytes_done: int = 0  # on disk and checked, or being written by this pass
    downloaded: int = 0  # fetched over the network by this pass
    reused: int = 0
    repaired: list[str] = field(default_factory=list)
    phase: str = "Pending"
    revision: str = ""
    failed_file: str = ""
    attempts: int = 0
    last_error: str = ""
    rate: float = 0.0
    _window: tuple[float, int] = (0.0, 0)  # (monotonic time, downloaded) at the last rate sample

    def sample_rate(self) -> float:
        now = time.monotonic()
        then, before = self._window
        if then and now - then >= 0.2:
            self.rate = (self.downloaded - before) / (now - then)
        if not then or now - then >= 0.2:
            self._window = (now, self.downloaded)
        return self.rate

    def entry(self, path: Path, generation: int) -> dict[str, Any]:
        rate = int(self.rate) if self.phase == "Downloading" else 0
        left = max(0, self.bytes_total - self.bytes_done)
        entry: dict[str, Any] = {
            "phase": self.phase,
            "path": str(path),
            "revision": self.revision,
            "files": self.files,
            "filesDone": self.files_done,
            "bytesDone": self.bytes_done,
            "bytesTotal": self.bytes_total,
            "bytesPerSecond": rate,
            "downloadedBytes": self.downloaded,
            "reusedBytes": self.reused,
            "repairedFiles": list(self.repaired),
            "observedGeneration": generation,
            "updatedAt": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        if self.phase == "Downloading" and rate > 0:
            entry["etaSeconds"] = int(left / rate)
        if self.last_error:
            entry["lastError"] = self.last_error
            entry["failedFile"] = self.failed_file
            entry["attempts"] = self.attempts
        return entry


def human_bytes(rate: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if rate < 1000 or unit == "GB":
            return f"{rate:.1f}{unit}" if unit != "B" else f"{int(rate)}{unit}"
        rate /= 1000
    return f"{rate:.1f}GB"


def human_seconds(seconds: int) -> str:
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def summary(nodes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The status fields over every node: what `kubectl get modelcaches` shows."""
    phases = [n.get("phase") for n in nodes.values()]
    ready = phases.count("Ready")
    if not nodes:
        phase = "Pending"
    elif "Failed" in phases:
        phase = "Failed"
    elif ready == len(nodes):
        phase = "Ready"
    else:
        phase = "Downloading"
    done = sum(int(n.get("bytesDone") or 0) for n in nodes.values())
    total = sum(int(n.get("bytesTotal") or 0) for n in nodes.values())
    moving = [n for n in nodes.values() if n.get("phase") == "Downloading"]
    rate = sum(int(n.get("bytesPerSecond") or 0) for n in moving)
    etas = [int(n["etaSeconds"]) for n in moving if n.get("etaSeconds") is not None]
    errors = [f"{name}: {n['lastError']}" for name, n in sorted(nodes.items()) if n.get("lastError")]
    fields: dict[str, Any] = {
        "phase": phase,
        "nodesReady": f"{ready}/{len(nodes)}",
        "progress": f"{100 * done // total}%" if total else ("100%" if phase == "Ready" else "0%"),
        "rate": f"{human_bytes(rate)}/s",
        "eta": human_seconds(max(etas)) if etas else ("0s" if phase == "Ready" else "-"),
        "bytesDone": done,
        "bytesTotal": total,
    }
    if errors:
        fields["lastError"] = errors[0]
    return fields


def file_digest(path: Path, algorithm: str, size: int, prefix: Any = None) -> str:
    """The file's checksum as the Hub gives it: SHA-256, or the git blob hash (sha1 of 'blob <size>\\0' + data)."""
    digest = prefix or new_hasher(algorithm, size)
    with path.open("rb") as stream:
        while chunk := stream.read(CHUNK):
            digest.update(chunk)
    return str(digest.hexdigest())


def new_hasher(algorithm: str, size: int) -> Any:
    if algorithm == "sha256":
        return hashlib.sha256()
    hasher = hashlib.sha1()
    hasher.update(f"blob {size}\0".encode())
    return hasher


def safe_path(root: Path, relative: str) -> Path:
    """`relative` under `root`; FetchError for a path that would leave it."""
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute() or ".." in parts or relative.endswith(PARTIAL):
        raise FetchError(f"{relative}: not a path inside the repository")
    return root.joinpath(*parts)


class Hub:
    def __init__(self, endpoint: str, token: str | None) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.token = token

    def _open(self, url: str, headers: dict[str, str] | None = None) -> Any:
        request = urllib.request.Request(url, headers={**(headers or {}), "User-Agent": "goodput-model-cache"})
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        return urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_SECONDS)

    def listing(self, spec: ModelCacheSpec) -> tuple[str, list[RemoteFile]]:
        """(the commit, the wanted files with their checksums)."""
        revision = urllib.parse.quote(spec.revision, safe="")
        url = f"{self.endpoint}/api/models/{spec.repo}/revision/{revision}?blobs=true"
        try:
            with self._open(url) as response:
                body = json.load(response)
        except urllib.error.HTTPError as err:
            raise FetchError(f"listing {spec.repo}@{spec.revision}: HTTP {err.code} {err.reason}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise FetchError(f"listing {spec.repo}@{spec.revision}: {err}") from None
        files = []
        for sibling in body.get("siblings") or ():
            name = sibling.get("rfilename") or ""
            if not spec.wants(name):
                continue
            lfs = sibling.get("lfs") or {}
            if lfs.get("sha256"):
                files.append(RemoteFile(name, int(lfs.get("size", sibling.get("size", 0))), "sha256", lfs["sha256"]))
            elif sibling.get("blobId") and sibling.get("size") is not None:
                files.append(RemoteFile(name, int(sibling["size"]), "git-sha1", sibling["blobId"]))
            else:
                raise FetchError(f"{name}: the hub gives no checksum")
        return str(body.get("sha") or spec.revision), files

    def download(
        self,
        repo: str,
        commit: str,
        remote: RemoteFile,
        target: Path,
        on_bytes: Callable[[int], None],
        max_rate: float,
    ) -> None:
        """Fetch into `target`.partial (resuming it), check the checksum, rename into place."""
        partial = target.with_name(target.name + PARTIAL)
        partial.parent.mkdir(parents=True, exist_ok=True)
        have = partial.stat().st_size if partial.exists() else 0
        if have > remote.size:
            partial.unlink()
            have = 0
        quoted = urllib.parse.quote(remote.path)
        url = f"{self.endpoint}/{repo}/resolve/{urllib.parse.quote(commit, safe='')}/{quoted}"
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            response = self._open(url, headers) if have < remote.size else None
        except urllib.error.HTTPError as err:
            if err.code == 416 and have == remote.size:
                response = None
            else:
                raise FetchError(f"{remote.path}: HTTP {err.code} {err.reason}") from None
        except (urllib.error.URLError, OSError) as err:
            raise FetchError(f"{remote.path}: {err}") from None
        try:
            if response is not None:
                with response:
                    if have and response.status != 206:  # the server sent the whole file
                        on_bytes(-have)
                        have = 0
                    self._copy(response, partial, "ab" if have else "wb", on_bytes, max_rate)
        except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
            raise FetchError(f"{remote.path}: {err}") from None
        size = partial.stat().st_size
        if size != remote.size:
            raise FetchError(f"{remote.path}: {size} bytes of {remote.size}, the connection ended early")
        if file_digest(partial, remote.algorithm, remote.size) != remote.digest:
            partial.unlink()
            on_bytes(-size)
            raise FetchError(f"{remote.path}: checksum mismatch ({remote.algorithm}), fetched again next try")
        os.replace(partial, target)

    @staticmethod
    def _copy(response: Any, partial: Path, mode: str, on_bytes: Callable[[int], None], max_rate: float) -> None:
        started, sent = time.monotonic(), 0
        with partial.open(mode) as out:
            while True:
                chunk = response.read(min(CHUNK, int(max_rate) or CHUNK) if max_rate else CHUNK)
                if not chunk:
                    return
                out.write(chunk)
                sent += len(chunk)
                on_bytes(len(chunk))
                if max_rate:  # throttle: never ahead of max_rate bytes a second since the start
                    ahead = sent / max_rate - (time.monotonic() - started)
                    if ahead > 0:
                        out.flush()
                        time.sleep(ahead)


class Verified:
    """The files a pass checked, by size, modification time and checksum: a file unchanged since is not
    read again on the next pass (a rewritten or truncated one is)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / VERIFIED_FILE
        try:
            self.seen: dict[str, list[Any]] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.seen = {}

    @staticmethod
    def _stamp(target: Path, remote: RemoteFile) -> list[Any]:
        stat = target.stat()
        return [stat.st_size, stat.st_mtime_ns, remote.algorithm, remote.digest]

    def matches(self, target: Path, remote: RemoteFile) -> bool:
        if target.stat().st_size != remote.size:
            return False
        if self.seen.get(str(target)) == self._stamp(target, remote):
            return True
        if file_digest(target, remote.algorithm, remote.size) != remote.digest:
            return False
        self.record(target, remote)
        return True

    def record(self, target: Path, remote: RemoteFile) -> None:
        self.seen[str(target)] = self._stamp(target, remote)

    def save(self, wanted: set[Path]) -> None:
        kept = {k: v for k, v in self.seen.items() if Path(k) in wanted}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(kept))
        os.replace(tmp, self.path)


class Status:
    """Writes status.nodes.<node> and the summary, under the object's resourceVersion, and the node's
    label modelcache.goodput.dev/<namespace>.<name>: "ready" while the node holds every file."""

    def __init__(
        self,
        api: kubernetes.client.CustomObjectsApi,
        node: str,
        core: kubernetes.client.CoreV1Api | None = None,
        host_root: Path | None = None,
        volumes_per_node: int = 0,
    ) -> None:
        self.api, self.node, self.core = api, node, core
        self.host_root, self.volumes_per_node = host_root, volumes_per_node

    def volumes(self, namespace: str, name: str, ready: bool, size: int = 0) -> None:
        """The node's copy as `volumes_per_node` local PersistentVolumes (read-only, bound to this node, of
        the StorageClass goodput-model-cache, labelled with the cache) while it is complete: a serving pod's
        claim selecting them is placed on a node holding the model and reads it without a hostPath. A
        released volume is made available again; unbound ones go when the copy is incomplete or deleted."""
        if self.core is None or self.host_root is None or not self.volumes_per_node:
            return
        key = cache_key(namespace, name)
        base = "gcache-" + hashlib.sha256(f"{self.node}/{namespace}/{name}".encode()).hexdigest()[:20]
        try:
            listing = self.core.list_persistent_volume(label_selector=f"{VOLUME_LABEL}={key}")
            mine: dict[str, Any] = {}
            for volume in listing.items:
                volume_name = str((volume.metadata and volume.metadata.name) or "")
                if volume_name.startswith(base + "-"):
                    mine[volume_name] = volume
            if not ready:
                for volume_name, volume in mine.items():
                    if (volume.status and volume.status.phase) in ("Available", "Released", "Pending", None):
                        self.core.delete_persistent_volume(volume_name)
                return
            node = self.core.read_node(self.node)
            hostname = ((node.metadata and node.metadata.labels) or {}).get("kubernetes.io/hostname", self.node)
            for i in range(self.volumes_per_node):
                pv_name = f"{base}-{i}"
                current = mine.get(pv_name)
                if current is None:
                    manifest: Any = self._volume(pv_name, key, namespace, name, hostname, size)
                    self.core.create_persistent_volume(manifest)
                elif current.status and current.status.phase == "Released":
                    self.core.patch_persistent_volume(pv_name, {"spec": {"claimRef": None}})
        except ApiException as err:
            logger.warning("volumes of %s/%s on node %s: %s %s", namespace, name, self.node, err.status, err.reason)

    def _volume(self, pv_name: str, key: str, namespace: str, name: str, hostname: str, size: int) -> dict[str, Any]:
        assert self.host_root is not None
        return {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {
                "name": pv_name,
                "labels": {VOLUME_LABEL: key, "app.kubernetes.io/managed-by": "goodput-model-cache-agent"},
                "annotations": {
                    "serving.goodput.dev/node": self.node,
                    "serving.goodput.dev/cache": f"{namespace}/{name}",
                },
            },
            "spec": {
                "capacity": {"storage": str(max(size, 1))},
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": STORAGE_CLASS,
                "volumeMode": "Filesystem",
                "local": {"path": str(self.host_root / namespace / name)},
                "nodeAffinity": {
                    "required": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "kubernetes.io/hostname", "operator": "In", "values": [hostname]}
                                ]
                            }
                        ]
                    }
                },
            },
        }

    def label(self, namespace: str, name: str, ready: bool) -> None:
        """Set (or remove) the node's label; a failure (no such Node, no right to patch it) is logged only."""
        if self.core is None:
            return
        key = node_label(namespace, name)
        try:
            node = self.core.read_node(self.node)
            if ((node.metadata and node.metadata.labels) or {}).get(key) == ("ready" if ready else None):
                return
            self.core.patch_node(self.node, {"metadata": {"labels": {key: "ready" if ready else None}}})
        except ApiException as err:
            logger.warning("label %s on node %s: %s %s", key, self.node, err.status, err.reason)

    def write(self, namespace: str, name: str, entry: dict[str, Any]) -> None:
        for _ in range(STATUS_CONFLICT_TRIES):
            try:
                body: Any = self.api.get_namespaced_custom_object(GROUP, VERSION, namespace, MODEL_CACHE_PLURAL, name)
            except ApiException as err:
                if err.status == 404:
                    return
                raise
            status = dict(body.get("status") or {})
            nodes = dict(status.get("nodes") or {})
            nodes[self.node] = entry
            status.pop("lastError", None)
            status.update(summary(nodes), nodes=nodes)
            status["observedGeneration"] = body["metadata"].get("generation")
            try:
                self.api.replace_namespaced_custom_object_status(
                    GROUP,
                    VERSION,
                    namespace,
                    MODEL_CACHE_PLURAL,
                    name,
                    {
                        "apiVersion": body["apiVersion"],
                        "kind": body["kind"],
                        "metadata": {
                            "name": name,
                            "namespace": namespace,
                            "resourceVersion": body["metadata"]["resourceVersion"],
                        },
                        "status": status,
                    },
                )
                return
            except ApiException as err:
                if err.status not in (404, 409):
                    raise
                if err.status == 404:
                    return
        logger.warning("status of %s/%s: conflicts %d times in a row", namespace, name, STATUS_CONFLICT_TRIES)


@dataclass
class Agent:
    node: str
    root: Path
    hub: Hub
    status: Status
    max_rate: float = 0.0  # bytes a second, 0: unlimited
    report_seconds: float = 2.0
    retries: int = 5
    backoff_seconds: float = 1.0
    stopping: bool = False

    def sync(self, body: dict[str, Any]) -> Progress:
        """One pass over one ModelCache on this node."""
        meta = body["metadata"]
        namespace, name, generation = meta["namespace"], meta["name"], int(meta.get("generation") or 0)
        directory = self.root / namespace / name
        progress = Progress()
        last_report = [0.0]

        def report(force: bool = False) -> None:
            now = time.monotonic()
            if force or now - last_report[0] >= self.report_seconds:
                progress.sample_rate()
                last_report[0] = now
                try:
                    self.status.write(namespace, name, progress.entry(directory, generation))
                    self.status.label(namespace, name, progress.phase == "Ready")
                except ApiException as err:
                    logger.warning("status of %s/%s: %s %s: %s", namespace, name, err.status, err.reason, err.body)

        def fail(message: str) -> Progress:
            progress.phase, progress.last_error = "Failed", message
            logger.error("%s/%s: %s", namespace, name, message)
            report(force=True)
            return progress

        try:
            spec = parse_model_cache(name, body.get("spec") or {})
        except SpecError as err:
            return fail(str(err))
        try:
            commit, files = self.hub.listing(spec)
            targets = [(remote, safe_path(directory, remote.path)) for remote in files]
        except FetchError as err:
            return fail(str(err))
        progress.revision, progress.files = commit, len(files)
        progress.bytes_total = sum(r.size for r in files)
        progress.phase = "Downloading"
        directory.mkdir(parents=True, exist_ok=True)
        self._remove_unwanted(directory, {t for _, t in targets})
        missing = []
        verified = Verified(directory)
        for remote, target in targets:  # what is on disk and right stays; anything else is fetched
            if target.is_file():
                if verified.matches(target, remote):
                    progress.reused += remote.size
                    progress.bytes_done += remote.size
                    progress.files_done += 1
                    continue
                logger.warning(
                    "%s/%s: %s is corrupted (checksum mismatch); fetching it again", namespace, name, remote.path
                )
                progress.repaired.append(remote.path)
                target.unlink()
            missing.append((remote, target))
        if missing:
            report(force=True)
            self.status.volumes(namespace, name, False)

        def on_bytes(count: int) -> None:
            progress.bytes_done += count
            progress.downloaded += max(count, 0)
            report()

        for remote, target in missing:
            for attempt in range(1, self.retries + 1):
                partial = target.with_name(target.name + PARTIAL)
                on_disk = partial.stat().st_size if partial.exists() else 0
                progress.bytes_done += on_disk  # a resumed file's first bytes
                try:
                    self.hub.download(spec.repo, commit, remote, target, on_bytes, self.max_rate)
                    verified.record(target, remote)
                    break
                except FetchError as err:
                    now_on_disk = partial.stat().st_size if partial.exists() else 0
                    progress.bytes_done -= now_on_disk  # counted again on the next try
                    progress.failed_file, progress.attempts, progress.last_error = remote.path, attempt, str(err)
                    logger.warning("%s/%s: try %d of %d: %s", namespace, name, attempt, self.retries, err)
                    if attempt == self.retries or self.stopping:
                        return fail(f"{err} (after {attempt} tries)")
                    report(force=True)
                    time.sleep(min(MAX_BACKOFF_SECONDS, self.backoff_seconds * 2 ** (attempt - 1)))
            progress.files_done += 1
        progress.phase, progress.last_error, progress.failed_file, progress.attempts = "Ready", "", "", 0
        progress.rate = 0.0
        (directory / REVISION_FILE).write_text(commit + "\n")
        verified.save({t for _, t in targets})
        report(force=True)
        self.status.volumes(namespace, name, True, progress.bytes_total)
        logger.info(
            "%s/%s: ready at %s: %d bytes downloaded, %d reused, repaired %s",
            namespace,
            name,
            commit,
            progress.downloaded,
            progress.reused,
            progress.repaired or "none",
        )
        return progress

    @staticmethod
    def _remove_unwanted(directory: Path, wanted: set[Path]) -> None:
        for path in sorted(directory.rglob("*"), reverse=True):
            keep = path in wanted or path.with_name(path.name.removesuffix(PARTIAL)) in wanted
            if path.is_file() and not keep and path.name not in (REVISION_FILE, VERIFIED_FILE):
                path.unlink()
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()

    def collect(self, caches: list[dict[str, Any]], namespaces: set[str] | None) -> None:
        """Delete the directories of ModelCaches that no longer exist (in `namespaces`, or every one)."""
        live = {(c["metadata"]["namespace"], c["metadata"]["name"]) for c in caches}
        if not self.root.is_dir():
            return
        for ns_dir in self.root.iterdir():
            if not ns_dir.is_dir() or (namespaces is not None and ns_dir.name not in namespaces):
                continue
            for cache_dir in ns_dir.iterdir():
                if cache_dir.is_dir() and (ns_dir.name, cache_dir.name) not in live:
                    logger.info("removing %s: its ModelCache is gone", cache_dir)
                    self.status.label(ns_dir.name, cache_dir.name, False)
                    self.status.volumes(ns_dir.name, cache_dir.name, False)
                    shutil.rmtree(cache_dir, ignore_errors=True)


def list_caches(api: kubernetes.client.CustomObjectsApi, namespace: str | None) -> list[dict[str, Any]]:
    listing: Any
    if namespace:
        listing = api.list_namespaced_custom_object(GROUP, VERSION, namespace, MODEL_CACHE_PLURAL)
    else:
        listing = api.list_cluster_custom_object(GROUP, VERSION, MODEL_CACHE_PLURAL)
    return sorted(listing.get("items") or (), key=lambda c: (c["metadata"]["namespace"], c["metadata"]["name"]))


def load_api() -> kubernetes.client.ApiClient:
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m goodput_operator.model_cache_agent", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this node's name (default $NODE_NAME)")
    parser.add_argument("--root", default=DEFAULT_ROOT, help="the node directory the models are kept in")
    parser.add_argument("--namespace", default=os.environ.get("WATCH_NAMESPACE") or None, help="only this namespace")
    parser.add_argument("--name", help="only this ModelCache (with --namespace)")
    parser.add_argument("--once", action="store_true", help="one pass, then exit (0 when every cache is Ready)")
    parser.add_argument("--resync-seconds", type=float, default=30.0)
    parser.add_argument("--report-seconds", type=float, default=2.0)
    parser.add_argument("--max-bytes-per-second", type=float, default=0.0, help="download throttle (0: none)")
    parser.add_argument("--retries", type=int, default=5, help="tries of a failing file per pass")
    parser.add_argument("--host-path", help="--root as the node sees it (default: --root), for the local volumes")
    parser.add_argument(
        "--volumes-per-node", type=int, default=4, help="local PersistentVolumes of each complete copy (0: none)"
    )
    parser.add_argument("--backoff-seconds", type=float, default=1.0, help="first wait between tries (doubles)")
    args = parser.parse_args(argv)
    if not args.node:
        parser.error("--node (or NODE_NAME) is required")
    if args.name and not args.namespace:
        parser.error("--name needs --namespace")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    client = load_api()
    api = kubernetes.client.CustomObjectsApi(client)
    endpoint = os.environ.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT
    agent = Agent(
        args.node,
        Path(args.root),
        Hub(endpoint, os.environ.get("HF_TOKEN") or None),
        Status(
            api,
            args.node,
            kubernetes.client.CoreV1Api(client),
            Path(args.host_path or args.root),
            args.volumes_per_node,
        ),
        args.max_bytes_per_second,
        args.report_seconds,
        max(1, args.retries),
        args.backoff_seconds,
    )

    def stop(*_: Any) -> None:
        agent.stopping = True
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        ok = True
        try:  # an API server or disk error ends this pass, not the agent: the next pass tries again
            caches = list_caches(api, args.namespace)
            if args.name:
                caches = [c for c in caches if c["metadata"]["name"] == args.name]
            for cache in caches:
                ok = agent.sync(cache).phase == "Ready" and ok
            if not args.name:
                agent.collect(caches, {args.namespace} if args.namespace else None)
        except (ApiException, OSError, urllib3.exceptions.HTTPError) as err:
            logger.error("pass failed: %s", err)
            ok = False
        if args.once:
            return 0 if ok else 1
        time.sleep(args.resync_seconds)


if __name__ == "__main__":
    sys.exit(main())
