"""The arrival rate the law plans for: Holt's linear smoothing of the windowed rate against Poisson
noise, the test that tells a change from noise, and the forecast over a replica's start-up.

Pure, like law.py, whose `decide` calls it with the Memory, Signals and Policy of state.py.
"""

from __future__ import annotations

import math
from dataclasses import replace

from goodput_operator.autoscaling.state import Memory, Policy, Signals

# Holt's linear smoothing of the arrival rate: time constant in short windows (180 s for the default 60 s), trend gain
LEVEL_WINDOWS, TREND_BETA = 3.0, 0.2
JUMP_SIGMAS = 3.0  # a window this many Poisson deviations off the smoothed rate is a change, taken at once
TREND_SIGMAS = 4.0  # the trend counts when it moves the forecast beyond this many Poisson deviations


def smooth(memory: Memory, s: Signals, dt: float, window: float) -> Memory:
    """Holt's linear method on the windowed arrival rate, slow (LEVEL_WINDOWS windows) against Poisson noise, except
    that a window JUMP_SIGMAS Poisson deviations away from the forecast is a change and is taken at once.
    The trend is per second and learns only from the smoothed steps.

    For the first window the level is the newest reading: until the scrapes span a window each reading is
    the rate since the first scrape, the newest over the longest span. Smoothed from the first one, a
    count of one period, the level would climb or sink from it for minutes, which the trend reads as a
    rise or a fall; the trend starts once the level rests on a whole window."""
    if memory.level is None or dt <= 0:
        return replace(memory, level=s.arrival_rate, trend=0.0, level_age=0.0)
    prior = max(0.0, memory.level + memory.trend * dt)
    age = memory.level_age + dt
    if abs(s.arrival_rate - prior) > JUMP_SIGMAS * noise(max(prior, s.arrival_rate), window):
        return replace(memory, level=s.arrival_rate, level_age=age)
    if age < window:  # the readings so far cover less than a window: the newest covers the most
        return replace(memory, level=s.arrival_rate, level_age=age)
    alpha = min(1.0, dt / (LEVEL_WINDOWS * window))
    level = alpha * s.arrival_rate + (1 - alpha) * prior
    trend = TREND_BETA * (level - memory.level) / dt + (1 - TREND_BETA) * memory.trend
    return replace(memory, level=level, trend=trend, level_age=age)


def beyond_noise(rate: float, level: float, span: float) -> float:
    """A rate counted over `span` seconds, less the JUMP_SIGMAS Poisson deviations around `level` that
    noise alone reaches: a surge by the part of it noise does not explain. Over a short span (a 2 s
    period sees a handful of requests) a burst clears the test often, and taken whole it would read
    about twice the level every time it did; a real surge keeps nearly all of its size."""
    return rate - JUMP_SIGMAS * noise(level, span)


def noise(rate: float, window: float) -> float:
    """The standard deviation of a Poisson rate counted over `window` seconds."""
    return math.sqrt(max(rate, 1e-9) / max(window, 1e-9))


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
    return level + rise if rise > TREND_SIGMAS * noise(level, window) else level
