"""vLLM's and SGLang's /metrics read as the same signals as our runtime's, goodput estimated against the SLO.

The exposition texts here are written by prometheus_client under the engines' own series names,
labels and bucket boundaries (vLLM 0.32.0 as scraped from it, SGLang's collector); the vllm test tier
checks the same reading against a live vLLM.
"""

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from goodput_operator import engines
from goodput_operator.autoscaling.signals import History, estimated_good, parse_pod_metrics, share_within

SLO_TTFT, SLO_TPOT = 0.3, 0.045


class FakeVllm:
    """vLLM's series as vLLM 0.32.0 names and labels them, with the buckets the operator's flags ask for."""

    def __init__(self, kv_name="vllm:kv_cache_usage_perc", tpot_name="vllm:request_time_per_output_token_seconds"):
        r = self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.success = Counter("vllm:request_success", "", [*labels, "finished_reason"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "", labels, registry=r).labels("m", "0")
        self.waiting = Gauge("vllm:num_requests_waiting", "", labels, registry=r).labels("m", "0")
        self.kv = Gauge(kv_name, "", labels, registry=r).labels("m", "0")
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "",
            labels,
            registry=r,
            buckets=engines.with_boundary(engines.VLLM_TTFT_BUCKETS, SLO_TTFT),
        ).labels("m", "0")
        self.tpot = Histogram(
            tpot_name, "", labels, registry=r, buckets=engines.with_boundary(engines.VLLM_TPOT_BUCKETS, SLO_TPOT)
        ).labels("m", "0")
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels("m", "0", reason)

    def finish(self, ttft, tpot, reason="length"):
        self.success.labels("m", "0", reason).inc()
        if reason in ("stop", "length"):
            self.ttft.observe(ttft)
            self.tpot.observe(tpot)

    def text(self):
        return generate_latest(self.registry).decode()


class FakeSglang:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("sglang:num_requests", "", ["model_name"], registry=r).labels("m")
        self.aborted = Counter("sglang:num_aborted_requests", "", ["model_name"], registry=r).labels("m")
        self.running = Gauge("sglang:num_running_reqs", "", ["model_name"], registry=r).labels("m")
        self.queue = Gauge("sglang:num_queue_reqs", "", ["model_name"], registry=r).labels("m")
        self.usage = Gauge("sglang:token_usage", "", ["model_name"], registry=r).labels("m")
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "",
            ["model_name"],
            registry=r,
            buckets=engines.with_boundary(engines.SGLANG_TTFT_BUCKETS, SLO_TTFT),
        ).labels("m")
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "",
            ["model_name"],
            registry=r,
            buckets=engines.with_boundary(engines.SGLANG_TPOT_BUCKETS, SLO_TPOT),
        ).labels("m")

    def text(self):
        return generate_latest(self.registry).decode()


def test_vllm_gauges_and_counts_read_as_ours():
    pod = FakeVllm()
    pod.running.set(3)
    pod.waiting.set(5)
    pod.kv.set(0.42)
    pod.finish(0.1, 0.01)
    pod.finish(0.1, 0.01, reason="abort")
    sample = parse_pod_metrics(pod.text())
    assert (sample.engine, sample.counts_good) == ("vllm", False)
    assert (sample.running, sample.waiting, sample.kv_usage) == (3, 5, pytest.approx(0.42))
    assert (sample.requests, sample.failed) == (2, 1)
    assert sample.ttft_buckets[-1] == (float("inf"), 1)


def test_the_older_kv_gauge_and_tpot_histogram_names_still_read():
    """vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; dashboards and autoscalers broke on it."""
    pod = FakeVllm(kv_name="vllm:gpu_cache_usage_perc", tpot_name="vllm:time_per_output_token_seconds")
    pod.kv.set(0.7)
    pod.finish(0.1, 0.02)
    sample = parse_pod_metrics(pod.text())
    assert sample.kv_usage == pytest.approx(0.7)
    assert sample.tpot_buckets[-1] == (float("inf"), 1)


def test_vllm_attainment_is_estimated_against_the_slo_over_the_window():
    pod = FakeVllm()
    for _ in range(50):  # before the window: all bad, must not count
        pod.finish(2.0, 0.2)
    history = History(keep_seconds=600, slo_ttft=SLO_TTFT, slo_tpot=SLO_TPOT)
    history.add(0.0, {"a": parse_pod_metrics(pod.text())})
    for _ in range(14):
        pod.finish(0.1, 0.02)  # good
    for _ in range(4):
        pod.finish(0.5, 0.02)  # TTFT missed
    for _ in range(2):
        pod.finish(0.1, 0.06)  # TPOT missed
    pod.finish(0.1, 0.02, reason="abort")
    history.add(10.0, {"a": parse_pod_metrics(pod.text())})
    s = history.signals(10.0, window=60, long_window=300)
    # 20 successes: TTFT share 16/20, TPOT share 18/20. The smaller share bounds the share within both
    # from above: the estimate is 16 good, the truth 14, because here the two kinds of miss never overlap.
    assert history.finished(10.0, 60) == (21, pytest.approx(20 * 0.8))
    assert s.attainment == pytest.approx(16 / 21)
    assert 0.3 < s.ttft_p90 <= 0.5


def test_a_request_exactly_at_the_slo_counts_as_met():
    pod = FakeVllm()
    history = History(keep_seconds=600, slo_ttft=SLO_TTFT, slo_tpot=SLO_TPOT)
    history.add(0.0, {"a": parse_pod_metrics(pod.text())})
    pod.finish(SLO_TTFT, SLO_TPOT)
    history.add(5.0, {"a": parse_pod_metrics(pod.text())})
    assert history.attainment(5.0, 60) == 1.0


def test_without_slo_every_success_is_good():
    pod = FakeVllm()
    history = History(keep_seconds=600)
    history.add(0.0, {"a": parse_pod_metrics(pod.text())})
    pod.finish(9.0, 1.0)
    pod.finish(9.0, 1.0, reason="error")
    history.add(5.0, {"a": parse_pod_metrics(pod.text())})
    assert history.attainment(5.0, 60) == 0.5


def test_sglang_names_read_as_ours_with_aborted_requests_counted_apart():
    pod = FakeSglang()
    history = History(keep_seconds=600, slo_ttft=SLO_TTFT, slo_tpot=SLO_TPOT)
    history.add(0.0, {"a": parse_pod_metrics(pod.text())})
    pod.running.set(2)
    pod.queue.set(7)
    pod.usage.set(0.9)
    for ttft in (0.1, 0.1, 0.1, 0.6):
        pod.requests.inc()
        pod.ttft.observe(ttft)
    for _ in range(30):
        pod.itl.observe(0.01)  # per token: SGLang has no per-request TPOT
    pod.aborted.inc()
    history.add(10.0, {"a": parse_pod_metrics(pod.text())})
    s = history.signals(10.0, 60, 300)
    assert (s.running, s.waiting, s.kv_usage) == (2, 7, pytest.approx(0.9))
    assert history.finished(10.0, 60) == (5, pytest.approx(3))
    assert s.attainment == pytest.approx(3 / 5)


@pytest.mark.parametrize(("target", "share"), [(0.5, 0.5), (0.25, 0.25), (1.0, 1.0), (None, 1.0), (0.75, 0.75)])
def test_share_within_is_exact_on_a_boundary_and_interpolated_between(target, share):
    buckets = [(0.5, 10.0), (1.0, 20.0), (float("inf"), 20.0)]
    assert share_within(buckets, target) == pytest.approx(share)


def test_share_within_has_no_answer_without_observations_and_estimated_good_ignores_it():
    assert share_within([(0.5, 0.0), (float("inf"), 0.0)], 0.5) is None
    assert estimated_good(10, None, 0.5) == 5
    assert estimated_good(10, None, None) == 10
