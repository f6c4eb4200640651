"""Replicas for a load: the planned load per replica (square-root staffing headroom) and the fewest
replicas whose planned load covers an arrival rate."""

from __future__ import annotations

import math

REFERENCE_REPLICAS = 4  # the replica count at which the headroom is exactly 1 − target utilisation
TOLERANCE = 0.05  # up when the load exceeds the plan by this share; down when N−1 stay this far under it


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


def replicas_for(rate: float, mu: float | None, current: int, utilization: float, peakedness: float = 1.0) -> int:
    """Replicas for `rate` at the planned load each; the current count stands within TOLERANCE of it."""
    if mu is None or mu <= 0 or rate <= 0:
        return 0
    planned = planned_load(mu, current, utilization, peakedness)
    if current * planned < rate <= current * planned * (1 + TOLERANCE):
        return current
    return capacity_term(rate, mu, utilization, peakedness)
