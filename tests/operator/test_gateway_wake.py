"""Scale from zero through the gateway, against the real API server with real processes.

A service in goodput mode with minReplicas 0 starts at zero replicas. A request sent to the
gateway is held there; the operator's autoscaler (a real process, 1 s period) reads the held
count from the gateway pod (found as the ready endpoint of the `goodput-gateway` Service in
goodput-system) and scales to one replica at once; live_pods.Actuator plays the kubelet and
starts a runtime process; the held request is answered once it is ready. With no request
for the idle period, the gateway's last-request time lets the autoscaler take it back to zero.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from autoscaling_helpers import host_address, put_endpoint
from gateway_helpers import GatewayProcess, tiny_spec
from harness import OperatorProcess, wait_for
from kubernetes.client.exceptions import ApiException
from live_pods import Actuator

pytestmark = [pytest.mark.apiserver, pytest.mark.gateway, pytest.mark.slow]

IDLE_SECONDS = 6


def counts(actuator: Actuator) -> list[int]:
    return [n for _, n in list(actuator.history)]


def test_a_held_request_wakes_a_service_at_zero_and_idleness_returns_it_there(cluster, hub, namespace,
                                                                               tiny_model_dir, tmp_path):
    try:
        cluster.core.create_namespace({"metadata": {"name": "goodput-system"}})
    except ApiException as err:
        if err.status != 409:
            raise
    gateway = GatewayProcess(cluster.kubeconfig, tmp_path / "gateway.log").start()
    gateway_port = int(gateway.url.rsplit(":", 1)[1])
    put_endpoint(cluster, "goodput-system", "goodput-gateway", "gw-0", host_address(), gateway_port, True)
    operator = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", hub.endpoint,
                               "--autoscaler-period-seconds", "1", "--autoscaler-window-seconds", "3").start()
    actuator = Actuator(cluster, namespace, "sleepy", tiny_model_dir, tmp_path, ())
    try:
        cluster.create_service(namespace, "sleepy", tiny_spec(autoscaling={
            "mode": "goodput", "minReplicas": 0, "maxReplicas": 1, "idlePeriod": f"{IDLE_SECONDS}s"}))
        actuator.start()
        wait_for(lambda: any(m["service"] == "sleepy" for m in gateway.models()), 20, "the gateway to see it")
        time.sleep(3)
        # (the scale subresource of a CR without spec.replicas answers 500 on this server: no history yet)
        assert 1 not in counts(actuator), "nothing wakes a service nobody asked for"

        answers: list[tuple[int, float]] = []

        def ask() -> None:
            started = time.monotonic()
            body = json.dumps({"model": f"{namespace}/tiny", "prompt": "good morning", "max_tokens": 4}).encode()
            request = urllib.request.Request(gateway.url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as r:
                answers.append((r.status, time.monotonic() - started))

        client = threading.Thread(target=ask)
        client.start()
        wait_for(lambda: counts(actuator)[-1:] == [1], 15, "the autoscaler to wake the service")
        client.join(120)
        assert answers and answers[0][0] == 200, gateway.log()[-3000:]
        status = cluster.get_service(namespace, "sleepy")["status"]["autoscaler"]
        assert status["lastDecision"]["from"] == 0 and status["lastDecision"]["to"] == 1
        assert "held at the gateway" in status["lastDecision"]["reason"]
        print(f"cold start seen by the client: {answers[0][1]:.1f} s to the answer")

        wait_for(lambda: counts(actuator)[-2:] == [1, 0], IDLE_SECONDS + 30,
                 "the autoscaler to return the service to zero")
        assert counts(actuator) in ([1, 0], [0, 1, 0])
        reasons = [e.reason for e in cluster.events(namespace, "sleepy")]
        assert "ScaledUp" in reasons and "ScaledDown" in reasons
    finally:
        actuator.stop()
        operator.stop()
        gateway.stop()
        cluster.get_or_none(cluster.raw, "DELETE", "/apis/discovery.k8s.io/v1beta1/namespaces/goodput-system/"
                            "endpointslices/goodput-gateway-gw-0")
