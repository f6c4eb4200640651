"""One node's progress on one ModelCache (status.nodes.<node>), and the summary over every node that
`kubectl get modelcaches` shows."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


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
