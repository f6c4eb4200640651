"""The arrival rate the law plans for: Holt's linear smoothing of the windowed rate against Poisson
noise, the test that tells a change from noise, and the forecast over a replica's start-up. The noise is
Poisson's times the square root of the arrivals' measured peakedness (dispersion.py): on bursty traffic a
burst is not a change of rate.

Pure, like law.py, whose `decide` calls it with the Memory, Signals and Policy of state.py.
"""

from __future__ import annotations

import math
from dataclasses import replace

from goodput_operator.autoscaling.state import Memory, Policy, Signals

# Holt's linear smoothing of the arrival rate: time constant in short windows (180 s for the default 60 s), trend gain
LEVEL_WINDOWS, TREND_BETA = 3.0, 0.2
BURSTY_SLOWDOWN = 4.0  # on over-dispersed arrivals the smoothing slows by their peakedness, at most this factor
JUMP_SIGMAS = 3.0  # a window this many Poisson deviations off the smoothed rate is a change, taken at once
TREND_SIGMAS = 4.0  # the trend counts when it moves the forecast beyond this many Poisson deviations


def smooth(memory: Memory, s: Signals, dt: float, window: float) -> Memory:
    """Holt's linear method on the windowed arrival rate, slow (LEVEL_WINDOWS windows) against Poisson noise, except
    that a window JUMP_SIGMAS Poisson deviations away from the forecast is a change and is taken at once.
    The trend is per second and learns only from the smoothed steps. On over-dispersed arrivals (the memory's
    peakedness z above 1) the smoothing is z times slower, up to BURSTY_SLOWDOWN, and the change test allows
    for bursts (see below).

    For the first window the level is the newest reading: until the scrapes span a window each reading is
    the rate since the first scrape, the newest over the longest span. Smoothed from the first one, a
    count of one period, the level would climb or sink from it for minutes, which the trend reads as a
    rise or a fall; the trend starts once the level rests on a whole window."""
    if memory.level is None or dt <= 0:
        return replace(memory, level=s.arrival_rate, trend=0.0, level_age=0.0)
    prior = max(0.0, memory.level + memory.trend * dt)
    age = memory.level_age + dt
    z = max(1.0, memory.peakedness)
    # on bursty arrivals a window's rate is tested against the widest spread bursts could give it, each burst
    # filling the window: the peakedness per period times the periods in a window (a burst shorter than a
    # start-up is over before a replica asked for it serves, so only a change beyond that is a change)
    window_z = z * max(1.0, window / dt) if z > 1 else 1.0
    if abs(s.arrival_rate - prior) > JUMP_SIGMAS * noise(max(prior, s.arrival_rate), window, window_z):
        return replace(memory, level=s.arrival_rate, level_age=age)
    if age < window:  # the readings so far cover less than a window: the newest covers the most
        return replace(memory, level=s.arrival_rate, level_age=age)
    # z times Poisson's variance needs z times the readings for the same precision (up to BURSTY_SLOWDOWN)
    alpha = min(1.0, dt / (LEVEL_WINDOWS * window * min(z, BURSTY_SLOWDOWN)))
    level = alpha * s.arrival_rate + (1 - alpha) * prior
    trend = TREND_BETA * (level - memory.level) / dt + (1 - TREND_BETA) * memory.trend
    return replace(memory, level=level, trend=trend, level_age=age)


def beyond_noise(rate: float, level: float, span: float, peakedness: float = 1.0) -> float:
    """A rate counted over `span` seconds, less the JUMP_SIGMAS Poisson deviations around `level` that
    noise alone reaches: a surge by the part of it noise does not explain. Over a short span (a 2 s
    period sees a handful of requests) a burst clears the test often, and taken whole it would read
    about twice the level every time it did; a real surge keeps nearly all of its size."""
    return rate - JUMP_SIGMAS * noise(level, span, peakedness)


def noise(rate: float, window: float, peakedness: float = 1.0) -> float:
    """The standard deviation of a rate counted over `window` seconds: Poisson's, times the square root of
    the arrivals' measured peakedness (their counts' variance over mean; 1 for Poisson)."""
    return math.sqrt(peakedness * max(rate, 1e-9) / max(window, 1e-9))


def forecast(memory: Memory, policy: Policy, period: float) -> float | None:
    """The arrival rate the law plans for when a replica asked for now would be ready, as `decide` does
    (None before the first signal): for the dashboard's forecast against the rate that then came."""
    if memory.level is None:
        return None
    return rate_ahead(memory, policy.startup_seconds + period + policy.window_seconds / 2, policy.window_seconds)


def rate_ahead(memory: Memory, horizon: float, window: float) -> float:
    """The rate expected `horizon` seconds on: the level plus the trend, the trend only where it is
    significant (beyond TREND_SIGMAS Poisson deviations of a windowed rate) and only upwards."""
    level = memory.level or 0.0
    rise = memory.trend * horizon
    return level + rise if rise > TREND_SIGMAS * noise(level, window, memory.peakedness) else level
