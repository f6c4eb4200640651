"""The start-up clock: replicas asked for → ready, per slot, averaged; what the forecast looks ahead by."""

import pytest

from goodput_operator.autoscaling.startup import WEIGHT, StartupClock


def test_a_replica_is_timed_from_first_wanted_to_ready():
    clock = StartupClock()
    assert clock.observe(0.0, 1, 1) is None  # nothing started yet
    clock.observe(15.0, 3, 1)  # two asked for
    clock.observe(30.0, 3, 1)
    assert clock.observe(90.0, 3, 2) == 75.0  # the first became ready 75 s after it was asked for
    assert clock.observe(105.0, 3, 3) == pytest.approx(WEIGHT * 90.0 + (1 - WEIGHT) * 75.0)
    assert clock.samples == 2


def test_a_replica_given_up_before_it_started_is_not_a_sample():
    clock = StartupClock()
    clock.observe(0.0, 3, 1)
    clock.observe(30.0, 2, 1)  # one of the two dropped
    assert clock.observe(200.0, 2, 2) == 200.0
    clock.observe(215.0, 3, 2)  # asked for again: timed from now, not from t=0
    assert clock.observe(275.0, 3, 3) == pytest.approx(WEIGHT * 60.0 + (1 - WEIGHT) * 200.0)
