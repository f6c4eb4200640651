"""`python -m goodput_operator` starts kopf again after kopf stopped on the API server's error.

kopf ends the whole operator when a watch gets an answer it does not retry, such as a 404 for a
custom resource that a restarted API server has not served yet. `run_with_restarts` runs it again
after a pause, a bounded number of times in a window, and lets any other failure through at once.
The API-server restart itself is tests/operator/test_faults_control_plane.py's.
"""

from __future__ import annotations

import pytest
from kopf._cogs.clients.errors import APINotFoundError, APIServerError

from goodput_operator import __main__ as operator_main


def not_found() -> APINotFoundError:
    return APINotFoundError({"message": "404 page not found"}, status=404, headers={})


class Runs:
    """A kopf run that fails with the given errors in turn, then returns."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors, self.calls = list(errors), 0

    def __call__(self) -> None:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)


def test_a_run_ended_by_the_api_servers_errors_is_started_again_after_a_pause() -> None:
    run, slept = Runs(not_found(), APIServerError("etcd", status=503, headers={})), []
    operator_main.run_with_restarts(run, pause=2.0, sleep=slept.append)
    assert run.calls == 3 and slept == [2.0, 2.0]


def test_the_process_gives_up_after_too_many_restarts_in_the_window() -> None:
    run, slept = Runs(*(not_found() for _ in range(10))), []
    with pytest.raises(APINotFoundError):
        operator_main.run_with_restarts(run, restarts=3, sleep=slept.append, clock=lambda: 100.0)
    assert run.calls == 4 and len(slept) == 3


def test_restarts_spread_beyond_the_window_never_exhaust_it() -> None:
    now = iter(range(0, 100 * 10_000, 10_000))  # each failure ten thousand seconds after the one before
    run = Runs(*(not_found() for _ in range(8)))
    operator_main.run_with_restarts(run, restarts=3, sleep=lambda _: None, clock=lambda: float(next(now)))
    assert run.calls == 9


def test_any_other_failure_ends_the_process_at_once() -> None:
    run, slept = Runs(ValueError("a bug")), []
    with pytest.raises(ValueError, match="a bug"):
        operator_main.run_with_restarts(run, sleep=slept.append)
    assert run.calls == 1 and not slept
