"""The Hub as the ModelCache agent reads it: a revision's files with their checksums, and each file fetched
into `<file>.partial` (resumed with a Range request, throttled), checked, then renamed into place. Hub
requests honour HF_ENDPOINT and HF_TOKEN like every hub client."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput_contract.api.model_cache_spec import ModelCacheSpec

CHUNK = 256 * 1024
HTTP_TIMEOUT_SECONDS = 30.0
PARTIAL = ".partial"


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative to the repository's root, POSIX
    size: int
    algorithm: str  # "sha256" (LFS) or "git-sha1" (the git blob hash)
    digest: str


class FetchError(Exception):
    """A file could not be fetched or did not match its checksum."""


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
