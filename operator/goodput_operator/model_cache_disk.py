"""A ModelCache's directory on the node: paths kept inside it, the files a pass checked (not read again while
unchanged), and the files no longer wanted removed."""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

from goodput_operator.model_cache_hub import PARTIAL, FetchError, RemoteFile, file_digest

REVISION_FILE = ".goodput-revision"
VERIFIED_FILE = ".goodput-verified.json"


def safe_path(root: Path, relative: str) -> Path:
    """`relative` under `root`; FetchError for a path that would leave it."""
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute() or ".." in parts or relative.endswith(PARTIAL):
        raise FetchError(f"{relative}: not a path inside the repository")
    return root.joinpath(*parts)


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


def remove_unwanted(directory: Path, wanted: set[Path]) -> None:
    for path in sorted(directory.rglob("*"), reverse=True):
        keep = path in wanted or path.with_name(path.name.removesuffix(PARTIAL)) in wanted
        if path.is_file() and not keep and path.name not in (REVISION_FILE, VERIFIED_FILE):
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
