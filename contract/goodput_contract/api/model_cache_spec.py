"""A typed view of a ModelCache: a Hub model's files kept on nodes' local disks for the serving pods.

The caching agent (one per node) reads it; parsing raises SpecError naming the field for what the
schema cannot check.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from goodput_contract.api.spec import SpecError, parse_source

PHASES = ("Pending", "Downloading", "Ready", "Failed")
_REVISION = re.compile(r"^[A-Za-z0-9][-_.A-Za-z0-9/]{0,199}$")


@dataclass(frozen=True)
class ModelCacheSpec:
    name: str
    repo: str  # the Hub repository id (spec.source hf://org/name)
    revision: str = "main"
    files: tuple[str, ...] = ()  # glob patterns of the repository's files to keep; () keeps every file

    def wants(self, path: str) -> bool:
        return not self.files or any(fnmatch.fnmatchcase(path, pattern) for pattern in self.files)


def parse_model_cache(name: str, spec: dict[str, Any]) -> ModelCacheSpec:
    uri = spec.get("source")
    if not isinstance(uri, str):
        raise SpecError("source", "is required")
    try:
        source = parse_source(uri)
    except SpecError:
        raise SpecError("source", f"{uri!r} is not hf://org/name") from None
    if source.scheme != "hf" or source.file:
        raise SpecError("source", f"{uri!r}: a ModelCache holds a Hub repository; give hf://org/name")
    revision = spec.get("revision", "main")
    if not isinstance(revision, str) or not _REVISION.match(revision) or ".." in revision:
        raise SpecError("revision", f"{revision!r} is not a branch, tag or commit")
    files = spec.get("files", [])
    if not isinstance(files, list) or not all(isinstance(p, str) and p for p in files):
        raise SpecError("files", "is a list of glob patterns such as '*.safetensors'")
    return ModelCacheSpec(name, source.repo, revision, tuple(files))


NODE_LABEL_PREFIX = "modelcache.goodput.dev/"
# The StorageClass of the local PersistentVolumes the agent publishes for each node's copy, and the label
# (value: cache_key) that a serving pod's claim selects them by.
STORAGE_CLASS = "goodput-model-cache"
VOLUME_LABEL = "serving.goodput.dev/model-cache"


def cache_key(namespace: str, name: str) -> str:
    """<namespace>.<name>, hashed when longer than a label's 63 characters."""
    key = f"{namespace}.{name}"
    if len(key) > 63:
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        key = f"{key[:46].rstrip('-_.')}-{digest}"
    return key


def node_label(namespace: str, name: str) -> str:
    """The label the caching agent sets to "ready" on a node holding every file of a ModelCache, for
    the serving pods' node affinity: modelcache.goodput.dev/<namespace>.<name>."""
    return NODE_LABEL_PREFIX + cache_key(namespace, name)
