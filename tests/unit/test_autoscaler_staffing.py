"""The replicas the law plans for a rate (autoscaling/staffing.py, square-root staffing), and its headroom and
pace on arrivals more dispersed than Poisson."""

from dataclasses import replace

import pytest
from law_signals import KNOWN, POLICY, met

from goodput_operator.autoscaling.law import DOWN, UP, decide
from goodput_operator.autoscaling.staffing import capacity_term, planned_load
from goodput_operator.autoscaling.state import Memory, Observation, Signals


@pytest.mark.parametrize(
    ("rate", "mu", "expected"),
    [(0.0, 4.0, 0), (2.4, 4.0, 1), (2.5, 4.0, 2), (9.2, 4.0, 3), (9.3, 4.0, 4), (10, None, 0)],
)
def test_capacity_term(rate, mu, expected):
    assert capacity_term(rate, mu, 0.8) == expected


def test_the_planned_share_grows_with_the_count():
    """Square-root staffing: the headroom is 1 − utilisation at 4 replicas and shrinks as 1/√N."""
    shares = [planned_load(1.0, n, 0.8) for n in (1, 2, 4, 9, 16)]
    assert shares == pytest.approx([0.6, 1 - 0.2 * 2**0.5, 0.8, 1 - 0.2 * 2 / 3, 0.9])


def bursty(rate: float, dispersion: float = 4.6, peakedness: float = 4.0, **kw) -> Signals:
    """A minute met within the SLO on arrivals whose counts per period swing `dispersion` times Poisson's."""
    return Signals(arrival_rate=rate, attainment=0.99, dispersion=dispersion, peakedness=peakedness, **kw)


def test_on_poisson_arrivals_the_headroom_is_the_square_root_rule_as_before():
    """Peakedness 1 (Poisson, or dispersion not yet measured) is the law as it was: 0.6, 0.72, 0.8 and 0.9 of
    capacity at 1, 2, 4 and 16 replicas."""
    for n, share in ((1, 0.6), (2, 0.7172), (4, 0.8), (16, 0.9)):
        assert planned_load(1.0, n, 0.8) == pytest.approx(share, abs=1e-4)
        assert planned_load(1.0, n, 0.8, 1.0) == planned_load(1.0, n, 0.8)
    poisson = decide(POLICY, Observation(1000.0, 3, 3, met(9.0)), KNOWN)
    measured = decide(POLICY, Observation(1000.0, 3, 3, bursty(9.0, dispersion=1.1, peakedness=1.0)), KNOWN)
    assert (poisson.desired, poisson.cause) == (measured.desired, measured.cause) == (3, "steady")
    assert "dispersion" not in measured.reason


def test_over_dispersed_arrivals_get_headroom_by_the_square_root_of_their_peakedness():
    """c = R/μ + β√(z·R/μ): at peakedness 4 the headroom per replica doubles, so the same rate needs more
    replicas, and the decision says why: the measured index and the factor on the headroom."""
    assert 1 - planned_load(1.0, 4, 0.8, 4.0) == pytest.approx(2 * (1 - planned_load(1.0, 4, 0.8)))
    assert capacity_term(9.0, 4.0, 0.8, 4.0) > capacity_term(9.0, 4.0, 0.8)
    decision = decide(POLICY, Observation(1000.0, 3, 3, bursty(9.0)), KNOWN)
    assert (decision.desired, decision.direction, decision.cause) == (4, UP, "capacity")
    assert "index of dispersion 4.6 per period, headroom ×2.00" in decision.reason
    assert decision.memory.peakedness == 4.0


def test_a_burst_no_change_of_rate_on_bursty_traffic():
    """A window at 1.7 times the level is a change on Poisson arrivals (taken at once) but inside the spread of
    arrivals four times as dispersed, whose bursts are over before a replica asked for them serves."""
    settled = Memory(capacity_per_replica=4.0, level=6.0, level_age=600.0, seen_at=985.0)
    poisson = decide(POLICY, Observation(1000.0, 3, 3, met(10.0)), settled)
    assert poisson.memory.level == 10.0
    burst = decide(POLICY, Observation(1000.0, 3, 3, bursty(10.0)), settled)
    assert 6.0 < burst.memory.level < 6.1  # smoothed, four times slower than on Poisson arrivals


def test_on_bursty_traffic_pods_still_starting_that_are_no_longer_needed_go_at_once():
    """A burst asked for pods that would serve after it is over: once the need has fallen back they are
    cancelled at once rather than kept for the stabilisation window. On Poisson arrivals they stay."""
    memory = Memory(capacity_per_replica=4.0, level=4.0, level_age=600.0, seen_at=985.0, high_since=990.0)
    cancelled = decide(POLICY, Observation(1000.0, 5, 2, bursty(4.0)), memory)
    assert (cancelled.desired, cancelled.direction, cancelled.cause) == (3, DOWN, "scale_down")
    assert "2 of 3 replicas still starting no longer needed" in cancelled.reason
    kept = decide(POLICY, Observation(1000.0, 5, 2, met(4.0)), memory)
    assert kept.desired == 5


def test_on_bursty_traffic_a_step_down_waits_longer():
    """The level settles z times slower on bursty arrivals, and a step down waits as much longer (at most
    four windows): a lull between bursts is not a fall of the rate."""
    memory = Memory(capacity_per_replica=4.0, high_since=1000.0, level=1.0, level_age=600.0, seen_at=1295.0)
    poisson = decide(POLICY, Observation(1300.0, 4, 4, met(1.0)), memory)
    assert (poisson.desired, poisson.cause) == (3, "scale_down")
    waiting = decide(POLICY, Observation(1300.0, 4, 4, bursty(1.0, peakedness=2.0)), memory)
    assert (waiting.desired, waiting.cause) == (4, "stabilizing") and "of 600 s" in waiting.reason
    after = decide(POLICY, Observation(1600.0, 4, 4, bursty(1.0, peakedness=2.0)), memory)
    assert (after.desired, after.cause) == (3, "scale_down")


def test_with_dispersion_ignored_the_law_plans_as_for_poisson():
    """`--autoscaler-dispersion off` (Policy.dispersion False, the simulator's goodput-poisson): the same bursty
    signals leave the count where Poisson arrivals would, and the reason names no dispersion."""
    ignored = decide(replace(POLICY, dispersion=False), Observation(1000.0, 3, 3, bursty(9.0)), KNOWN)
    assert (ignored.desired, ignored.cause) == (3, "steady")
    assert ignored.memory.peakedness == 1.0 and "dispersion" not in ignored.reason
