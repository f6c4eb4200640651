"""Builds the images in the background while the tiers before the cluster's run.

The first e2e module brings up the node and runs `hack/images.sh all`: build both images (the sources
changed, so the runtime's top layers are rebuilt), write their archives, import them into the node's
containerd. Run at the session's start, `hack/images.sh prepare` does all but the import beside the
unit, runtime and gateway tiers, which spend most of their time in processes of their own; the e2e
module's `all` then waits on the script's lock, finds both images current and their archives written,
and only imports. Started only where the node can run and a collected test uses it; the build runs
at the lowest CPU priority, and its output goes to goodput-images-prepare.log in the system's temporary folder.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "hack" / "images.sh"
STOP_WAIT_SECONDS = 600  # a build under way at the session's end is waited for this long, then stopped

_build: dict[str, subprocess.Popen] = {}


def start(session: pytest.Session) -> None:
    """Start `images.sh prepare` when a collected test uses the node and the machine can run one
    (`GOODPUT_IMAGES_PREPARE=off`: never)."""
    if os.environ.get("GOODPUT_IMAGES_PREPARE", "on") == "off":
        return
    if not any("node" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    from node import node_unsupported  # tests/e2e's, on the path once its conftest is collected

    if node_unsupported():
        return
    log = open(Path(tempfile.gettempdir()) / "goodput-images-prepare.log", "wb")  # noqa: SIM115
    _build["proc"] = subprocess.Popen(
        ["nice", "-n", "19", str(SCRIPT), "prepare"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    log.close()  # the child holds its own descriptor


def finish(interrupted: bool) -> None:
    """Wait for a build still under way (bounded; not after an interrupt), so that no buildah is left
    running after the session."""
    proc = _build.pop("proc", None)
    if proc is None or proc.poll() is not None:
        return
    deadline = time.monotonic() + (0 if interrupted else STOP_WAIT_SECONDS)
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
