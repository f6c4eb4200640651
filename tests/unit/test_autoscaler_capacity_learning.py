"""The capacity per replica the law learns from live SLO attainment (autoscaling/capacity_learning.py): a
lasting miss at the planned load lowers it a step, evidence above the aim raises it, a queue is a shortage."""

import itertools
from dataclasses import replace

import pytest
from law_signals import KNOWN, POLICY, met, missed

from goodput_operator.autoscaling.capacity_learning import learn_capacity
from goodput_operator.autoscaling.law import decide
from goodput_operator.autoscaling.staffing import planned_load
from goodput_operator.autoscaling.state import Memory, Observation, Signals, start_memory


def in_band(attainment: float, waiting: int = 0, ready: int = 4) -> Signals:
    """A minute at exactly the load planned for `ready` replicas of capacity 4, 60 requests finished."""
    return Signals(ready * planned_load(4.0, ready, 0.8), attainment=attainment, waiting=waiting, finished=60)


def test_a_lasting_miss_at_the_planned_load_lowers_the_capacity_and_a_queued_one_does_not():
    memory = Memory(capacity_per_replica=4.0, seen_at=940.0)
    queued = decide(POLICY, Observation(1000.0, 4, 4, in_band(0.90, waiting=5)), memory)
    assert queued.memory.capacity_per_replica == 4.0  # a queue is the shortage's, not capacity's
    missed_ = decide(POLICY, Observation(1000.0, 4, 4, in_band(0.90)), memory)
    assert missed_.memory.capacity_per_replica == pytest.approx(3.76)  # one step down, at most 6 %
    assert missed_.memory.ceiling == 4.0  # and it will probe no higher than the refuted estimate


WITH_CEILING = Memory(capacity_per_replica=4.0, ceiling=4.5)
SPANNED = Memory(level=10.0, level_age=60.0)  # readings over a whole window behind the rate


@pytest.mark.parametrize(
    ("memory", "signals", "ready", "expected"),
    [
        # unset: the first load met with nothing queued, over a whole window, is the planned load at that count (safe)
        (SPANNED, met(10.0), 2, 5.0 / planned_load(1.0, 2, 0.8)),
        (Memory(level=10.0, level_age=15.0), met(10.0), 2, None),  # a rate counted over 15 s: too few requests
        (Memory(), met(10.0), 2, None),  # the first reading of all
        (SPANNED, missed(10.0), 2, None),  # a miss alone says only "less than this"
        # met at 5 per replica, far above the 2.87 planned, long window too: move 30 % of the way up to it
        (KNOWN, met(10.0), 2, (2.869 + 0.3 * (5.0 - 2.869)) / planned_load(1.0, 2, 0.8)),
        (KNOWN, met(10.0, attainment_long=0.9), 2, 4.0),  # ... but not while the long window misses
        (KNOWN, in_band(0.99, ready=2), 2, 4.8),  # evidence above the aim, no miss seen yet: up 20 %
        (WITH_CEILING, in_band(0.99, ready=2), 2, 4.0),  # after a miss: needs stronger evidence than 60 requests
        (KNOWN, in_band(0.90, ready=2), 2, 3.76),  # a lasting miss at the plan: down a step (6 %)
        (KNOWN, in_band(0.90, waiting=3, ready=2), 2, 4.0),  # with a queue: the shortage's
        (KNOWN, Signals(2.0, attainment=0.5, finished=60), 2, 4.0),  # far under the plan: the requests', not load
        (KNOWN, Signals(10.0, attainment=None), 2, 4.0),
    ],
)
def test_capacity_is_learnt_from_live_attainment(memory, signals, ready, expected):
    learnt = learn_capacity(memory, signals, ready, POLICY, dt=60.0).capacity_per_replica
    assert learnt == pytest.approx(expected, rel=1e-3) if expected is not None else learnt is None


def test_a_configured_capacity_is_probed_above_in_small_steps():
    """capacityPerReplica is a measurement: evidence above the aim raises it by the ceiling's small steps, not
    the 20 % an estimate with no miss behind it takes."""
    unhinted = learn_capacity(Memory(capacity_per_replica=4.0), in_band(0.99, ready=2), 2, POLICY, dt=60.0)
    assert unhinted.capacity_per_replica == pytest.approx(4.8)  # an estimate no miss has refuted: +20 %
    memory, seen = start_memory(4.0), [4.0]
    for _ in range(12):  # twelve verdicts of 60 requests met at 0.99
        memory = learn_capacity(memory, in_band(0.99, ready=2), 2, POLICY, dt=60.0)
        seen.append(memory.capacity_per_replica)
    assert seen[1] == 4.0  # the first verdict relaxes the ceiling only
    assert seen[-1] > 4.0  # it does rise, ...
    assert all(b <= a * 1.025 for a, b in itertools.pairwise(seen))  # ... a few per cent at a time
    assert start_memory(None) == Memory()  # no hint: learnt from scratch


def test_an_estimate_that_starts_unknown_settles_where_the_replicas_meet_the_slo():
    """No hint: a toy service whose replicas each meet the SLO up to 2.7 req/s and fail above 3."""
    memory, current, now = Memory(), 8, 0.0
    counts = []
    for _ in range(480):
        rate = 12.0
        load = rate / current
        attainment = 0.99 if load <= 2.7 else 0.93 if load <= 3.0 else 0.7
        signals = Signals(
            rate, attainment=attainment, attainment_long=attainment, finished=rate * 60, waiting=0 if load <= 3.0 else 5
        )
        decision = decide(POLICY, Observation(now, current, current, signals), memory)
        memory, current, now = decision.memory, decision.desired, now + 15.0
        counts.append(current)
    last = counts[-240:]  # the last hour
    assert set(last) <= {4, 5}, last  # 5 run at 2.4 req/s each; 4, at 3.0, are probed now and then
    assert last.count(5) >= 0.8 * len(last), last


def test_on_bursty_traffic_a_queued_miss_at_the_plan_is_evidence():
    """On Poisson arrivals a queue at the planned count is a shortage and teaches nothing; on bursty ones the
    headroom is there to absorb the bursts' queues, so a lasting miss with one lowers the capacity, judged
    against the binomial spread times the peakedness (bursts miss together)."""
    level = 4 * planned_load(4.0, 4, 0.8, 2.0)
    memory = Memory(capacity_per_replica=4.0, seen_at=940.0, level=level, level_age=600.0)
    signals = Signals(level, attainment=0.80, waiting=5, finished=120, dispersion=2.5, peakedness=2.0)
    lowered = decide(POLICY, Observation(1000.0, 4, 4, signals), memory)
    assert lowered.memory.capacity_per_replica == pytest.approx(3.76)
    poisson = decide(POLICY, Observation(1000.0, 4, 4, replace(signals, peakedness=1.0)), memory)
    assert poisson.memory.capacity_per_replica == 4.0
