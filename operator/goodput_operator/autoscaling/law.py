"""The goodput scaling law: observed signals and the last state in, a replica count and its reason out.

Pure: no clock, no API, no I/O. The loop (loop.py) and the simulator
(bench/autoscale_sim.py) call the same `decide`, with the Policy, Observation and Memory of state.py;
the arrival rate it plans for is arrival.py's. See docs/autoscaling.md for the model.

    desired  = clamp(max(capacity term, forecast term, SLO guard), min, max)
    capacity = fewest N with N × planned(N) ≥ smoothed arrival rate (+ queue / window while requests queue)
    planned(N) = μ × (1 − (1 − target utilisation) × √(4 / N))   (square-root staffing headroom)
    forecast = the same at level + trend × (start-up + period + window/2), when the trend is significant
    SLO guard = current + max(1, ⌈ready / 2⌉) while attainment misses its target and requests queue

μ, the capacity per replica, is learnt from live attainment (no hint needed): a sequential test
on the requests served near the planned load moves it up or down a step.
Up: at once, at most doubling per period, and only on top of pods still starting.
Down: only once the need has stayed below the current count for the stabilisation
window, then one replica per period, only while attainment holds and N−1 replicas would
stay under their planned load. No signals: hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from goodput_operator.autoscaling.arrival import BURSTY_SLOWDOWN, beyond_noise, noise, rate_ahead, smooth
from goodput_operator.autoscaling.state import Memory, Observation, Policy, Signals

UP, DOWN, HOLD = "up", "down", "hold"
# every (direction, cause) a replica change can carry; the operator exports each at zero from the start,
# so the first change of a kind is an increase Prometheus can see, not a series that appears at 1
SCALE_CAUSES = {
    UP: ("slo_guard", "capacity", "forecast", "bounds", "wake", "batch"),
    DOWN: ("scale_down", "idle", "bounds", "batch"),
}
MARGIN = 0.01  # the capacity estimate aims attainment this far above the target
LEARNING_RATE = 0.3  # a load met above the plan moves the plan this share of the way towards it
EVIDENCE_Z = 1.5  # the estimate moves when attainment differs from the aim by this many standard deviations
EXPLORE_Z = 1.0  # before any miss has been seen, weaker evidence raises the estimate, by the largest step
STEP_GAIN = 8.0  # a verdict moves the estimate by exp(STEP_GAIN × (attainment − aim)) ...
STEP_LIMITS = (0.94, 0.98, 1.02, 1.2)  # ... down between the first two factors, up between the last two: small
# steps, since a verdict on minutes of requests is still often wrong and each wrong one costs until undone
PLANNED_BAND = (0.7, 1.1)  # a period is evidence when the load ran at this share of the planned load
REFERENCE_REPLICAS = 4  # the replica count at which the headroom is exactly 1 − target utilisation
TOLERANCE = 0.05  # up when the load exceeds the plan by this share; down when N−1 stay this far under it


@dataclass(frozen=True)
class Decision:
    desired: int
    direction: str  # up | down | hold
    cause: str  # slo_guard | capacity | forecast | scale_down | idle | bounds | wake | stabilizing | metrics_missing
    # | steady
    reason: str
    memory: Memory


def learn_capacity(memory: Memory, s: Signals, ready: int, policy: Policy, dt: float) -> Memory:
    """Capacity per replica, learnt from live SLO attainment: no hint needed.

    Unset, the first load served within the SLO with nothing queued is taken as the planned
    load at that count (the replicas ran at it within the SLO, so it is safe).
    From then on the estimate is a hypothesis under test: each period without a queue in which the
    replicas ran near the planned load (PLANNED_BAND) adds its finished requests, good and all,
    to the evidence. Once attainment over that evidence lies EVIDENCE_Z binomial standard
    deviations above target + MARGIN the estimate rises a step, once as far below it falls a
    step (exp(STEP_GAIN × gap), within STEP_LIMITS) and the estimate there becomes a ceiling
    it probes no higher than (relaxing 2 % each time it is met at its edge); either way the
    evidence starts afresh. Evidence pools minutes of requests, so noise a minute's window
    would show does not move the estimate. Until a first miss, weaker evidence (EXPLORE_Z)
    raises it by the largest step. Independently, a window met above the plan with nothing
    queued (and the long window meeting the aim too) is a lower bound: the plan moves
    LEARNING_RATE of the way towards it.
    """
    if ready <= 0 or s.attainment is None or s.arrival_rate <= 0:
        return memory
    mu, util, peak = memory.capacity_per_replica, policy.target_utilization, memory.peakedness
    bursty = peak > 1.0 and memory.level is not None
    # on over-dispersed arrivals a minute's rate swings with the bursts: the load is the smoothed rate's
    rate = memory.level if bursty and memory.level is not None else s.arrival_rate
    load = rate / ready
    if mu is None:
        # only off a rate counted over a whole window: the first periods' counts are few, and one burst in
        # them would start the estimate at a multiple of the truth
        spans_window = memory.level is not None and memory.level_age >= policy.window_seconds
        if spans_window and s.attainment >= policy.attainment_target and s.waiting == 0:
            return replace(
                memory, capacity_per_replica=load / planned_load(1.0, ready, util, peak), good=0.0, total=0.0
            )
        return memory
    share = planned_load(1.0, ready, util, peak)  # planned load over capacity at this count
    planned = mu * share
    goal = min(policy.attainment_target + MARGIN, 0.999)
    long_ok = s.attainment_long is None or s.attainment_long >= goal
    if load > PLANNED_BAND[1] * planned and s.attainment >= goal and long_ok and s.waiting == 0:
        # served within the SLO above the plan, nothing queued: a lower bound, move towards it
        bound = load if memory.ceiling is None else min(load, memory.ceiling * share)
        if bound > planned:
            return replace(memory, capacity_per_replica=(planned + LEARNING_RATE * (bound - planned)) / share)
    # evidence: the count the plan keeps (one fewer would not do), run at no more than the plan allows
    fewer = ready - 1
    kept = fewer == 0 or rate > fewer * mu * planned_load(1.0, fewer, util, peak) * (1 - TOLERANCE)
    # a queue at the count the plan keeps is a shortage on Poisson arrivals, not evidence; on bursty ones it
    # is what the headroom is there to absorb, and misses with it are the plan's
    if (s.waiting and not bursty) or not kept or not PLANNED_BAND[0] * planned <= load <= PLANNED_BAND[1] * planned:
        return memory
    finished = s.finished if s.finished is not None else (s.finished_long or 0.0) / 5
    weight = finished * min(1.0, dt / policy.window_seconds)
    good, total = memory.good + weight * s.attainment, memory.total + weight
    # bursts miss together: over-dispersed arrivals make the misses over-dispersed too, by their peakedness
    z = (good - goal * total) / math.sqrt(max(total, 1e-9) * goal * (1 - goal) * peak)
    step = math.exp(STEP_GAIN * (good / max(total, 1e-9) - goal))
    exploring = memory.ceiling is None  # no miss seen yet: probe upwards boldly until the first one
    if s.waiting == 0 and (z >= EVIDENCE_Z or (exploring and z >= EXPLORE_Z)):
        raised = mu * (STEP_LIMITS[3] if exploring else min(STEP_LIMITS[3], max(STEP_LIMITS[2], step)))
        ceiling: float | None = memory.ceiling
        if memory.ceiling is not None and raised > memory.ceiling:
            raised = max(mu, memory.ceiling * 0.97)
            ceiling = memory.ceiling * 1.02  # a ceiling met at its edge relaxes slowly
        return replace(memory, capacity_per_replica=raised, good=0.0, total=0.0, ceiling=ceiling)
    if z <= -EVIDENCE_Z:
        ceiling = mu if memory.ceiling is None else min(memory.ceiling, mu)
        lowered = mu * min(STEP_LIMITS[1], max(STEP_LIMITS[0], step))
        return replace(memory, capacity_per_replica=lowered, good=0.0, total=0.0, ceiling=ceiling)
    return replace(memory, good=good, total=total)


def planned_load(mu: float, replicas: int, utilization: float, peakedness: float = 1.0) -> float:
    """The load to plan for per replica at `replicas` replicas: capacity less a headroom for bursts. The
    headroom is 1 − utilisation at REFERENCE_REPLICAS and shrinks as 1/√replicas beyond (square-root
    staffing: pooled replicas behind least-loaded routing smooth each other's bursts). On arrivals more
    dispersed than Poisson it grows with the square root of their peakedness z (the variance of their
    counts over the mean): N replicas carry a = N × planned, and N − a = β √(z N), the peakedness-adjusted
    square-root rule; z = 1 is Poisson, and the law as it was."""
    headroom = (1 - utilization) * math.sqrt(max(1.0, peakedness) * REFERENCE_REPLICAS / max(1, replicas))
    return mu * max(0.05, 1 - headroom)


def capacity_term(arrival_rate: float, mu: float | None, utilization: float, peakedness: float = 1.0) -> int:
    """The fewest replicas whose planned load covers the arrival rate."""
    if mu is None or mu <= 0 or arrival_rate <= 0:
        return 0
    n = max(1, math.ceil(arrival_rate / mu - 1e-9))
    while n * planned_load(mu, n, utilization, peakedness) < arrival_rate - 1e-9 and n < 10_000:
        n += 1
    return n


def _floor(policy: Policy) -> int:
    """minReplicas 0 only with an idle period; otherwise at least one replica serves."""
    return policy.min_replicas if policy.min_replicas > 0 or policy.idle_period else 1


def _clamp(n: int, policy: Policy) -> int:
    return max(_floor(policy), min(policy.max_replicas, n))


def slo_miss_text(policy: Policy, s: Signals) -> str:
    parts = [f"attainment {s.attainment:.2f} < {policy.attainment_target:.2f} target"]
    if s.ttft_p90 is not None and policy.ttft_target is not None and s.ttft_p90 > policy.ttft_target:
        parts.append(f"p90 TTFT {s.ttft_p90:.2f} s > {policy.ttft_target:.2f} s target")
    if s.tpot_p90 is not None and policy.tpot_target is not None and s.tpot_p90 > policy.tpot_target:
        parts.append(f"p90 TPOT {s.tpot_p90 * 1000:.0f} ms > {policy.tpot_target * 1000:.0f} ms target")
    parts.append(f"{s.waiting} requests queued")
    return ", ".join(parts)


def decide(policy: Policy, obs: Observation, memory: Memory) -> Decision:
    """The replicas for the next period: the goodput law's, never below what pending batch lines may ask for."""
    current = obs.current
    floor = min(policy.batch_max_replicas, policy.max_replicas) if obs.batch_pending else 0
    if floor > current and _clamp(current, policy) == current:
        return Decision(
            floor,
            UP,
            "batch",
            f"{obs.batch_pending} batch lines pending: spec.batch.maxReplicas "
            f"{policy.batch_max_replicas} lets batch work have {floor} replicas",
            replace(memory, high_since=obs.now, changed_at=obs.now, idle_since=None),
        )
    decision = _decide(policy, obs, memory)
    if decision.desired < floor:  # the law would take away replicas the batch is still using
        return Decision(
            floor,
            HOLD if floor == current else DOWN,
            "batch",
            f"{obs.batch_pending} batch lines pending keep {floor} replicas "
            f"(spec.batch.maxReplicas); online: {decision.reason}",
            replace(decision.memory, high_since=obs.now, idle_since=None),
        )
    return decision


def _decide(policy: Policy, obs: Observation, memory: Memory) -> Decision:
    current = obs.current
    bounded = _clamp(current, policy)
    if bounded != current:
        direction = UP if bounded > current else DOWN
        return Decision(
            bounded,
            direction,
            "bounds",
            f"{current} replicas is outside [{_floor(policy)}, {policy.max_replicas}]",
            replace(memory, high_since=obs.now),
        )
    if current == 0:  # no pod, so no pod metrics: the gateway's held requests are the only signal
        if obs.held:
            return Decision(
                min(1, policy.max_replicas),
                UP,
                "wake",
                f"{obs.held} requests held at the gateway",
                replace(memory, high_since=obs.now, changed_at=obs.now, idle_since=None),
            )
        return Decision(
            0,
            HOLD,
            "steady",
            "at zero: no requests held at the gateway"
            if obs.held is not None
            else "at zero; the gateway's held requests are unknown",
            memory,
        )
    s = obs.signals
    if s is None:
        return Decision(
            current, HOLD, "metrics_missing", f"holding {current} replicas: {obs.missing or 'metrics missing'}", memory
        )

    dt = obs.now - memory.seen_at if memory.seen_at is not None else 0.0
    starting = max(0, current - obs.ready)
    memory = replace(memory, peakedness=max(1.0, s.peakedness))
    if starting:
        memory = replace(memory, changed_at=obs.now)
    memory = learn_capacity(memory, s, obs.ready, policy, dt)
    horizon = policy.startup_seconds + max(dt, 0.0) + policy.window_seconds / 2
    memory = smooth(memory, s, dt, policy.window_seconds)
    mu = memory.capacity_per_replica
    idle = s.arrival_rate == 0 and s.waiting == 0 and s.running == 0
    memory = replace(
        memory,
        seen_at=obs.now,
        idle_since=(memory.idle_since if memory.idle_since is not None else obs.now) if idle else None,
    )
    util, z = policy.target_utilization, memory.peakedness
    planned = planned_load(mu, current, util, z) if mu else None
    level = memory.level or 0.0
    ahead = rate_ahead(memory, horizon, policy.window_seconds)
    # while requests queue, the newest period's rate and the queue itself are demand too
    surge = level
    if s.waiting:
        surge = max(
            level,
            s.arrival_rate if s.arrival_rate > level + noise(level, policy.window_seconds, z) else 0.0,
            beyond_noise(s.arrival_rate_now or 0.0, level, max(dt, 1.0), z),
        )
    if s.waiting and planned:
        surge += s.waiting / policy.window_seconds  # drained within one window
    need_now = _count(surge, mu, current, util, z)
    need = max(need_now, _count(ahead, mu, current, util, z))
    missing_slo = s.attainment is not None and s.attainment < policy.attainment_target and s.waiting > 0
    guard = 0
    if missing_slo:
        guard = current if starting else current + max(1, math.ceil(obs.ready / 2))
    wanted = max(need, guard, _floor(policy))

    if wanted > current:
        desired = min(wanted, max(current * 2, current + 1), policy.max_replicas)
        if desired <= current:
            return Decision(
                current,
                HOLD,
                "bounds",
                f"at maxReplicas {policy.max_replicas}; "
                + (slo_miss_text(policy, s) if missing_slo else f"arrival {s.arrival_rate:.2f} req/s"),
                replace(memory, high_since=obs.now),
            )
        if guard >= need:
            cause, reason = "slo_guard", slo_miss_text(policy, s)
        elif need > need_now:
            cause = "forecast"
            reason = (
                f"arrival {level:.2f} req/s rising {memory.trend * 60:.2f} req/s per minute: "
                f"{ahead:.2f} req/s in {horizon:.0f} s needs {need} replicas at "
                f"{planned_load(mu or 0.0, need, util, z):.2f} req/s each{_dispersion_text(s, z)}"
            )
        else:
            cause = "capacity"
            queued = f" and {s.waiting} queued" if s.waiting else ""
            reason = (
                f"arrival {surge:.2f} req/s{queued} needs {need} replicas at "
                f"{planned_load(mu or 0.0, need, util, z):.2f} req/s each (of {mu:.2f} learnt capacity)"
                f"{_dispersion_text(s, z)}"
            )
        return Decision(desired, UP, cause, reason, replace(memory, high_since=obs.now, changed_at=obs.now))

    if missing_slo:  # pods are starting: they are the added capacity
        return Decision(
            current,
            HOLD,
            "slo_guard",
            f"{starting} replicas starting; " + slo_miss_text(policy, s),
            replace(memory, high_since=obs.now),
        )
    if starting and z > 1 and mu:
        # bursty arrivals: a burst that asked for pods is over before they serve; those still starting that
        # the need no longer wants go at once (they serve nothing yet, so no window protects anything)
        keep = max(need, obs.ready, _floor(policy))
        if keep < current:
            return Decision(
                keep,
                DOWN,
                "scale_down",
                f"{current - keep} of {starting} replicas still starting no longer needed: "
                f"{_rate_text(memory, ahead, horizon)}{_dispersion_text(s, z)}",
                replace(memory, changed_at=obs.now),
            )
    fewer = current - 1
    rate = _rate_text(memory, ahead, horizon)
    if current == 1:  # one replica: only idleness (its own, or the gateway's) takes it to zero
        return _scale_down(policy, obs, s, memory, 0.0, rate)
    if mu is None and idle:  # nothing to learn a capacity from, and nothing to serve (a batch just done)
        return _scale_down(policy, obs, s, memory, 0.0)
    if mu is None or max(level, ahead) > fewer * planned_load(mu, fewer, util, z) * (1 - TOLERANCE):
        return Decision(
            current,
            HOLD,
            "steady",
            f"{current} replicas fit {rate}{_dispersion_text(s, z)}",
            replace(memory, high_since=obs.now),
        )
    return _scale_down(policy, obs, s, memory, planned_load(mu, fewer, util, z))


def _count(rate: float, mu: float | None, current: int, utilization: float, peakedness: float = 1.0) -> int:
    """Replicas for `rate` at the planned load each; the current count stands within TOLERANCE of it."""
    if mu is None or mu <= 0 or rate <= 0:
        return 0
    planned = planned_load(mu, current, utilization, peakedness)
    if current * planned < rate <= current * planned * (1 + TOLERANCE):
        return current
    return capacity_term(rate, mu, utilization, peakedness)


def _dispersion_text(s: Signals, peakedness: float) -> str:
    """The arrivals' burstiness, where the law's headroom grew for it: the measured index of dispersion,
    and the factor on the headroom (√ of the peakedness it used)."""
    if peakedness <= 1.0 or s.dispersion is None:
        return ""
    return (
        f"; arrivals over-dispersed: index of dispersion {s.dispersion:.1f} per period, "
        f"headroom ×{math.sqrt(peakedness):.2f}"
    )


def _rate_text(memory: Memory, ahead: float, horizon: float) -> str:
    """The smoothed rate and its trend, as a steady decision reports them (and the forecast, where it counts)."""
    level = memory.level or 0.0
    text = f"arrival {level:.2f} req/s, trend {memory.trend * 60:+.2f} req/s per minute"
    return text + (f" ({ahead:.2f} req/s expected in {horizon:.0f} s)" if ahead > level else "")


def _scale_down(
    policy: Policy, obs: Observation, s: Signals, memory: Memory, planned: float, rate: str = "the load"
) -> Decision:
    current, now = obs.current, obs.now
    since = memory.high_since if memory.high_since is not None else now
    held = now - since
    if memory.high_since is None:
        memory = replace(memory, high_since=now)
    if current == 1:
        idle_for = now - memory.idle_since if memory.idle_since is not None else 0.0
        if obs.last_request_age is not None and memory.idle_since is not None:
            idle_for = obs.last_request_age  # the gateway sees every request, and remembers across restarts
        if policy.idle_period and idle_for >= policy.idle_period:
            return Decision(
                0,
                DOWN,
                "idle",
                f"no requests for {idle_for:.0f} s (idle period {policy.idle_period:.0f} s)",
                replace(memory, high_since=now),
            )
        return Decision(current, HOLD, "steady", f"1 replica serves {rate}", memory)
    # on bursty arrivals the level settles z times slower (arrival.py), and a step down waits as much longer
    window = policy.scale_down_window * min(max(1.0, memory.peakedness), BURSTY_SLOWDOWN)
    if held < window:
        return Decision(
            current,
            HOLD,
            "stabilizing",
            f"{current - 1} replicas would do; stabilising {held:.0f} of {window:.0f} s",
            memory,
        )
    if s.attainment is not None and s.attainment < policy.attainment_target:
        return Decision(current, HOLD, "steady", f"attainment {s.attainment:.2f} below target", memory)
    if s.waiting > 0:
        return Decision(current, HOLD, "steady", f"{s.waiting} requests queued", memory)
    level = memory.level or 0.0
    fewer = f"{current - 1} replica{'s' if current - 1 != 1 else ''}"
    if planned <= 0:  # no capacity learnt, and no request running or arriving
        reason = f"no requests: {fewer} would do; {current} not needed for {held:.0f} s"
    else:
        load = level / ((current - 1) * planned)  # planned: the load planned at current − 1
        reason = (
            f"arrival {level:.2f} req/s: {fewer} would run at {load:.0%} of the planned "
            f"{planned:.2f} req/s each; {current} not needed for {held:.0f} s"
            f"{_dispersion_text(s, memory.peakedness)}"
        )
    # the window has passed: further steps may follow period by period while N−1 stays under the plan
    return Decision(current - 1, DOWN, "scale_down", reason, replace(memory, changed_at=now))
