"""The arrival rate the autoscaler acts on, from sequences of the runtime's own exposition text.

The operator scrapes every ready pod each control period and differences the counters over a
window (signals.History); the law smooths that rate and, while requests queue, also weighs the
last period's (law.decide). These tests replay scrapes a 2 s period and a 10 s window apart, the
settings of the live autoscaler tests, where a period sees only a handful of requests.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from goodput_operator.autoscaling.arrival import forecast
from goodput_operator.autoscaling.law import Decision, decide
from goodput_operator.autoscaling.signals import History, parse_pod_metrics
from goodput_operator.autoscaling.state import Memory, Observation, Policy, Signals
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.request_times import RequestTimes

PERIOD, WINDOW = 2.0, 10.0
POLICY = Policy(
    min_replicas=1, max_replicas=3, attainment_target=0.9, ttft_target=1.0, window_seconds=WINDOW, startup_seconds=60.0
)
MU = 10.0  # requests per second one replica serves: 1 / a 0.1 s request, one at a time


class Pod:
    """One runtime's metrics, fed finished requests and the queue as its engine would."""

    def __init__(self) -> None:
        self.metrics = RuntimeMetrics("tiny", 1.0, 0.1, registry=CollectorRegistry())

    def period(self, finished: int, running: int = 0, waiting: int = 0) -> None:
        for _ in range(finished):
            self.metrics.record_finished(
                RequestTimes(
                    arrival=0.0,
                    first_scheduled=0.0,
                    first_token=0.1,
                    finished=0.2,
                    num_output_tokens=8,
                    outcome="success",
                )
            )
        self.metrics.record_step(running, waiting, 0.1, 0, 0, 0)

    def text(self) -> str:
        return generate_latest(self.metrics.registry).decode()


class Operator:
    """The loop's reading and deciding, period by period, on the scrapes it is handed."""

    def __init__(self, replicas: int = 1) -> None:
        self.history = History(keep_seconds=6 * WINDOW)
        self.memory = Memory(capacity_per_replica=MU)
        self.replicas = replicas
        self.now = 0.0
        self.decisions: list[Decision] = []
        # (level, forecast) each period: the rates the dashboard plots as smoothed and forecast
        self.ahead: list[tuple[float | None, float | None]] = []

    def scrape(self, pods: dict[str, Pod]) -> Signals | None:
        self.now += PERIOD
        self.history.add(self.now, {name: parse_pod_metrics(pod.text()) for name, pod in pods.items()})
        s = self.history.signals(self.now, WINDOW, 5 * WINDOW)
        if s is None:
            return None
        decision = decide(POLICY, Observation(self.now, self.replicas, self.replicas, s), self.memory)
        self.memory = decision.memory
        self.decisions.append(decision)
        self.ahead.append((decision.memory.level, forecast(decision.memory, POLICY, PERIOD)))
        return s


def steady(operator: Operator, pod: Pod, periods: int, counts=(8, 7)) -> None:
    """Arrivals of 3.75 per second (8 and 7 a period in turn), each served before the next scrape."""
    for i in range(periods):
        pod.period(counts[i % len(counts)])
        operator.scrape({"a": pod})


def test_a_burst_in_one_period_is_not_read_as_a_surge():
    """17 requests in one 2 s period at 3.75 per second, 7 of them still queued at the scrape: Poisson
    noise (about a 1-in-1000 period), not a rate of 8.5. Read whole, with the queue on top, it asked
    for a second replica at 0.4 of one replica's capacity ("arrival 9.2 req/s and 7 queued")."""
    pod, operator = Pod(), Operator()
    pod.period(0)
    operator.scrape({"a": pod})
    steady(operator, pod, 20)
    pod.period(10, running=1, waiting=6)
    s = operator.scrape({"a": pod})
    assert s is not None and s.arrival_rate_now == pytest.approx(17 / PERIOD) and s.waiting == 6
    last = operator.decisions[-1]
    assert (last.desired, last.direction) == (1, "hold"), last.reason


def test_three_times_the_rate_for_one_period_with_a_queue_is_met_at_once():
    """The other side: a surge the period shows beyond its noise still adds replicas in that period."""
    pod, operator = Pod(), Operator()
    pod.period(0)
    operator.scrape({"a": pod})
    steady(operator, pod, 20)
    pod.period(12, running=1, waiting=10)  # 23 arrivals in 2 s
    operator.scrape({"a": pod})
    last = operator.decisions[-1]
    assert (last.desired, last.cause) == (2, "capacity"), last.reason


def test_a_short_first_reading_is_not_read_as_a_rising_trend():
    """The first reading is a rate over one period. Here it counts 2 requests of an arrival rate that
    is 3.75 per second throughout: smoothed slowly from there, the level climbed for a minute and the
    trend read that climb as a rise, so the forecast ran ahead of a steady rate."""
    pod, operator = Pod(), Operator()
    pod.period(0)
    operator.scrape({"a": pod})
    pod.period(2)
    operator.scrape({"a": pod})
    steady(operator, pod, 30)
    assert all(ahead == level for level, ahead in operator.ahead), operator.ahead  # no rise seen in a steady rate
    assert operator.memory.level == pytest.approx(3.75, abs=0.3)
    assert all(d.desired == 1 for d in operator.decisions)


def test_a_pod_that_became_ready_counts_from_its_first_scrape():
    """4 requests a second throughout, all to pod a, then split over a and b once b is ready. b's counters
    are differenced from its first scrape, so its half is in the rate at once, not only a window after it
    joined (meanwhile the rate read half the load, and the smoothed level took that as a fall)."""
    a, b = Pod(), Pod()
    operator = Operator(replicas=2)
    a.period(0)
    operator.scrape({"a": a})
    for _ in range(10):
        a.period(8)
        operator.scrape({"a": a})
    a.period(8)
    b.period(0)
    operator.scrape({"a": a, "b": b})  # ready now, read once: no interval yet
    rates = []
    for _ in range(5):
        a.period(4)
        b.period(4)
        s = operator.scrape({"a": a, "b": b})
        assert s is not None
        rates.append(s.arrival_rate)
    assert min(rates) == pytest.approx(4.0, abs=0.01), rates
