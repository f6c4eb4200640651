"""What the scaling law reads and carries: the Policy from the spec, the Signals and Observation of one
period, and the Memory it keeps from one period to the next.

Plain frozen dataclasses, shared by the law (law.py), the arrival rate (arrival.py), the signal
sources and the loop; this module imports none of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    attainment_target: float = 0.95
    ttft_target: float | None = None  # seconds; for the reason text
    tpot_target: float | None = None
    target_utilization: float = 0.8
    scale_down_window: float = 300.0  # seconds
    idle_period: float | None = None  # seconds without requests before 1 → 0; needed for minReplicas 0
    startup_seconds: float = 60.0  # pod created → ready: how far ahead the forecast looks
    window_seconds: float = 60.0  # the short metrics window
    batch_max_replicas: int = 0  # spec.batch.maxReplicas: replicas kept while batch lines are pending
    dispersion: bool = True  # plan with the arrivals' measured peakedness (False: as for Poisson; the operator's
    # --autoscaler-dispersion off, the simulator's goodput-poisson)


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
    finished: float | None = None  # requests finished in the short window; None: a fifth of finished_long
    dispersion: float | None = None  # index of dispersion of arrival counts per control period (None: too few yet)
    peakedness: float = 1.0  # what the law's headroom uses: the index less its noise, floored at 1 (dispersion.py)
    size_cv2: float | None = None  # request sizes' squared coefficient of variation, over the long window
    # for a disaggregated service's pools (pools.py); None where the source did not say
    ttft_within: float | None = None  # share of the window's requests within the TTFT target the source was given
    tpot_within: float | None = None  # ... within the TPOT target
    prompt_tokens_rate: float | None = None  # prompt tokens computed per second
    output_tokens_rate: float | None = None  # tokens generated per second
    handoff_seconds: float | None = None  # mean seconds of a KV hand-off (the decode side's pull)


@dataclass(frozen=True)
class Observation:
    now: float  # seconds, any monotonic origin
    current: int  # replicas the scale subresource holds now
    ready: int  # replicas serving (the rest are starting: coming capacity)
    signals: Signals | None  # None: metrics missing or failed, never read as zero
    missing: str = ""  # why signals are None
    held: int | None = None  # requests the gateway holds for the service (None: no gateway read)
    last_request_age: float | None = None  # seconds since the gateway last saw a request for it (None: never)
    batch_pending: int | None = None  # Batch API lines the gateway has yet to run for it (None: no gateway read)


@dataclass(frozen=True)
class Memory:
    """What the law carries from one period to the next."""

    capacity_per_replica: float | None = None  # requests per second one replica serves within the SLO
    high_since: float | None = None  # when the need last reached the current count
    idle_since: float | None = None
    changed_at: float | None = None  # when the replica count last changed or pods were last starting
    level: float | None = None  # Holt: the smoothed arrival rate (req/s) ...
    trend: float = 0.0  # ... and its trend (req/s per second)
    level_age: float = math.inf  # seconds of readings behind the level (0 at the first)
    seen_at: float | None = None  # the last period's time
    good: float = 0.0  # evidence about the current estimate: requests within the SLO ...
    total: float = 0.0  # ... of this many, in periods run near the planned load
    ceiling: float | None = None  # the lowest estimate a significant miss refuted
    peakedness: float = 1.0  # the arrivals' measured peakedness (1: Poisson), as last read


def start_memory(capacity: float | None) -> Memory:
    """A service's first Memory. A configured capacity is a measurement, not a guess: the law starts from it
    and probes above it only as it would above a refuted estimate, a few per cent at a time."""
    return Memory(capacity_per_replica=capacity, ceiling=capacity)
