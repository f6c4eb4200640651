"""Live proof: the goodput autoscaler holds an SLO on real runtime processes, and Prometheus sees it all.

The operator runs as a real process against the real API server, with a 2 s control
period and a 6 s window. The service's "pods" are real `python -m goodput_runtime`
processes on the tiny model: live_pods.Actuator follows the replica count the autoscaler
writes through the scale subresource and publishes each process as an EndpointSlice
endpoint, as the Deployment, the kubelet and the EndpointSlice controller would (the test
cluster has no kubelet). A load generator steps from light load to more clients than one
replica serves within its 0.2 s TTFT target, then to none; capacityPerReplica is set far
above what the tiny model serves, so the SLO guard, not the capacity term, is what acts.
A real Prometheus scrapes the same pods and the operator with the shipped recording
rules; afterwards every panel of the shipped dashboard is asked for data, and the
autoscaler's Prometheus source reads the service's signals from it.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
import yaml
from harness import ROOT, wait_for
from live_pods import Actuator, Load, autoscaling_operator
from prometheus_process import PROMETHEUS, Prometheus, dashboard_queries

from goodput_operator.autoscaling.signals import History, parse_pod_metrics
from goodput_operator.autoscaling.sources import Endpoints, PrometheusSource

pytestmark = [pytest.mark.slow, pytest.mark.skipif(PROMETHEUS is None, reason="prometheus missing (make prometheus)")]

PERIOD, WINDOW, DOWN_WINDOW = 2.0, 6.0, 6.0
TARGET = 0.9
SERVICE = "live"
SPEC = {
    "model": {"source": "file:///models/tiny", "servedName": "tiny"},
    "resources": {"gpu": 0, "memory": "2Gi"},
    "replicas": 1,
    "slo": {"ttft": "200ms", "tpot": "100ms", "attainment": TARGET},
    "autoscaling": {
        "mode": "goodput",
        "minReplicas": 1,
        "maxReplicas": 3,
        "scaleDownWindow": f"{DOWN_WINDOW:g}s",
        "capacityPerReplica": 500,
    },
}
# admission off: overload shows as a queue and missed TTFTs, which the SLO guard answers (with admission
# on, a quick replica turns the excess away with 429s instead, and they reach the law as arrivals)
RUNTIME_FLAGS = ("--max-num-seqs", "1", "--slo-ttft", "0.2", "--slo-tpot", "0.1", "--admission", "off")


class Run:
    """What the module's one live run recorded."""

    miss_at: float | None = None
    load_stopped_at: float = 0.0
    started: float = 0.0
    ended: float = 0.0


@pytest.fixture(scope="module")
def live(cluster, hub, tmp_path_factory, tiny_model_dir):
    workdir = tmp_path_factory.mktemp("live")
    namespace = f"live-{int(time.time()) % 100000}"
    cluster.core.create_namespace({"metadata": {"name": namespace}})
    operator, metrics_port = autoscaling_operator(cluster, hub, workdir, PERIOD, WINDOW)
    prometheus = Prometheus(workdir, namespace, metrics_port)
    actuator = Actuator(
        cluster, namespace, SERVICE, tiny_model_dir, workdir, RUNTIME_FLAGS, on_targets=prometheus.set_targets
    )
    # long enough answers that seven queued ahead outlast the 0.2 s TTFT target however fast the tiny model
    # steps (at 12 tokens a request took ~20 ms once the runtime tuned its matmuls, and eight clients queued
    # under the target)
    load = Load(actuator, max_tokens=64)
    run = Run()
    try:
        cluster.create_service(namespace, SERVICE, SPEC)
        actuator.start()
        wait_for(lambda: actuator.ready_ports(), 120, "the first runtime pod to be ready")
        run.started = time.time()
        load.set_workers(1)  # light: one client, well inside the SLO
        time.sleep(3 * PERIOD)
        assert [n for _, n in actuator.history] == [1], "light load must not scale"
        load.set_workers(8)  # heavy: one replica serving one sequence at a time queues the rest
        run.miss_at = _watch_for_miss(actuator, stop_when=lambda: len(actuator.history) > 1, timeout=60)
        wait_for(lambda: len(actuator.history) > 1, 30, "a scale-up")
        wait_for(
            lambda: actuator.history[-1][1] == 3 or time.monotonic() - actuator.history[1][0] > 40,
            60,
            "scaling up to settle",
        )
        wait_for(lambda: len(actuator.ready_ports()) == actuator.history[-1][1], 120, "the new pods to be ready")
        time.sleep(2 * PERIOD)
        load.set_workers(0)
        run.load_stopped_at = time.monotonic()
        wait_for(lambda: actuator.history[-1][1] == 1, 90, "scaling back down to 1")
        time.sleep(3)  # a few more scrapes and rule evaluations after the last change
        run.ended = time.time()
        yield cluster, namespace, actuator, prometheus, run, operator
    finally:
        load.set_workers(0)
        actuator.stop()
        prometheus.stop()
        operator.stop()
        cluster.core.delete_namespace(namespace)


def _watch_for_miss(actuator: Actuator, stop_when, timeout: float) -> float | None:
    """When the pods' own counters first show attainment under target over the window, with requests queued."""
    history = History(keep_seconds=WINDOW * 2)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = time.monotonic()
        pods = {}
        for port in actuator.ready_ports():
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                continue
            pods[str(port)] = parse_pod_metrics(text)
        history.add(now, pods)
        signals = history.signals(now, WINDOW, WINDOW)
        if signals and signals.attainment is not None and signals.attainment < TARGET and signals.waiting:
            return now
        if stop_when():
            return None  # the autoscaler saw it before this watcher did
        time.sleep(0.25)
    raise AssertionError("the heavy load never made the service miss its SLO")


def test_scales_up_on_a_missed_slo_and_back_down_one_step_at_a_time(live):
    cluster, namespace, actuator, _, run, operator = live
    counts = [n for _, n in actuator.history]
    peak = max(counts)
    assert counts[0] == 1 and peak >= 2, counts
    top = counts.index(peak)
    assert counts[: top + 1] == sorted(counts[: top + 1]), f"up then down: {counts}"
    assert counts[top:] == list(range(peak, 0, -1)), f"down one replica at a time: {counts}"

    first_up = actuator.history[1][0]
    if run.miss_at is not None:  # None: the operator acted before the test's own watcher saw the miss
        assert first_up - run.miss_at <= 2 * PERIOD + 1.5, (first_up - run.miss_at, operator.log()[-3000:])
    downs = [t for (t, n), (_, before) in zip(actuator.history[1:], actuator.history, strict=False) if n < before]
    # down only once the need stayed under the count for the window, so the peak held at least that long: past
    # the load's end when the peak still missed its SLO, or already under load when the peak met it
    peak_at = actuator.history[top][0]
    assert downs and downs[0] >= peak_at + DOWN_WINDOW - PERIOD, (
        "down only after the window",
        peak_at,
        run.load_stopped_at,
        downs[0],
    )

    events = [e for e in cluster.events(namespace, SERVICE) if e.reason in ("ScaledUp", "ScaledDown")]
    ups = [e.message for e in events if e.reason == "ScaledUp"]
    assert ups and all(("attainment" in m and "requests queued" in m) or "req/s" in m for m in ups), ups
    first = [m for m in ups if m.startswith("1 → 2 replicas")]
    assert len(first) == 1 and "< 0.90 target" in first[0], ups
    down_messages = [e.message for e in events if e.reason == "ScaledDown"]
    assert len(down_messages) == peak - 1 and all("of the planned" in m for m in down_messages), down_messages
    last = cluster.get_service(namespace, SERVICE)["status"]["autoscaler"]["lastDecision"]
    assert (last["from"], last["to"]) == (2, 1) and "would run at" in last["reason"], last


GATEWAY_SERIES = ("goodput_gateway_", "goodput_batch_", "goodput_pipeline_", "goodput_guard_")
# a disaggregated service's rows (its pools, its hand-off): this run's service does not split
SPLIT_SERIES = ("goodput_autoscaler_pool_", "goodput_kv_transfer_")
# the KV offload tier's series: this run's runtimes have no tier; test_kv_dashboard_panels.py runs one
OFFLOAD_SERIES = ("goodput_kv_offload_",)
# peer pulls: this run's runtimes take no part (--kv-transfer-role none); test_peer_pull_dashboard_panels.py
# runs them
PEER_SERIES = ("goodput_kv_transfers_total",)


def _dashboard_queries(namespace: str) -> list[tuple[str, str]]:
    values = {"$namespace": namespace, "$model": "tiny", "$service": SERVICE, "$__rate_interval": "10s"}
    # no gateway in this run; the gateway, batch and pipeline tests ask those panels
    skipped = (*GATEWAY_SERIES, *SPLIT_SERIES, *OFFLOAD_SERIES, *PEER_SERIES)
    out = dashboard_queries(values, lambda expr: not any(series in expr for series in skipped))
    board = json.loads((ROOT / "manifests" / "monitoring" / "goodput-autoscaling.json").read_text())
    for annotation in board["annotations"]["list"]:
        out.append((f"annotation {annotation['name']}", annotation["expr"]))
    return out


def test_every_dashboard_query_and_recording_rule_returns_data(live):
    _, namespace, _, prometheus, run, _ = live
    groups = yaml.safe_load((ROOT / "manifests" / "monitoring" / "prometheus-rule.yaml").read_text())["spec"]["groups"]
    recorded = [(f"rule {r['record']}", r["record"]) for g in groups for r in g["rules"] if "record" in r]
    empty = [
        name
        for name, expr in [*_dashboard_queries(namespace), *recorded]
        if not prometheus.query_range(expr, run.started, run.ended)
    ]
    assert not empty, f"no data for: {empty}"


def _read_from_prometheus(prometheus: Prometheus, namespace: str):
    source = PrometheusSource(f"http://127.0.0.1:{prometheus.port}", window=60, long_window=300)

    async def read():
        try:
            return await source.read((namespace, SERVICE), "tiny", Endpoints(ready=("pod",)), 0.0)
        finally:
            await source.close()

    return asyncio.run(read())


def test_the_prometheus_source_reads_the_same_signals(live):
    """With PROMETHEUS_URL set the loop asks Prometheus instead of the pods: the same service, seen there."""
    _, namespace, _, prometheus, _, _ = live
    reading = _read_from_prometheus(prometheus, namespace)
    assert reading.signals is not None, reading.missing
    s = reading.signals
    assert s.arrival_rate > 0 and s.attainment is not None and 0 <= s.attainment < 1  # the heavy phase missed
    # the p90 itself depends on how much of the 60 s window the heavy phase filled, so only its presence is asked
    assert s.finished_long and s.ttft_p90 is not None and s.ttft_p90 > 0 and s.tpot_p90 is not None
    missing = _read_from_prometheus(prometheus, "elsewhere")
    assert missing.signals is None and "no goodput series" in missing.missing  # held, not read as zero
