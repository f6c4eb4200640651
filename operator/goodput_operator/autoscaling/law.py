"""The goodput scaling law: observed signals and the last state in, a replica count and its reason out.

Pure: no clock, no API, no I/O. The loop (autoscaler.py) and the simulator
(bench/autoscale_sim.py) call the same `decide`.

    desired = clamp(max(capacity term, SLO guard), min, max)
    capacity term = ceil(arrival rate / (capacity per replica × target utilisation))
    SLO guard     = current + max(1, ⌈ready / 2⌉) while attainment misses its target and requests queue

Up: at once, at most doubling per period, and only on top of pods still starting.
Down: only once the need has stayed below the current count for the stabilisation
window, then one replica per period, only while attainment holds and N−1 replicas would
stay under the safe load. No signals: hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

UP, DOWN, HOLD = "up", "down", "hold"
# every (direction, cause) a replica change can carry; the operator exports each at zero from the start,
# so the first change of a kind is an increase Prometheus can see, not a series that appears at 1
SCALE_CAUSES = {UP: ("slo_guard", "capacity", "bounds", "wake"), DOWN: ("scale_down", "idle", "bounds")}
LEARNING_RATE = 0.3
LOAD_RELATED = 0.5  # misses below this share of the estimated capacity teach nothing about it


@dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    attainment_target: float = 0.95
    ttft_target: float | None = None  # seconds; for the reason text
    tpot_target: float | None = None
    target_utilization: float = 0.8
    safe_load: float = 0.7  # N−1 replicas must stay below this share of their capacity
    scale_down_window: float = 300.0  # seconds
    idle_period: float | None = None  # seconds without requests before 1 → 0; needed for minReplicas 0
    settle_seconds: float = 300.0  # after a change, misses are the shortage's, not capacity's, this long


@dataclass(frozen=True)
class Signals:
    """What the ready pods' metrics say, summed or averaged over them."""

    arrival_rate: float  # requests per second
    attainment: float | None  # short window (1 min); None when no request finished in it
    attainment_long: float | None = None  # 5 min, for status and dashboards
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    ttft_p90: float | None = None
    tpot_p90: float | None = None
    finished_long: float | None = None  # requests finished in the long window, to judge a miss's weight
    arrival_rate_now: float | None = None  # over the last period only: a surge shows here first


@dataclass(frozen=True)
class Observation:
    now: float  # seconds, any monotonic origin
    current: int  # replicas the scale subresource holds now
    ready: int  # replicas serving (the rest are starting: coming capacity)
    signals: Signals | None  # None: metrics missing or failed, never read as zero
    missing: str = ""  # why signals are None
    held: int | None = None  # requests the gateway holds for the service (None: no gateway read)
    last_request_age: float | None = None  # seconds since the gateway last saw a request for it (None: never)


@dataclass(frozen=True)
class Memory:
    """What the law carries from one period to the next."""

    capacity_per_replica: float | None = None  # requests per second one replica serves within the SLO
    high_since: float | None = None  # when the need last reached the current count
    idle_since: float | None = None
    changed_at: float | None = None  # when the replica count last changed or pods were last starting


@dataclass(frozen=True)
class Decision:
    desired: int
    direction: str  # up | down | hold
    cause: str  # slo_guard | capacity | scale_down | idle | bounds | wake | stabilizing | metrics_missing | steady
    reason: str
    memory: Memory


def learn_capacity(mu: float | None, signals: Signals, ready: int, target: float) -> float | None:
    """Capacity per replica from load vs attainment.

    A load served within the SLO with nothing queued is a lower bound on capacity; a load
    at which attainment fails is an upper bound (queued or not: large batches slow every
    token before anything queues) — unless it is under half the estimate, where a miss
    says more about the requests than about the load. Unset, capacity is first learnt at
    the load where attainment first failed (an underestimate, so safe). A miss counts when
    the long window shows it too, beyond chance: the short one holds a few dozen requests.
    """
    if ready <= 0 or signals.attainment is None or signals.arrival_rate <= 0:
        return mu
    load = signals.arrival_rate / ready
    met = signals.attainment >= target and signals.waiting == 0
    missed = signals.attainment < target and _lasting_miss(signals, target) and (
        mu is None or load >= mu * LOAD_RELATED)
    if met and mu is not None and load > mu:
        return mu + LEARNING_RATE * (load - mu)
    if missed and (mu is None or load < mu):
        return load if mu is None else mu + LEARNING_RATE * (load - mu)
    return mu


def _lasting_miss(signals: Signals, target: float) -> bool:
    """The long window misses too, by more than chance would (two binomial standard deviations)."""
    long, n = signals.attainment_long, signals.finished_long
    if long is None:
        return True
    if not n:
        return long < target
    return (1 - long) * n > (1 - target) * n + 2 * math.sqrt(n * target * (1 - target))


def capacity_term(arrival_rate: float, mu: float | None, utilization: float) -> int:
    if mu is None or mu <= 0:
        return 0
    return math.ceil(arrival_rate / (mu * utilization) - 1e-9)


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
    current = obs.current
    bounded = _clamp(current, policy)
    if bounded != current:
        direction = UP if bounded > current else DOWN
        return Decision(bounded, direction, "bounds",
                        f"{current} replicas is outside [{_floor(policy)}, {policy.max_replicas}]",
                        replace(memory, high_since=obs.now))
    if current == 0:  # no pod, so no pod metrics: the gateway's held requests are the only signal
        if obs.held:
            return Decision(min(1, policy.max_replicas), UP, "wake", f"{obs.held} requests held at the gateway",
                            replace(memory, high_since=obs.now, changed_at=obs.now, idle_since=None))
        return Decision(0, HOLD, "steady", "at zero: no requests held at the gateway"
                        if obs.held is not None else "at zero; the gateway's held requests are unknown", memory)
    s = obs.signals
    if s is None:
        return Decision(current, HOLD, "metrics_missing",
                        f"holding {current} replicas: {obs.missing or 'metrics missing'}", memory)

    starting = max(0, current - obs.ready)
    if starting:
        memory = replace(memory, changed_at=obs.now)
    settled = memory.changed_at is None or obs.now - memory.changed_at >= policy.settle_seconds
    mu = memory.capacity_per_replica
    if settled or (s.attainment is not None and s.attainment >= policy.attainment_target):
        mu = learn_capacity(mu, s, obs.ready, policy.attainment_target)
    idle = s.arrival_rate == 0 and s.waiting == 0 and s.running == 0
    memory = replace(memory, capacity_per_replica=mu,
                     idle_since=(memory.idle_since if memory.idle_since is not None else obs.now) if idle else None)
    # while requests queue, up on the last period's rate too, so a surge is met a window early
    surge = max(s.arrival_rate, s.arrival_rate_now or 0.0) if s.waiting else s.arrival_rate
    need = capacity_term(surge, mu, policy.target_utilization)
    missing_slo = s.attainment is not None and s.attainment < policy.attainment_target and s.waiting > 0
    guard = 0
    if missing_slo:
        guard = current if starting else current + max(1, math.ceil(obs.ready / 2))
    wanted = max(need, guard, _floor(policy))

    if wanted > current:
        desired = min(wanted, max(current * 2, current + 1), policy.max_replicas)
        if desired <= current:
            return Decision(current, HOLD, "bounds", f"at maxReplicas {policy.max_replicas}; " + (
                slo_miss_text(policy, s) if missing_slo else f"arrival {s.arrival_rate:.2f} req/s"),
                replace(memory, high_since=obs.now))
        if guard >= need:
            cause, reason = "slo_guard", slo_miss_text(policy, s)
        else:
            cause = "capacity"
            reason = (f"arrival {surge:.2f} req/s needs {need} replicas at "
                      f"{mu:.2f} req/s each and {policy.target_utilization:.0%} target load")
        return Decision(desired, UP, cause, reason, replace(memory, high_since=obs.now, changed_at=obs.now))

    if missing_slo:  # pods are starting: they are the added capacity
        return Decision(current, HOLD, "slo_guard",
                        f"{starting} replicas starting; " + slo_miss_text(policy, s),
                        replace(memory, high_since=obs.now))
    if wanted == current or capacity_term(s.arrival_rate, mu, policy.target_utilization) >= current:
        return Decision(current, HOLD, "steady", f"{current} replicas fit "
                        f"arrival {s.arrival_rate:.2f} req/s", replace(memory, high_since=obs.now))
    return _scale_down(policy, obs, s, memory, mu)


def _scale_down(policy: Policy, obs: Observation, s: Signals, memory: Memory, mu: float | None) -> Decision:
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
            return Decision(0, DOWN, "idle", f"no requests for {idle_for:.0f} s "
                            f"(idle period {policy.idle_period:.0f} s)", replace(memory, high_since=now))
        return Decision(current, HOLD, "steady", "1 replica serves the load", memory)
    if held < policy.scale_down_window:
        return Decision(current, HOLD, "stabilizing", f"{current - 1} replicas would do; stabilising "
                        f"{held:.0f} of {policy.scale_down_window:.0f} s", memory)
    if s.attainment is not None and s.attainment < policy.attainment_target:
        return Decision(current, HOLD, "steady", f"attainment {s.attainment:.2f} below target", memory)
    if s.waiting > 0:
        return Decision(current, HOLD, "steady", f"{s.waiting} requests queued", memory)
    if mu is None and s.arrival_rate > 0:
        return Decision(current, HOLD, "steady", "capacity per replica not learnt yet", memory)
    load = s.arrival_rate / ((current - 1) * mu) if mu else 0.0
    if load >= policy.safe_load:
        return Decision(current, HOLD, "steady", f"{current - 1} replicas would run at {load:.0%} load "
                        f"(≥ {policy.safe_load:.0%})", memory)
    fewer = f"{current - 1} replica{'s' if current - 1 != 1 else ''}"
    reason = (f"arrival {s.arrival_rate:.2f} req/s: {fewer} would run at {load:.0%} load "
              f"(< {policy.safe_load:.0%}); {current} not needed for {held:.0f} s")
    # the window has passed: further steps may follow period by period while N−1 stays safe
    return Decision(current - 1, DOWN, "scale_down", reason, replace(memory, changed_at=now))
