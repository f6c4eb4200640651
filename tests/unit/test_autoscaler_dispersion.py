"""How bursty arrivals are, as the autoscaler measures it (autoscaling/dispersion.py): the index of dispersion
of arrival counts per control period, robust to changes of rate and guarded against small samples, and the
spread of request sizes from the latency histograms; then the same read off the runtime's own exposition
text by signals.History, as the loop reads it every period."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from goodput_operator.autoscaling.dispersion import (
    DISPERSION_PERIODS,
    MIN_RESIDUALS,
    NEIGHBOURS,
    index_of_dispersion,
    size_spread,
)
from goodput_operator.autoscaling.signals import History, parse_pod_metrics
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.request_times import RequestTimes

PERIOD = 15.0


def windows(counts: np.ndarray) -> list[list[tuple[float, float]]]:
    return [[(PERIOD, float(c)) for c in row] for row in counts]


@pytest.mark.parametrize("per_period", [3.0, 17.5, 60.0])
def test_poisson_counts_read_one_and_plan_as_poisson(per_period):
    """Over 2,000 windows of Poisson counts the index averages 1 at any rate, and the peakedness the law plans
    with is exactly 1 in all but a few per cent of them, and then barely above it."""
    rng = np.random.default_rng(1)
    readings = [index_of_dispersion(w) for w in windows(rng.poisson(per_period, (2000, DISPERSION_PERIODS)))]
    assert all(r is not None for r in readings)
    index = [r.index for r in readings if r]
    peaks = [r.peakedness for r in readings if r]
    assert np.mean(index) == pytest.approx(1.0, abs=0.03)
    assert np.mean([p > 1 for p in peaks]) < 0.05
    assert np.mean(peaks) < 1.02


def compound_poisson(rng: np.random.Generator, batches: float, size: int, periods: int) -> list[tuple[float, float]]:
    """Counts of a compound Poisson process: Poisson(`batches`) arrivals of `size` requests each per period;
    index of dispersion E(K²)/E(K) = size."""
    return [(PERIOD, float(size * rng.poisson(batches))) for _ in range(periods)]


@pytest.mark.parametrize("size", [3, 6])
def test_over_dispersed_counts_read_their_index(size):
    """Batches of `size` requests: the counts' variance is `size` times their mean, and the index reads it;
    the peakedness is it less its noise, well above 1."""
    rng = np.random.default_rng(2)
    readings = [index_of_dispersion(compound_poisson(rng, 5.0, size, DISPERSION_PERIODS)) for _ in range(500)]
    index = [r.index for r in readings if r]
    assert np.mean(index) == pytest.approx(size, rel=0.06)
    assert min(r.peakedness for r in readings if r) > 1.0
    assert np.mean([r.peakedness for r in readings if r]) == pytest.approx(size - 2 * readings[0].error, rel=0.1)


def test_a_change_of_rate_is_rate_not_burstiness():
    """A ramp from 5 to 40 a period, a step from 10 to 30, a flash crowd ×8 within a minute: the smoothed
    level and the forecast follow those; compared with the mean of its neighbours each count stays Poisson,
    and the law plans as for Poisson (a steady mean would read the step as an index of 6)."""
    rng = np.random.default_rng(3)
    n = DISPERSION_PERIODS
    ramp = [5 + 35 * i / n for i in range(n)]
    step = [10.0 if i < n // 2 else 30.0 for i in range(n)]
    flash = [5.0 if i < n // 2 else 5.0 + 35.0 * min(1.0, (i - n // 2) / 4) for i in range(n)]
    for means in (ramp, step, flash):
        peaks = []
        for _ in range(200):
            reading = index_of_dispersion([(PERIOD, float(rng.poisson(m))) for m in means])
            assert reading is not None
            peaks.append(reading.peakedness)
        assert np.mean(peaks) < 1.1 and np.median(peaks) == 1.0


def test_periods_of_unequal_length_weigh_by_their_length():
    """A missed scrape makes one period twice as long: counts are compared with what the local rate predicts
    for each period's own length, so Poisson arrivals still read 1."""
    rng = np.random.default_rng(4)
    index = []
    for _ in range(500):
        spans = [PERIOD * (2 if i % 7 == 3 else 1) for i in range(DISPERSION_PERIODS)]
        index.append(index_of_dispersion([(s, float(rng.poisson(s))) for s in spans]).index)  # type: ignore[union-attr]
    assert np.mean(index) == pytest.approx(1.0, abs=0.05)


def test_too_few_periods_or_arrivals_say_nothing():
    """A reading needs MIN_RESIDUALS counts with neighbours on both sides and MIN_ARRIVALS arrivals among them:
    until then (a new service, a quiet one) the law plans as for Poisson."""
    enough = MIN_RESIDUALS + NEIGHBOURS - 1
    assert index_of_dispersion([(PERIOD, 10.0)] * (enough - 1)) is None
    assert index_of_dispersion([(PERIOD, 10.0)] * enough) is not None
    assert index_of_dispersion([(PERIOD, 1.0)] * enough) is None  # 16 arrivals
    assert index_of_dispersion([(PERIOD, 0.0)] * DISPERSION_PERIODS) is None


def cumulative(values: list[float], bounds: tuple[float, ...]) -> list[tuple[float, float]]:
    return [(le, float(sum(v <= le for v in values))) for le in (*bounds, math.inf)]


def test_size_spread_from_the_latency_histograms():
    """Decode time is output length times time per token: its squared coefficient of variation, read off the
    end-to-end and first-token histograms, tells equal sizes from a heavy-tailed mix."""
    bounds = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
    ttft_bounds = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0)
    rng = random.Random(5)
    ttft = [rng.uniform(0.1, 0.3) for _ in range(2000)]
    same = [t + 4.0 for t in ttft]
    heavy_decode = [min(200.0, 4.0 * math.exp(rng.gauss(0, 1.0)) / math.exp(0.5)) for _ in ttft]
    heavy = [t + d for t, d in zip(ttft, heavy_decode, strict=True)]
    true_cv2 = np.var(heavy_decode) / np.mean(heavy_decode) ** 2
    flat = size_spread(cumulative(same, bounds), cumulative(ttft, ttft_bounds))
    spread = size_spread(cumulative(heavy, bounds), cumulative(ttft, ttft_bounds))
    assert flat is not None and flat < 0.1
    assert spread is not None and spread == pytest.approx(true_cv2, rel=0.35) and spread > 1.0
    assert size_spread([], []) is None


class Pod:
    def __init__(self) -> None:
        self.metrics = RuntimeMetrics("tiny", 1.0, 0.1, registry=CollectorRegistry())

    def period(self, finished: int) -> None:
        for _ in range(finished):
            times = RequestTimes(
                arrival=0.0, first_scheduled=0.0, first_token=0.1, finished=0.5, num_output_tokens=8, outcome="success"
            )
            self.metrics.record_finished(times)
        self.metrics.record_step(0, 0, 0.1, 0, 0, 0)

    def text(self) -> str:
        return generate_latest(self.metrics.registry).decode()


def read(counts: list[int], period: float = 2.0) -> History:
    """The loop's History fed one scrape of the runtime's exposition text per period."""
    pod, history, now = Pod(), History(keep_seconds=60.0), 0.0
    history.add(now, {"a": parse_pod_metrics(pod.text())})
    for count in counts:
        pod.period(count)
        now += period
        history.add(now, {"a": parse_pod_metrics(pod.text())})
    return history


def test_the_loop_reads_the_dispersion_of_the_counts_between_its_scrapes():
    """Counted off the runtime's own counters between scrapes: Poisson arrivals plan as Poisson; arrivals in
    bursts (a period of 20 among quiet ones) show their index and raise the peakedness."""
    rng = np.random.default_rng(6)
    poisson = read([int(c) for c in rng.poisson(6, DISPERSION_PERIODS)])
    s = poisson.signals(poisson.scrapes[-1][0], 10.0, 50.0)
    assert s is not None and s.dispersion is not None and s.peakedness == pytest.approx(1.0, abs=0.2)
    bursts = read([int(20 * rng.poisson(0.3)) for _ in range(DISPERSION_PERIODS)])
    s = bursts.signals(bursts.scrapes[-1][0], 10.0, 50.0)
    assert s is not None and s.dispersion is not None and s.dispersion > 8 and s.peakedness > 4
    assert len(bursts.periods) == DISPERSION_PERIODS  # the counts kept
    young = read([6] * 5)
    s = young.signals(young.scrapes[-1][0], 10.0, 50.0)
    assert s is not None and s.dispersion is None and s.peakedness == 1.0
    assert s.size_cv2 == pytest.approx(0.0, abs=0.05)  # every request the same size
