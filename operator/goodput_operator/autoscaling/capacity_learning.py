"""μ, the capacity per replica, learnt from live SLO attainment: a sequential test on the requests
served near the planned load moves it up or down a step."""

from __future__ import annotations

import math
from dataclasses import replace

from goodput_operator.autoscaling.staffing import TOLERANCE, planned_load
from goodput_operator.autoscaling.state import Memory, Policy, Signals

MARGIN = 0.01  # the capacity estimate aims attainment this far above the target
LEARNING_RATE = 0.3  # a load met above the plan moves the plan this share of the way towards it
EVIDENCE_Z = 1.5  # the estimate moves when attainment differs from the aim by this many standard deviations
EXPLORE_Z = 1.0  # before any miss has been seen, weaker evidence raises the estimate, by the largest step
STEP_GAIN = 8.0  # a verdict moves the estimate by exp(STEP_GAIN × (attainment − aim)) ...
STEP_LIMITS = (0.94, 0.98, 1.02, 1.2)  # ... down between the first two factors, up between the last two: small
# steps, since a verdict on minutes of requests is still often wrong and each wrong one costs until undone
PLANNED_BAND = (0.7, 1.1)  # a period is evidence when the load ran at this share of the planned load


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
