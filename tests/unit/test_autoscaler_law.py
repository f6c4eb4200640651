"""The goodput scaling law, table-driven: what a user of the service would see it do."""

import itertools
from dataclasses import replace

import pytest

from goodput_operator.autoscaling.arrival import forecast
from goodput_operator.autoscaling.capacity_learning import learn_capacity
from goodput_operator.autoscaling.law import DOWN, HOLD, SCALE_CAUSES, UP, decide
from goodput_operator.autoscaling.staffing import capacity_term, planned_load
from goodput_operator.autoscaling.state import Memory, Observation, Policy, Signals, start_memory

POLICY = Policy(
    min_replicas=1, max_replicas=10, attainment_target=0.95, ttft_target=0.5, tpot_target=0.05, scale_down_window=300
)
KNOWN = Memory(capacity_per_replica=4.0)  # requests per second per replica


def met(rate: float, **kw) -> Signals:
    return Signals(arrival_rate=rate, attainment=0.99, **kw)


def missed(rate: float, waiting: int = 12, **kw) -> Signals:
    return Signals(arrival_rate=rate, attainment=0.80, waiting=waiting, ttft_p90=0.71, **kw)


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
