"""Signals from the runtime's exposition text: what the autoscaler believes about a service."""

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from goodput_operator.autoscaling.signals import History, histogram_quantile, parse_pod_metrics
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.request_times import RequestTimes


def finished(metrics: RuntimeMetrics, ttft: float, tokens: int = 5, tpot: float = 0.01) -> None:
    t0 = 100.0
    metrics.record_finished(
        RequestTimes(
            arrival=t0,
            first_scheduled=t0,
            first_token=t0 + ttft,
            finished=t0 + ttft + tpot * (tokens - 1),
            num_output_tokens=tokens,
            outcome="success",
        )
    )


def scrape(metrics: RuntimeMetrics):
    return parse_pod_metrics(generate_latest(metrics.registry).decode())


def pod(slo_ttft=0.5) -> RuntimeMetrics:
    return RuntimeMetrics("tiny", slo_ttft, 0.05, registry=CollectorRegistry())


def test_attainment_rate_and_queue_over_a_window():
    a, b = pod(), pod()
    history = History(keep_seconds=600)
    history.add(0.0, {"a": scrape(a), "b": scrape(b)})
    for _ in range(16):
        finished(a, ttft=0.1)
    for _ in range(4):
        finished(b, ttft=0.9)  # missed the 0.5 s TTFT target
    b.record_step(running=3, waiting=4, kv_usage=0.5, prompt_tokens=0, generation_tokens=0, preemptions=0)
    history.add(10.0, {"a": scrape(a), "b": scrape(b)})
    s = history.signals(10.0, window=60, long_window=300)
    assert s.attainment == pytest.approx(0.8)
    assert s.arrival_rate == pytest.approx((20 + 7) / 10)  # finished plus the growth of running and waiting
    assert (s.waiting, s.running) == (4, 3)
    assert s.kv_usage == pytest.approx(0.25)
    assert 0.5 < s.ttft_p90 <= 1.0


def test_requests_refused_with_429_are_arrivals_but_not_served_requests():
    a = pod()
    history = History(keep_seconds=600)
    history.add(0.0, {"a": scrape(a)})
    for _ in range(10):
        finished(a, ttft=0.1)
    for _ in range(30):  # admission refused three times what the pod served: the demand is four times it
        a.record_rejected("slo_ttft_exceeded")
    history.add(10.0, {"a": scrape(a)})
    s = history.signals(10.0, window=60, long_window=300)
    assert s.arrival_rate == pytest.approx(40 / 10)
    assert s.attainment == pytest.approx(1.0)  # of the requests served, every one met the SLO


def test_one_scrape_is_no_signal_and_no_requests_is_no_attainment():
    a = pod()
    history = History(keep_seconds=600)
    history.add(0.0, {"a": scrape(a)})
    assert history.signals(0.0, 60, 300) is None  # a rate needs two scrapes, never "zero"
    history.add(15.0, {"a": scrape(a)})
    s = history.signals(15.0, 60, 300)
    assert s.arrival_rate == 0 and s.attainment is None


def test_a_restarted_pod_counts_from_zero_and_a_new_pod_waits_a_scrape():
    old, restarted = pod(), pod()
    for _ in range(50):
        finished(old, ttft=0.1)
    history = History(keep_seconds=600)
    history.add(0.0, {"a": scrape(old)})
    for _ in range(5):
        finished(restarted, ttft=0.1)
    history.add(10.0, {"a": scrape(restarted), "new": scrape(old)})
    s = history.signals(10.0, 60, 300)
    assert s.arrival_rate == pytest.approx(0.5)  # 5 since the restart; the new pod's 50 are not from this window


def test_other_exporters_are_refused():
    with pytest.raises(ValueError, match="not a Goodput runtime"):
        parse_pod_metrics("process_cpu_seconds_total 3\n")


@pytest.mark.parametrize(("q", "expected"), [(0.5, 0.25), (0.9, 0.45), (1.0, 0.5)])
def test_histogram_quantile_interpolates_like_prometheus(q, expected):
    buckets = [(0.0, 0.0), (0.5, 10.0), (1.0, 10.0), (float("inf"), 10.0)]
    assert histogram_quantile(q, buckets) == pytest.approx(expected)
