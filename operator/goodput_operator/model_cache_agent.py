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
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from goodput_contract.api import GROUP, MODEL_CACHE_PLURAL, VERSION
from goodput_contract.api.model_cache_spec import parse_model_cache
from goodput_contract.api.spec import SpecError
from goodput_operator.model_cache_disk import REVISION_FILE, Verified, remove_unwanted, safe_path
from goodput_operator.model_cache_hub import PARTIAL, FetchError, Hub, file_digest
from goodput_operator.model_cache_progress import Progress, summary
from goodput_operator.model_cache_status import Status

# tests and hack/health_testdata.py import these from here
__all__ = ["FetchError", "Progress", "file_digest", "main", "safe_path", "summary"]

logger = logging.getLogger("goodput_operator.model_cache_agent")

DEFAULT_ROOT = "/var/lib/goodput/models"
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
MAX_BACKOFF_SECONDS = 60.0


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
        remove_unwanted(directory, {t for _, t in targets})
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
