"""The simulator's verdict on the goodput law (bench/autoscale_sim.py): it meets the SLO with fewer
replica-seconds than static peak provisioning, and beats the queue-length HPA (bench/README.md).

One hour per trace on the measured capacity curve, a 60 s pod start-up, seeded Poisson
arrivals; the same run `python -m bench.autoscale_sim` prints.
"""

import pytest

from bench.autoscale_sim import simulate

TARGET = 0.95


@pytest.fixture(scope="module")
def results():
    return simulate(duration=3600.0, startup=60.0, seed=7, target=TARGET)


@pytest.mark.parametrize("trace", ["steady", "ramp", "spike", "diurnal"])
def test_goodput_law_meets_the_slo_with_fewer_replicas_than_static_peak(results, trace):
    ours, static = results[trace]["goodput"], results[trace]["static-peak"]
    assert ours["attainment"] >= TARGET, ours["attainment"]
    assert ours["replica_seconds"] < static["replica_seconds"]


@pytest.mark.parametrize("trace", ["steady", "ramp", "spike", "diurnal"])
def test_goodput_law_beats_the_queue_length_law(results, trace):
    ours, queue = results[trace]["goodput"], results[trace]["queue-hpa"]
    assert ours["attainment"] > queue["attainment"]
    assert ours["replica_seconds"] <= 1.10 * queue["replica_seconds"]
