"""The goodput scaling law, table-driven: what a user of the service would see it do."""

import pytest

from goodput_operator.autoscaling.law import (
    DOWN,
    HOLD,
    SCALE_CAUSES,
    UP,
    Memory,
    Observation,
    Policy,
    Signals,
    capacity_term,
    decide,
    learn_capacity,
)

POLICY = Policy(min_replicas=1, max_replicas=10, attainment_target=0.95, ttft_target=0.5, tpot_target=0.05,
                scale_down_window=300)
KNOWN = Memory(capacity_per_replica=4.0)  # requests per second per replica


def met(rate: float, **kw) -> Signals:
    return Signals(arrival_rate=rate, attainment=0.99, **kw)


def missed(rate: float, waiting: int = 12, **kw) -> Signals:
    return Signals(arrival_rate=rate, attainment=0.80, waiting=waiting, ttft_p90=0.71, **kw)


CASES = [
    # id, current, ready, signals, memory, desired, direction, cause
    ("steady load fits", 3, 3, met(9.0), KNOWN, 3, HOLD, "steady"),
    ("capacity term grows", 2, 2, met(12.0), KNOWN, 4, UP, "capacity"),
    ("growth bounded to doubling", 2, 2, met(40.0), KNOWN, 4, UP, "capacity"),
    ("clamped to max", 8, 8, met(80.0), KNOWN, 10, UP, "capacity"),
    ("guard adds half the ready replicas", 4, 4, missed(8.0), KNOWN, 6, UP, "slo_guard"),
    ("guard adds at least one", 1, 1, missed(2.0), KNOWN, 2, UP, "slo_guard"),
    ("guard waits for starting pods", 6, 4, missed(8.0), KNOWN, 6, HOLD, "slo_guard"),
    ("a miss without a queue lowers the capacity learnt", 2, 2, Signals(6.0, attainment=0.5), KNOWN, 3, UP,
     "capacity"),
    ("no guard without finished requests", 2, 2, Signals(6.0, attainment=None, waiting=3), KNOWN, 2, HOLD,
     "steady"),
    ("missing metrics hold", 5, 5, None, KNOWN, 5, HOLD, "metrics_missing"),
    ("below min is raised", 0, 0, None, KNOWN, 1, UP, "bounds"),
    ("above max is lowered", 12, 12, None, KNOWN, 10, DOWN, "bounds"),
    ("at max the guard holds", 10, 10, missed(50.0), KNOWN, 10, HOLD, "bounds"),
]


@pytest.mark.parametrize(("current", "ready", "signals", "memory", "desired", "direction", "cause"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_law(current, ready, signals, memory, desired, direction, cause):
    obs = Observation(now=1000.0, current=current, ready=ready, signals=signals)
    decision = decide(POLICY, obs, memory)
    assert (decision.desired, decision.direction, decision.cause) == (desired, direction, cause), decision.reason
    if direction != HOLD:  # the dashboard's scale-event annotation sees only the causes exported from the start
        assert cause in SCALE_CAUSES[direction]


def test_every_scale_cause_is_exported_at_zero_before_the_first_change():
    from prometheus_client import generate_latest

    from goodput_operator.autoscaling.loop import Autoscaler

    Autoscaler(ctx=None, kube=None, source=None, period=1.0, window=1.0)
    text = generate_latest().decode()
    for direction, causes in SCALE_CAUSES.items():
        for cause in causes:
            assert f'goodput_autoscaler_scale_events_total{{direction="{direction}",reason="{cause}"}}' in text


def test_reason_speaks_in_slo_terms():
    decision = decide(POLICY, Observation(0, 2, 2, missed(6.0)), KNOWN)
    assert decision.reason == "attainment 0.80 < 0.95 target, p90 TTFT 0.71 s > 0.50 s target, 12 requests queued"


@pytest.mark.parametrize(("rate", "held", "desired", "cause"), [
    (2.0, 100, 4, "stabilizing"),      # inside the window
    (2.0, 300, 3, "scale_down"),       # one step, not straight to 1
    (9.0, 300, 4, "steady"),           # 3 replicas would run at 75 % ≥ 70 %
    (8.0, 300, 3, "scale_down"),       # 67 % < 70 %
])
def test_scale_down_waits_and_steps_one_at_a_time(rate, held, desired, cause):
    memory = Memory(capacity_per_replica=4.0, high_since=1000.0)
    decision = decide(POLICY, Observation(1000.0 + held, 4, 4, met(rate)), memory)
    assert (decision.desired, decision.cause) == (desired, cause), decision.reason


def test_after_the_window_steps_down_one_per_period_until_load_says_stop():
    memory = Memory(capacity_per_replica=4.0, high_since=0.0)
    first = decide(POLICY, Observation(300.0, 4, 4, met(5.0)), memory)
    assert first.desired == 3
    second = decide(POLICY, Observation(315.0, 3, 3, met(5.0)), first.memory)
    assert second.desired == 2  # 5 req/s on 2 replicas: 62 % < 70 %
    third = decide(POLICY, Observation(330.0, 2, 2, met(5.0)), second.memory)
    assert (third.desired, third.cause) == (2, "steady")  # on 1 replica: 125 %


def test_a_need_inside_the_window_restarts_it():
    memory = Memory(capacity_per_replica=4.0, high_since=0.0)
    busy = decide(POLICY, Observation(200.0, 4, 4, met(12.0)), memory)
    assert busy.desired == 4
    quiet = decide(POLICY, Observation(400.0, 4, 4, met(1.0)), busy.memory)
    assert (quiet.desired, quiet.cause) == (4, "stabilizing")


def test_misses_while_pods_start_teach_nothing_about_capacity():
    memory = Memory(capacity_per_replica=4.0)
    during = decide(POLICY, Observation(100.0, 6, 4, missed(14.0)), memory)
    assert during.memory.capacity_per_replica == 4.0
    settled = decide(POLICY, Observation(100.0 + POLICY.settle_seconds, 6, 6, missed(14.0)), during.memory)
    assert settled.memory.capacity_per_replica < 4.0


def test_no_scale_down_while_slo_missed():
    memory = Memory(capacity_per_replica=4.0, high_since=0.0)
    decision = decide(POLICY, Observation(1000.0, 4, 4, Signals(1.0, attainment=0.9)), memory)
    assert decision.desired == 4


def test_min_zero_needs_an_idle_period():
    zero = Policy(min_replicas=0, max_replicas=3, scale_down_window=0)
    idle = Signals(0.0, attainment=None)
    memory = Memory(capacity_per_replica=4.0, high_since=0.0)
    assert decide(zero, Observation(5000.0, 1, 1, idle), memory).desired == 1  # no idle period: floor 1
    with_idle = Policy(min_replicas=0, max_replicas=3, scale_down_window=0, idle_period=600)
    first = decide(with_idle, Observation(100.0, 1, 1, idle), memory)
    assert first.desired == 1
    later = decide(with_idle, Observation(700.0, 1, 1, idle), first.memory)
    assert (later.desired, later.cause) == (0, "idle")
    busy = decide(with_idle, Observation(700.0, 1, 1, met(0.5)), first.memory)
    assert busy.desired == 1



def test_requests_held_at_the_gateway_wake_a_service_at_zero_at_once():
    zero = Policy(min_replicas=0, max_replicas=3, scale_down_window=0, idle_period=600)
    memory = Memory(capacity_per_replica=4.0)
    woken = decide(zero, Observation(10.0, 0, 0, None, "no ready pods", held=3), memory)
    assert (woken.desired, woken.direction, woken.cause) == (1, UP, "wake")
    assert "3 requests held at the gateway" in woken.reason
    quiet = decide(zero, Observation(10.0, 0, 0, None, "no ready pods", held=0), memory)
    assert (quiet.desired, quiet.direction) == (0, HOLD)
    unknown = decide(zero, Observation(10.0, 0, 0, None, "no ready pods"), memory)
    assert (unknown.desired, unknown.direction) == (0, HOLD) and "unknown" in unknown.reason


def test_the_gateways_last_request_time_is_the_idle_signal():
    zero = Policy(min_replicas=0, max_replicas=3, scale_down_window=0, idle_period=600)
    idle = Signals(0.0, attainment=None)
    memory = Memory(capacity_per_replica=4.0, high_since=0.0)
    first = decide(zero, Observation(100.0, 1, 1, idle, last_request_age=650.0), memory)
    assert (first.desired, first.cause) == (0, "idle")  # a restarted autoscaler need not wait a whole period
    recent = decide(zero, Observation(5000.0, 1, 1, idle, last_request_age=30.0), first.memory)
    assert recent.desired == 1  # the pods were quiet, but the gateway saw a request 30 s ago


@pytest.mark.parametrize(("mu", "signals", "ready", "expected"), [
    (None, met(10.0), 2, None),              # met at some load: not yet a capacity estimate
    (None, missed(10.0), 2, 5.0),            # failed at 5 req/s per replica: capacity at most that
    (4.0, met(10.0), 2, 4.3),                # served 5 within the SLO: move up towards it
    (4.0, missed(6.0), 2, 3.7),              # failed at 3: move down towards it
    (4.0, missed(10.0), 2, 4.0),             # failed above the estimate: nothing learnt
    (4.0, missed(3.0), 2, 4.0),              # failed at 1.5, under half the estimate: not the load
    (4.0, Signals(6.0, attainment=0.5), 2, 3.7),   # a miss with nothing queued still bounds capacity
    (4.0, Signals(10.0, attainment=None), 2, 4.0),
])
def test_capacity_is_learnt_from_load_vs_attainment(mu, signals, ready, expected):
    learnt = learn_capacity(mu, signals, ready, 0.95)
    assert learnt == pytest.approx(expected) if expected is not None else learnt is None


@pytest.mark.parametrize(("rate", "mu", "expected"), [(0.0, 4.0, 0), (3.2, 4.0, 1), (3.3, 4.0, 2), (10, None, 0)])
def test_capacity_term(rate, mu, expected):
    assert capacity_term(rate, mu, 0.8) == expected
