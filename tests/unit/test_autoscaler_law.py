"""The goodput scaling law, table-driven: what a user of the service would see it do."""

from dataclasses import replace

import pytest
from law_signals import KNOWN, POLICY, met, missed

from goodput_operator.autoscaling.arrival import forecast
from goodput_operator.autoscaling.law import DOWN, HOLD, SCALE_CAUSES, UP, decide
from goodput_operator.autoscaling.state import Memory, Observation, Policy, Signals

CASES = [
    # id, current, ready, signals, memory, desired, direction, cause
    ("steady load fits", 3, 3, met(9.0), KNOWN, 3, HOLD, "steady"),
    ("capacity term grows", 2, 2, met(12.0, attainment_long=0.9), KNOWN, 4, UP, "capacity"),
    ("growth bounded to doubling", 2, 2, met(40.0), KNOWN, 4, UP, "capacity"),
    ("clamped to max", 8, 8, met(80.0), KNOWN, 10, UP, "capacity"),
    ("guard adds half the ready replicas", 4, 4, missed(8.0), KNOWN, 6, UP, "slo_guard"),
    ("guard adds at least one", 1, 1, missed(2.0), KNOWN, 2, UP, "slo_guard"),
    ("guard waits for starting pods", 6, 4, missed(8.0), KNOWN, 6, HOLD, "slo_guard"),
    (
        "a surge on top of a queue is met at once",
        2,
        2,
        Signals(12.0, attainment=0.99, waiting=6),
        KNOWN,
        4,
        UP,
        "capacity",
    ),
    ("no guard without finished requests", 2, 2, Signals(5.0, attainment=None, waiting=3), KNOWN, 2, HOLD, "steady"),
    ("missing metrics hold", 5, 5, None, KNOWN, 5, HOLD, "metrics_missing"),
    ("below min is raised", 0, 0, None, KNOWN, 1, UP, "bounds"),
    ("above max is lowered", 12, 12, None, KNOWN, 10, DOWN, "bounds"),
    ("at max the guard holds", 10, 10, missed(50.0), KNOWN, 10, HOLD, "bounds"),
]


@pytest.mark.parametrize(
    ("current", "ready", "signals", "memory", "desired", "direction", "cause"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
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


@pytest.mark.parametrize(
    ("rate", "held", "desired", "cause"),
    [
        (2.0, 100, 4, "stabilizing"),  # inside the window
        (2.0, 300, 3, "scale_down"),  # one step, not straight to 1
        (9.0, 300, 4, "steady"),  # 3 replicas plan for 3 × 3.08 req/s; 9 is within 5 % of it
        (8.0, 300, 3, "scale_down"),  # 8 < 95 % of 9.23
    ],
)
def test_scale_down_waits_and_steps_one_at_a_time(rate, held, desired, cause):
    memory = Memory(capacity_per_replica=4.0, high_since=1000.0)
    decision = decide(POLICY, Observation(1000.0 + held, 4, 4, met(rate)), memory)
    assert (decision.desired, decision.cause) == (desired, cause), decision.reason


def test_after_the_window_steps_down_one_per_period_until_load_says_stop():
    memory = Memory(capacity_per_replica=4.0, high_since=0.0)
    first = decide(POLICY, Observation(300.0, 4, 4, met(5.0)), memory)
    assert first.desired == 3
    second = decide(POLICY, Observation(315.0, 3, 3, met(5.0)), first.memory)
    assert second.desired == 2  # 5 req/s on 2 replicas: under 95 % of their 2 × 2.87 planned
    third = decide(POLICY, Observation(330.0, 2, 2, met(5.0)), second.memory)
    assert (third.desired, third.cause) == (2, "steady")  # 1 replica plans for 2.4


def test_a_need_inside_the_window_restarts_it():
    memory = Memory(capacity_per_replica=4.0, high_since=0.0)
    busy = decide(POLICY, Observation(200.0, 4, 4, met(12.0)), memory)
    assert busy.desired == 4
    quiet = decide(POLICY, Observation(400.0, 4, 4, met(1.0)), busy.memory)
    assert (quiet.desired, quiet.cause) == (4, "stabilizing")


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


def test_a_significant_trend_scales_ahead_by_the_start_up_time():
    memory = Memory(capacity_per_replica=4.0, level=10.0, trend=0.05, seen_at=985.0)  # +3 req/s a minute
    rising = decide(POLICY, Observation(1000.0, 4, 4, met(10.75)), memory)
    assert (rising.desired, rising.cause) == (5, "forecast"), rising.reason
    assert "rising" in rising.reason
    flat = decide(POLICY, Observation(1000.0, 4, 4, met(10.15)), replace(memory, trend=0.01))
    assert (flat.desired, flat.cause) == (4, "steady"), flat.reason  # within the noise: no forecast


def test_a_steady_period_reports_the_rate_and_its_trend():
    """status.autoscaler.message between changes: the smoothed rate and its trend, and the rate planned for a
    start-up ahead once the trend counts, at one replica as at several."""
    memory = Memory(capacity_per_replica=10.0, level=2.0, trend=0.002, seen_at=985.0, level_age=600.0)
    one = decide(POLICY, Observation(1000.0, 1, 1, met(2.1)), memory)
    assert (one.desired, one.cause) == (1, "steady"), one.reason
    level = one.memory.level
    trend = one.memory.trend * 60
    assert one.reason == f"1 replica serves arrival {level:.2f} req/s, trend +{trend:.2f} req/s per minute"
    assert one.memory.trend > 0  # +0.12 req/s a minute, within a 1-minute window's noise at 2 req/s: no forecast
    rising = decide(
        POLICY,
        Observation(1000.0, 4, 4, met(10.5)),
        Memory(capacity_per_replica=4.0, level=10.0, trend=0.025, seen_at=985.0, level_age=600.0),
    )
    assert (rising.desired, rising.cause) == (4, "steady"), rising.reason
    ahead = forecast(rising.memory, POLICY, 15.0)
    assert ahead is not None and ahead > rising.memory.level
    assert rising.reason == (
        f"4 replicas fit arrival {rising.memory.level:.2f} req/s, trend "
        f"+{rising.memory.trend * 60:.2f} req/s per minute ({ahead:.2f} req/s expected in 105 s)"
    )


def test_the_exported_forecast_is_the_rate_the_law_sized_for():
    memory = Memory(capacity_per_replica=4.0, level=10.0, trend=0.05, seen_at=985.0)
    rising = decide(POLICY, Observation(1000.0, 4, 4, met(10.75)), memory)
    ahead = forecast(rising.memory, POLICY, 15.0)
    assert ahead is not None and ahead > rising.memory.level  # the dashboard's forecast leads the actual
    assert f"{ahead:.2f} req/s" in rising.reason  # the very rate the decision names
    assert forecast(Memory(), POLICY, 15.0) is None  # before any signal: no series, not zero
    steady = decide(POLICY, Observation(1000.0, 4, 4, met(10.15)), replace(memory, trend=0.01))
    assert forecast(steady.memory, POLICY, 15.0) == steady.memory.level  # a trend inside the noise is ignored


def test_the_rate_is_smoothed_but_a_change_beyond_the_noise_is_taken_at_once():
    memory = Memory(capacity_per_replica=4.0, level=4.0, seen_at=985.0)
    noise = decide(POLICY, Observation(1000.0, 2, 2, met(4.5)), memory)
    assert noise.memory.level == pytest.approx(4.0 + 15 / 180 * 0.5)
    surge = decide(POLICY, Observation(1000.0, 2, 2, met(12.0, attainment_long=0.9)), memory)
    assert surge.memory.level == 12.0
    assert (surge.desired, surge.cause) == (4, "capacity")


def test_one_idle_replica_goes_to_zero_though_the_smoothed_rate_still_remembers_traffic():
    """A few requests, then silence: the slowly smoothed rate is not zero yet, and no capacity was learnt,
    but idleness alone decides 1 → 0."""
    zero = Policy(min_replicas=0, max_replicas=3, idle_period=600)
    idle = Signals(0.0, attainment=None)
    memory = Memory(level=0.4, seen_at=90.0, idle_since=50.0, high_since=0.0)
    decision = decide(zero, Observation(100.0, 1, 1, idle, last_request_age=650.0), memory)
    assert (decision.desired, decision.cause) == (0, "idle"), decision.reason


def test_pending_batch_lines_keep_the_replicas_spec_batch_max_replicas_allows_and_no_more():
    batchy = Policy(min_replicas=0, max_replicas=4, scale_down_window=0, idle_period=60, batch_max_replicas=2)
    memory = Memory(capacity_per_replica=4.0)
    woken = decide(batchy, Observation(10.0, 0, 0, None, "no ready pods", held=0, batch_pending=500), memory)
    assert (woken.desired, woken.direction, woken.cause) == (2, UP, "batch")
    assert "500 batch lines pending" in woken.reason and "spec.batch.maxReplicas 2" in woken.reason
    idle = Signals(0.0, attainment=None)
    kept = decide(batchy, Observation(100.0, 2, 2, idle, last_request_age=None, batch_pending=120), woken.memory)
    assert (kept.desired, kept.direction, kept.cause) == (2, HOLD, "batch")  # idle online traffic takes none away
    busy = decide(batchy, Observation(110.0, 2, 2, met(14.0), batch_pending=100), kept.memory)
    assert (busy.desired, busy.direction) == (4, UP) and busy.cause != "batch"  # online load still scales past it
    # the batch done: with no online request ever seen (no capacity learnt) idle replicas go one by one,
    # after the scale-down window, and idleness takes the last
    unlearnt = replace(kept.memory, capacity_per_replica=None)
    drained = decide(batchy, Observation(200.0, 2, 2, idle, batch_pending=0), unlearnt)
    assert (drained.desired, drained.direction, drained.cause) == (1, DOWN, "scale_down")
    assert "no requests" in drained.reason
    last = decide(batchy, Observation(300.0, 1, 1, idle, last_request_age=500.0, batch_pending=0), drained.memory)
    assert (last.desired, last.cause) == (0, "idle")
    slow = replace(batchy, scale_down_window=300)
    assert decide(slow, Observation(200.0, 2, 2, idle, batch_pending=0), unlearnt).desired == 2  # stabilising
    # without spec.batch.maxReplicas, batch work adds nothing: a service at zero stays there
    plain = replace(batchy, batch_max_replicas=0)
    assert decide(plain, Observation(10.0, 0, 0, None, "no ready pods", held=0, batch_pending=500), memory).desired == 0


def test_batch_replicas_stay_within_max_replicas():
    capped = Policy(min_replicas=1, max_replicas=3, batch_max_replicas=3)
    decision = decide(capped, Observation(10.0, 1, 1, met(1.0), batch_pending=9), KNOWN)
    assert (decision.desired, decision.cause) == (3, "batch")
    assert decide(capped, Observation(10.0, 3, 3, met(1.0), batch_pending=9), KNOWN).desired == 3
