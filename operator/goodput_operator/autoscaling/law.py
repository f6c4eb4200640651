"""The goodput scaling law: observed signals and the last state in, a replica count and its reason out.

Pure: no clock, no API, no I/O. The loop (loop.py) and the simulator
(bench/autoscale_sim.py) call the same `decide`, with the Policy, Observation and Memory of state.py;
the arrival rate it plans for is arrival.py's, the replicas for a rate staffing.py's, μ
capacity_learning.py's, the words of its reasons reasons.py's. See docs/autoscaling.md for the model.

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
from goodput_operator.autoscaling.capacity_learning import learn_capacity
from goodput_operator.autoscaling.reasons import dispersion_text, rate_text, slo_miss_text
from goodput_operator.autoscaling.staffing import TOLERANCE, planned_load, replicas_for
from goodput_operator.autoscaling.state import Memory, Observation, Policy, Signals

UP, DOWN, HOLD = "up", "down", "hold"
# every (direction, cause) a replica change can carry; the operator exports each at zero from the start,
# so the first change of a kind is an increase Prometheus can see, not a series that appears at 1
SCALE_CAUSES = {
    UP: ("slo_guard", "capacity", "forecast", "bounds", "wake", "batch"),
    DOWN: ("scale_down", "idle", "bounds", "batch"),
}


@dataclass(frozen=True)
class Decision:
    desired: int
    direction: str  # up | down | hold
    cause: str  # slo_guard | capacity | forecast | scale_down | idle | bounds | wake | stabilizing | metrics_missing
    # | steady
    reason: str
    memory: Memory


def _floor(policy: Policy) -> int:
    """minReplicas 0 only with an idle period; otherwise at least one replica serves."""
    return policy.min_replicas if policy.min_replicas > 0 or policy.idle_period else 1


def _clamp(n: int, policy: Policy) -> int:
    return max(_floor(policy), min(policy.max_replicas, n))


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
    memory = replace(memory, peakedness=max(1.0, s.peakedness) if policy.dispersion else 1.0)
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
    need_now = replicas_for(surge, mu, current, util, z)
    need = max(need_now, replicas_for(ahead, mu, current, util, z))
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
                + (
                    slo_miss_text(policy, s)
                    if missing_slo
                    else f"arrival {s.arrival_rate:.2f} req/s needs {wanted}{dispersion_text(s, z)}"
                ),
                replace(memory, high_since=obs.now),
            )
        if guard >= need:
            cause, reason = "slo_guard", slo_miss_text(policy, s)
        elif need > need_now:
            cause = "forecast"
            reason = (
                f"arrival {level:.2f} req/s rising {memory.trend * 60:.2f} req/s per minute: "
                f"{ahead:.2f} req/s in {horizon:.0f} s needs {need} replicas at "
                f"{planned_load(mu or 0.0, need, util, z):.2f} req/s each{dispersion_text(s, z)}"
            )
        else:
            cause = "capacity"
            queued = f" and {s.waiting} queued" if s.waiting else ""
            reason = (
                f"arrival {surge:.2f} req/s{queued} needs {need} replicas at "
                f"{planned_load(mu or 0.0, need, util, z):.2f} req/s each (of {mu:.2f} learnt capacity)"
                f"{dispersion_text(s, z)}"
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
                f"{rate_text(memory, ahead, horizon)}{dispersion_text(s, z)}",
                replace(memory, changed_at=obs.now),
            )
    fewer = current - 1
    rate = rate_text(memory, ahead, horizon)
    if current == 1:  # one replica: only idleness (its own, or the gateway's) takes it to zero
        return _scale_down(policy, obs, s, memory, 0.0, rate)
    if mu is None and idle:  # nothing to learn a capacity from, and nothing to serve (a batch just done)
        return _scale_down(policy, obs, s, memory, 0.0)
    if mu is None or max(level, ahead) > fewer * planned_load(mu, fewer, util, z) * (1 - TOLERANCE):
        return Decision(
            current,
            HOLD,
            "steady",
            f"{current} replicas fit {rate}{dispersion_text(s, z)}",
            replace(memory, high_since=obs.now),
        )
    return _scale_down(policy, obs, s, memory, planned_load(mu, fewer, util, z))


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
            f"{dispersion_text(s, memory.peakedness)}"
        )
    # the window has passed: further steps may follow period by period while N−1 stays under the plan
    return Decision(current - 1, DOWN, "scale_down", reason, replace(memory, changed_at=now))
