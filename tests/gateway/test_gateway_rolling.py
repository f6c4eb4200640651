"""A rolling replacement of every replica, seen through the gateway under steady load, loses no request.

As a Deployment with maxSurge 1 and maxUnavailable 0 does it: a new runtime process starts
and is published ready, then an old one gets SIGTERM (it keeps serving for its shutdown
delay, then drains) and, half a second later, as the EndpointSlice controller would, its
endpoint turns not ready and then goes. One old replica stops admitting at once (503),
the other serves through a shutdown delay as the operator's pods do.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from autoscaling_helpers import delete_endpoint
from gateway_helpers import Started, metric, publish, tiny_spec, wait_ready
from harness import wait_for

pytestmark = pytest.mark.slow

# the first old replica stops admitting at once (503 until its endpoint goes: the gateway retries those
# elsewhere); the second keeps serving for its shutdown delay, as the operator's pods do
FLAGS = [("--shutdown-delay", "0", "--shutdown-grace", "10"), ("--shutdown-delay", "2", "--shutdown-grace", "10")]
CLIENTS = 4


class SteadyLoad:
    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(CLIENTS)]

    def start(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def _work(self, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            body = json.dumps(
                {"model": self.model, "prompt": f"client {index} request {n}", "max_tokens": 8, "ignore_eos": True}
            ).encode()
            request = urllib.request.Request(
                self.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as r:
                    json.loads(r.read())
                    self.ok += 1
            except urllib.error.HTTPError as err:
                self.failures.append(f"{err.code} {err.read()[:300]!r}")
            except OSError as err:
                self.failures.append(repr(err))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def test_rolling_replacement_under_load_loses_no_request(cluster, namespace, tiny_model_dir, tmp_path):
    cluster.create_service(namespace, "roll", tiny_spec(replicas=2))
    with Started() as started:
        old = [started.replica(f"old{i}", tiny_model_dir, tmp_path, *FLAGS[i]) for i in range(2)]
        new = [started.replica(f"new{i}", tiny_model_dir, tmp_path, *FLAGS[1]) for i in range(2)]
        wait_ready(*old, *new)
        for pod in old:
            publish(cluster, namespace, "roll", pod.name, pod.port)
        gateway = started.gateway(cluster.kubeconfig, tmp_path / "gateway.log")
        model = f"{namespace}/tiny"

        def ready_count() -> int:
            return next(m["ready_replicas"] for m in gateway.models() if m["namespace"] == namespace)

        wait_for(lambda: ready_count() == 2, 20, "both old replicas")
        load = started.stops(SteadyLoad(gateway.url, model).start())
        time.sleep(2)
        for old_pod, new_pod in zip(old, new, strict=True):
            publish(cluster, namespace, "roll", new_pod.name, new_pod.port)  # surge: the new one is ready first
            wait_for(lambda: ready_count() == 3, 10, f"{new_pod.name} in the gateway")
            time.sleep(1)
            old_pod.process.terminate()
            time.sleep(0.5)
            publish(cluster, namespace, "roll", old_pod.name, old_pod.port, ready=False, terminating=True)
            assert old_pod.process.wait(30) == 0
            delete_endpoint(cluster, namespace, "roll", old_pod.name)
            time.sleep(1)
        served_before = sum(metric(f"http://127.0.0.1:{p.port}", "goodput_requests_total") for p in new)
        time.sleep(2)
        load.stop()
        served_after = sum(metric(f"http://127.0.0.1:{p.port}", "goodput_requests_total") for p in new)
        assert not load.failures, load.failures[:5]
        assert load.ok > 20
        assert served_after > served_before, "after the rollout the new replicas serve"
        assert gateway.metric("goodput_gateway_routing_decisions_total", namespace=namespace, decision="retry") >= 1
