"""The goodput law for a disaggregated service: two pools, two targets, one decision per period.

Pure, like law.py, whose `decide` it runs once per pool:

- prefill: demand is prompt tokens per second; its attainment is the share of prefill requests whose
  TTFT met the TTFT target net of the hand-off's measured time (the decode side's pull); a TTFT miss
  with requests queued wakes its guard;
- decode: demand is output tokens per second; its attainment is the share within the TPOT target; a
  TPOT miss wakes its guard. A second term covers KV memory: the concurrent contexts must fit the
  pool's caches at KV_TARGET usage, so `ready × usage / KV_TARGET` replicas at least.

Token rates enter the law in units of one pool's typical request (`unit`, the mean tokens per request
when the pool's first load was read, then fixed): the law's noise model counts arrivals, and a rate
in such units has about a request's noise per unit, while the capacity it learns stays a number of
tokens per second (unit × the law's capacity) whatever the mix does afterwards.

Each pool consolidates as the law does (a replica goes only once the rest stay under plan for the
stabilisation window). Start-up samples never teach capacity: while a pool has replicas starting,
and for a window after its count last changed, its learnt capacity and evidence are kept as they were.
The pools reach zero together (a pool's zero waits for the other's) and wake together (held
requests, or the other pool serving, bring a pool at zero back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from goodput_operator.autoscaling.law import DOWN, HOLD, UP, Decision, decide
from goodput_operator.autoscaling.state import Memory, Observation, Policy, Signals

PREFILL, DECODE = "prefill", "decode"
KV_TARGET = 0.85  # KV cache usage the decode pool is sized to stay under
TERMS = {  # the law's cause → the term reported per pool
    "slo_guard": "guard",
    "capacity": "capacity",
    "forecast": "forecast",
    "scale_down": "consolidate",
    "idle": "idle",
    "wake": "wake",
    "bounds": "bounds",
    "batch": "batch",
    "stabilizing": "stabilizing",
    "steady": "steady",
    "metrics_missing": "metrics_missing",
}


@dataclass(frozen=True)
class PoolReading:
    """One pool's period: its replicas and what its ready pods' metrics say (None: missing)."""

    current: int
    ready: int
    signals: Signals | None  # request-level signals of the pool's pods (attainment: the pool's own target)
    token_rate: float = 0.0  # prompt tokens/s (prefill) or output tokens/s (decode)
    tokens_per_request: float | None = None  # mean, over the window
    missing: str = ""


@dataclass(frozen=True)
class PoolMemory:
    memory: Memory = field(default_factory=Memory)
    unit: float | None = None  # tokens per law unit, fixed at the pool's first load


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    desired: int
    direction: str
    term: str
    reason: str
    attainment: float | None
    memory: PoolMemory


def _law_signals(s: Signals, rate: float, unit: float) -> Signals:
    """The pool's signals with its token rate as the arrival rate, in units of `unit` tokens."""
    scale = rate / unit / s.arrival_rate if s.arrival_rate > 0 else 0.0
    return replace(
        s,
        arrival_rate=rate / unit,
        arrival_rate_now=None if s.arrival_rate_now is None else s.arrival_rate_now * scale,
    )


def _decide_pool(
    pool: str, policy: Policy, reading: PoolReading, memory: PoolMemory, now: float, held: int | None
) -> PoolDecision:
    unit = memory.unit
    if unit is None and reading.tokens_per_request and reading.token_rate > 0:
        unit = reading.tokens_per_request
    signals = reading.signals
    if signals is not None:
        signals = _law_signals(signals, reading.token_rate, unit or 1.0) if unit else replace(signals, arrival_rate=0.0)
    before = memory.memory
    decision: Decision = decide(
        policy, Observation(now, reading.current, reading.ready, signals, reading.missing, held=held), before
    )
    after = decision.memory
    starting = reading.current > reading.ready
    recent = before.changed_at is not None and now - before.changed_at < policy.window_seconds
    if starting or recent:  # start-up samples never teach capacity
        after = replace(
            after,
            capacity_per_replica=before.capacity_per_replica,
            good=before.good,
            total=before.total,
            ceiling=before.ceiling,
        )
    what = "prompt" if pool == PREFILL else "output"
    reason = decision.reason.replace("req/s", "units/s")
    if unit:
        mu = after.capacity_per_replica
        learnt = f", {mu * unit:.0f} per replica learnt" if mu else ""
        reason = f"{reading.token_rate:.0f} {what} tokens/s (unit {unit:.0f} tokens){learnt}: {reason}"
    attainment = None if reading.signals is None else reading.signals.attainment
    return PoolDecision(
        pool,
        decision.desired,
        decision.direction,
        TERMS.get(decision.cause, decision.cause),
        reason,
        attainment,
        PoolMemory(after, unit),
    )


def _kv_term(policy: Policy, reading: PoolReading, decision: PoolDecision) -> PoolDecision:
    """The decode pool holds the concurrent contexts: at least ready × usage / KV_TARGET replicas."""
    s = reading.signals
    if s is None or reading.ready <= 0 or s.kv_usage <= 0:
        return decision
    need = min(policy.max_replicas, math.ceil(reading.ready * s.kv_usage / KV_TARGET - 1e-9))
    if need <= decision.desired:
        return decision
    direction = UP if need > reading.current else HOLD
    return replace(
        decision,
        desired=need,
        direction=direction,
        term="kv_memory",
        reason=f"KV cache {s.kv_usage:.0%} used on {reading.ready} ready replicas: the contexts need {need} "
        f"at {KV_TARGET:.0%}; {decision.reason}",
    )


def _together(prefill: PoolDecision, decode: PoolDecision, readings: dict[str, PoolReading]) -> list[PoolDecision]:
    """Zero together, wake together."""
    out = []
    for mine, other in ((prefill, decode), (decode, prefill)):
        serving = other.desired > 0
        if mine.desired == 0 and serving:
            at = readings[mine.pool].current
            keep = max(1, at) if at > 0 else 1
            direction = UP if keep > at else (HOLD if keep == at else DOWN)
            term = "wake" if at == 0 else "together"
            why = (
                f"the {other.pool} pool serves, so the {mine.pool} pool wakes with it"
                if at == 0
                else f"the {other.pool} pool is not idle yet: both pools reach zero together"
            )
            mine = replace(mine, desired=keep, direction=direction, term=term, reason=why)
        out.append(mine)
    return out


def decide_pools(
    policies: dict[str, Policy],
    readings: dict[str, PoolReading],
    memories: dict[str, PoolMemory],
    now: float,
    held: int | None = None,
) -> dict[str, PoolDecision]:
    """Both pools' replica counts for the next period."""
    prefill = _decide_pool(
        PREFILL, policies[PREFILL], readings[PREFILL], memories.get(PREFILL, PoolMemory()), now, held
    )
    decode = _decide_pool(DECODE, policies[DECODE], readings[DECODE], memories.get(DECODE, PoolMemory()), now, held)
    decode = _kv_term(policies[DECODE], readings[DECODE], decode)
    prefill, decode = _together(prefill, decode, readings)
    return {PREFILL: prefill, DECODE: decode}
