"""The polling and process helpers every tier imports from tests/helpers.py."""

import subprocess
import sys
import time

import pytest
from helpers import stop_process, wait_for


def test_wait_for_returns_the_first_truthy_value():
    values = iter([0, None, "", "done"])
    assert wait_for(lambda: next(values), 5, "a value", every=0.001) == "done"


def test_wait_for_names_what_it_waited_for_the_last_ignored_error_and_the_explanation():
    def check():
        raise OSError("connection refused")

    with pytest.raises(AssertionError) as err:
        wait_for(check, 0.05, "the server", every=0.01, ignore=(OSError,), explain=lambda: "log tail")
    assert str(err.value) == "timed out after 0.05s waiting for the server (last error: connection refused)\nlog tail"


def test_wait_for_lets_other_errors_through():
    with pytest.raises(ZeroDivisionError):
        wait_for(lambda: 1 / 0, 5, "never", ignore=(OSError,))


def test_stop_process_terminates_then_kills():
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stop_process(polite, timeout=10) == -15
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    assert stubborn.stdout is not None and stubborn.stdout.readline()  # SIGTERM is ignored from here on
    started = time.monotonic()
    assert stop_process(stubborn, timeout=0.2) == -9
    assert time.monotonic() - started < 5
    stubborn.stdout.close()
    assert stop_process(stubborn, timeout=10) == -9  # already gone: nothing more happens


def test_a_timeout_of_zero_kills_at_once():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stop_process(process, timeout=0) == -9
