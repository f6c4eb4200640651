"""How bursty a service's traffic is: the index of dispersion of its arrival counts at the control period's
scale, and the spread of its request sizes. The law (law.py) sizes its headroom and its noise tests with it.

Pure functions over what the autoscaler already observes each period: the arrivals counted between two
scrapes (signals.History keeps the last DISPERSION_PERIODS of them) and the runtime's latency histograms.

The index of dispersion of counts, D = Var(N) / E(N) for the number N of arrivals in one control period, is
1 for a Poisson process at any rate and above 1 for over-dispersed traffic, whose counts within a minute
swing several times as far as Poisson's (bursts of seconds to tens of seconds). Counted against a steady
mean it would also read every change of rate as dispersion (a ramp, a step, a flash crowd); here each
period's count is compared with the mean of the periods around it (NEIGHBOURS of them, centred), so what
moves slower than about a minute is rate — the smoothed level and the forecast follow it — and only what
moves faster is burstiness. Under Poisson arrivals a count's squared residual about that local mean
averages (1 − 1/NEIGHBOURS) × the mean, so D is their sum over the means' sum, divided by that factor.

D is a sample statistic: over 36 residuals of Poisson counts its standard deviation is 0.28 (1.8 at the
99th percentile), over 76 about 0.2.
`peakedness`, what the law multiplies its headroom's variance by, is D less two of its standard errors
under Poisson, floored at 1: on Poisson traffic it is 1 (the law as before), and it grows only where the
counts' spread is more than chance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DISPERSION_PERIODS = 80  # control periods of counts kept: 20 minutes at the default 15 s
NEIGHBOURS = 5  # each count against the mean of this many periods centred on it (itself included)
MIN_RESIDUALS = 12  # fewer: no reading (the law plans as for Poisson)
MIN_ARRIVALS = 60  # fewer arrivals over the counts: no reading
ERROR_SIGMAS = 2.0  # the peakedness is the index less this many of its standard errors under Poisson
# residuals about a centred mean of NEIGHBOURS are correlated, so fewer are independent than counted: the
# standard deviation of D over 40 Poisson counts (10,000 simulated windows at 3, 17.5 and 60 a period) is
# 1.10-1.20 times what as many independent residuals would give
CORRELATION_FACTOR = 1.2


@dataclass(frozen=True)
class Dispersion:
    index: float  # D: the index of dispersion of arrival counts per control period
    error: float  # its standard error under Poisson arrivals at the same mean
    periods: int  # the counts behind it
    peakedness: float  # max(1, index − ERROR_SIGMAS × error): what the law uses


def index_of_dispersion(periods: Sequence[tuple[float, float]]) -> Dispersion | None:
    """The index of dispersion of arrival counts, from (seconds, arrivals) of consecutive control periods,
    oldest first. Each count is compared with the rate of the NEIGHBOURS periods centred on it (so periods
    of unequal length weigh right, and a change of rate slower than those periods is not read as
    burstiness). None with too few periods or arrivals to say."""
    k, half = NEIGHBOURS, NEIGHBOURS // 2
    if len(periods) < MIN_RESIDUALS + 2 * half:
        return None
    if sum(count for _, count in periods) < MIN_ARRIVALS:
        return None
    squares = expected = 0.0
    n = 0
    for i in range(half, len(periods) - half):
        around = periods[i - half : i + half + 1]
        seconds = sum(span for span, _ in around)
        if seconds <= 0:
            continue
        span, count = periods[i]
        mean = span * sum(c for _, c in around) / seconds  # the count the local rate predicts for this period
        squares += (count - mean) ** 2
        expected += mean
        n += 1
    if n < MIN_RESIDUALS or expected <= 0:
        return None
    index = squares / (expected * (1 - 1 / k))
    per_period = expected / n
    # a Poisson count's squared residual has variance 2λ² + λ: relative to its mean λ, 2 + 1/λ
    error = CORRELATION_FACTOR * math.sqrt((2 + 1 / max(per_period, 1e-9)) / n)
    return Dispersion(index, error, n, max(1.0, index - ERROR_SIGMAS * error))


def size_spread(
    e2e: Sequence[tuple[float, float]],
    ttft: Sequence[tuple[float, float]],
    e2e_mean: float | None = None,
    ttft_mean: float | None = None,
) -> float | None:
    """The squared coefficient of variation of request sizes (Var / mean²), from the histograms of
    end-to-end latency and time to first token over the same window (cumulative (le, count) pairs).

    A request's time after its first token is its output length times its time per token, and the
    runtime counts tokens per step rather than per request, so the spread of that time is what the
    histograms say about the spread of sizes: Var(e2e) − Var(TTFT) over (E(e2e) − E(TTFT))², the two
    taken as independent. Moments come from the buckets' midpoints (exact means where the histograms'
    sums are given); None without observations or where the times after the first token are nil."""
    m1, v1 = _moments(e2e, e2e_mean)
    if m1 is None or v1 is None:
        return None
    m2, v2 = _moments(ttft, ttft_mean)
    decode = m1 - (m2 or 0.0)
    if decode <= 0:
        return None
    return max(0.0, v1 - (v2 or 0.0)) / decode**2


def _moments(buckets: Sequence[tuple[float, float]], mean: float | None) -> tuple[float | None, float | None]:
    """Mean and variance of a cumulative histogram, each bucket's count at its midpoint (the last finite
    bound for the +Inf bucket)."""
    if not buckets or buckets[-1][1] <= 0:
        return None, None
    total = buckets[-1][1]
    first = second = 0.0
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        share = max(0.0, count - prev_count)
        mid = prev_le if math.isinf(le) else (prev_le + le) / 2
        first += share * mid
        second += share * mid * mid
        if not math.isinf(le):
            prev_le = le
        prev_count = count
    est = first / total
    m = est if mean is None else mean
    return m, max(0.0, second / total - est * est)
