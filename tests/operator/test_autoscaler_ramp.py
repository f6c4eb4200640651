"""Live proof of the forecast: a ramp of arrivals is met before the SLO breaks.

As in test_autoscaler_live.py, the operator runs as a real process against the real API
server and the service's "pods" are real `python -m goodput_runtime` processes on the tiny
model, started and published by live_pods.Actuator as the replica count the autoscaler writes
asks. Here each new pod becomes ready no sooner than BOOT seconds after it is asked for
(standing in for a GPU pod's scheduling, image pull and weight load, which the test cluster,
having no kubelet, cannot have), so a replica asked for only once the SLO breaks comes far
too late.

One replica's service time S is measured first on a runtime of its own (one sequence at a
time, so its capacity is about 1/S requests per second); the service is told 0.9/S as its
starting capacity (the law goes on learning it; the simulator proves learning it from
nothing, which takes minutes of evidence). Open-loop Poisson arrivals hold at 0.3/S, then
rise linearly to 1.4/S, beyond what one replica serves at all. The test asserts that the first
scale-up came from the forecast term while one replica still met its SLO, that the second
replica was serving before the arrivals outgrew one replica, and that attainment over the whole
ramp met the target. The figures are written to the test's log (`-s` shows them).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import pytest
from autoscaling_helpers import free_port
from harness import OperatorProcess, wait_for
from live_pods import Actuator, OpenLoad, Pod

from goodput_operator.autoscaling.signals import History, parse_pod_metrics

pytestmark = [pytest.mark.apiserver, pytest.mark.slow]

PERIOD, WINDOW = 2.0, 10.0
BOOT = 20.0  # seconds from a pod asked for to a pod that may serve, before the runtime's own start
TARGET = 0.9
SERVICE = "ramp"
HOLD, RAMP, TOP = 30.0, 100.0, 20.0  # seconds at the low rate, rising, and at the top
LOW, HIGH = 0.3, 1.4  # arrival rates, in units of one replica's 1/S
BODY = {"model": "tiny", "prompt": "the quick brown fox jumps over the lazy dog " * 4, "max_tokens": 24,
        "ignore_eos": True}
RUNTIME_FLAGS = ("--max-num-seqs", "1", "--slo-ttft", "0.5", "--slo-tpot", "0.1", "--admission", "off")


def _post(port: int) -> float:
    started = time.monotonic()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(BODY).encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=30).read()
    return time.monotonic() - started


def service_time(model_dir, workdir) -> float:
    """One request's median time on a replica of its own, one after another (nothing queued)."""
    pod = Pod("calibration", model_dir, workdir / "calibration.log", RUNTIME_FLAGS)
    try:
        wait_for(pod.poll_ready, 120, "the calibration runtime to be ready")
        for _ in range(5):
            _post(pod.port)
        return statistics.median(_post(pod.port) for _ in range(30))
    finally:
        pod.stop()


@dataclass
class Watch:
    """The pods' own counters, scraped every half second: the SLO as the service saw it."""

    actuator: Actuator
    timeline: list[tuple[float, float | None, int]] = field(default_factory=list)  # (time, attainment, ready)
    totals: dict[str, tuple[float, float]] = field(default_factory=dict)  # per pod: (good, finished) latest
    first_two_ready: float | None = None

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._history = History(keep_seconds=WINDOW * 2)
        self._thread = threading.Thread(target=self._run, daemon=True, name="watch")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            pods = {}
            for pod in list(self.actuator.pods):
                if not pod.ready:
                    continue
                try:
                    text = urllib.request.urlopen(f"http://127.0.0.1:{pod.port}/metrics", timeout=2).read().decode()
                except OSError:
                    continue
                pods[pod.name] = sample = parse_pod_metrics(text)
                self.totals[pod.name] = (sample.good, sample.requests)
            if len(pods) >= 2 and self.first_two_ready is None:
                self.first_two_ready = now
            self._history.add(now, pods)
            signals = self._history.signals(now, WINDOW, WINDOW)
            self.timeline.append((now, signals.attainment if signals else None, len(pods)))
            self._stop.wait(0.5)

    def good_and_finished(self) -> tuple[float, float]:
        return sum(g for g, _ in self.totals.values()), sum(n for _, n in self.totals.values())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_a_ramp_is_met_before_the_slo_breaks(cluster, hub, tmp_path, tiny_model_dir):
    s = service_time(tiny_model_dir, tmp_path)
    capacity = 0.9 / s
    namespace = f"ramp-{int(time.time()) % 100000}"
    cluster.core.create_namespace({"metadata": {"name": namespace}})
    operator = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", hub.endpoint,
                               "--metrics-port", str(free_port()), "--autoscaler-period-seconds", str(PERIOD),
                               "--autoscaler-window-seconds", str(WINDOW)).start()
    actuator = Actuator(cluster, namespace, SERVICE, tiny_model_dir, tmp_path, RUNTIME_FLAGS, boot_seconds=BOOT)

    def rate(t: float) -> float:
        rising = min(1.0, max(0.0, (t - HOLD) / RAMP))
        return (LOW + (HIGH - LOW) * rising) / s

    load = None
    watch = None
    try:
        cluster.create_service(namespace, SERVICE, {
            "model": {"source": "file:///models/tiny", "servedName": "tiny"},
            "resources": {"gpu": 0, "memory": "2Gi"}, "replicas": 1,
            "slo": {"ttft": "500ms", "tpot": "100ms", "attainment": TARGET},
            "autoscaling": {"mode": "goodput", "minReplicas": 1, "maxReplicas": 3, "scaleDownWindow": "120s",
                            "capacityPerReplica": round(capacity, 3)}})
        actuator.start()
        wait_for(lambda: actuator.ready_ports(), BOOT + 120, "the first runtime pod to be ready")
        watch = Watch(actuator)
        load = OpenLoad(actuator, rate, BODY).start()
        time.sleep(HOLD + RAMP + TOP)
    finally:
        if load is not None:
            load.stop()
        if watch is not None:
            watch.stop()
        actuator.stop()
        operator.stop()
    start = load.started
    ordered = sorted(cluster.events(namespace, SERVICE), key=lambda e: e.first_timestamp or e.event_time)
    events = [e.message for e in ordered if e.reason == "ScaledUp"]
    cluster.core.delete_namespace(namespace)

    saturation = 1 / s  # the arrival rate one replica cannot serve at all
    ups = [(t, n) for (t, n), (_, before) in zip(actuator.history[1:], actuator.history, strict=False) if n > before]
    assert ups and events, (actuator.history, operator.log()[-3000:])
    first_up = ups[0][0]
    before_up = [a for t, a, _ in watch.timeline if start + HOLD <= t <= first_up and a is not None]
    good, finished = watch.good_and_finished()
    answered = [x for x in load.sent if x.status == 200]
    ramp_attainment = good / max(finished, 1)
    figures = {
        "service_time_s": round(s, 4), "capacity_hint_rps": round(capacity, 2), "boot_s": BOOT,
        "ramp_rps": [round(LOW / s, 2), round(HIGH / s, 2)], "ramp_s": RAMP,
        "first_scale_up_after_ramp_start_s": round(first_up - start - HOLD, 1),
        "rate_at_first_scale_up_rps": round(rate(first_up - start), 2),
        "rate_at_first_scale_up_share_of_one_replica": round(rate(first_up - start) * s, 2),
        "second_replica_ready_after_ramp_start_s":
            None if watch.first_two_ready is None else round(watch.first_two_ready - start - HOLD, 1),
        "rate_when_second_replica_ready_share_of_one_replica":
            None if watch.first_two_ready is None else round(rate(watch.first_two_ready - start) * s, 2),
        "min_window_attainment_before_first_up": round(min(before_up), 3) if before_up else None,
        "attainment_whole_run": round(ramp_attainment, 4), "requests_finished": int(finished),
        "requests_sent": len(load.sent), "requests_answered": len(answered),
        "replicas": [n for _, n in actuator.history], "scale_ups": events,
    }
    print("ramp figures:", json.dumps(figures, indent=1))
    (tmp_path / "figures.json").write_text(json.dumps(figures, indent=1))
    assert "rising" in events[0], ("the first scale-up came from the forecast", events)
    assert rate(first_up - start) < saturation, figures
    assert before_up and min(before_up) >= TARGET, ("one replica still met the SLO when the forecast acted", figures)
    assert watch.first_two_ready is not None and rate(watch.first_two_ready - start) < saturation, figures
    assert ramp_attainment >= TARGET, figures
    assert len(answered) == len(load.sent), "every request sent was answered"
