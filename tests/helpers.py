"""Helpers shared by every tier: `from helpers import stop_process, wait_for`.

tests/ has no __init__.py, so pytest (rootdir-relative "prepend" import mode) puts the
directory of tests/conftest.py, this one, on sys.path before any tier's modules load.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def wait_for(
    check: Callable[[], Any],
    timeout: float = 30.0,
    what: str = "condition",
    *,
    every: float = 1.0,
    explain: Callable[[], str] | None = None,
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll `check` every `every` seconds until it returns something truthy, and return that.

    After `timeout` seconds fail naming `what`, the last of the `ignore`d exceptions `check`
    raised (they count as "not yet"; any other propagates) and `explain()`, if given.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = check()
        except ignore as err:
            last_error = err
        else:
            if value:
                return value
        if time.monotonic() > deadline:
            message = f"timed out after {timeout:g}s waiting for {what}"
            if last_error is not None:
                message += f" (last error: {last_error})"
            if explain is not None:
                message += f"\n{explain()}"
            raise AssertionError(message)
        time.sleep(every)


def stop_process(process: subprocess.Popen[Any], timeout: float) -> int:
    """SIGTERM, up to `timeout` seconds to exit, then SIGKILL (at once for a timeout of 0).

    Nothing happens to a process that already exited. Returns its exit status.
    """
    if process.poll() is None:
        if timeout > 0:
            process.terminate()
            try:
                return process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        process.kill()
        process.wait()
    return process.returncode


def tier(conftest: str, *markers: str, when: dict[str, str] | None = None) -> Callable[[list[pytest.Item]], None]:
    """A directory's `pytest_collection_modifyitems`: every test under the directory of `conftest` (its
    ``__file__``) gets `markers`, and the markers of `when` ({marker: fixture}) where it uses that fixture.
    The tiers' markers come from here, one line in each directory's conftest, not from each file."""
    directory = Path(conftest).resolve().parent
    extra = when or {}

    @pytest.hookimpl(tryfirst=True)  # before `-m` deselects by them
    def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
        for item in items:
            if directory not in item.path.resolve().parents:
                continue
            for name in markers:
                item.add_marker(name)
            for name, fixture in extra.items():
                if fixture in getattr(item, "fixturenames", ()):
                    item.add_marker(name)

    return pytest_collection_modifyitems
