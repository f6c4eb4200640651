"""Scale from zero through the gateway, against the real API server with real processes.

A service in goodput mode with minReplicas 0 starts at zero replicas. A request sent to the
gateway is held there; the operator's autoscaler (a real process, 1 s period) reads the held
count from the gateway pod (found as the ready endpoint of the `goodput-gateway` Service in
goodput-system) and scales to one replica at once; live_pods.Actuator plays the kubelet and
starts a runtime process; the held request is answered once it is ready. With no request
for the idle period, the gateway's last-request time lets the autoscaler take it back to zero.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from autoscaling_helpers import delete_endpoint, host_address, put_endpoint
from gateway_helpers import GatewayProcess, Started, tiny_spec
from harness import OperatorProcess, wait_for
from kubernetes.client.exceptions import ApiException
from live_pods import Actuator

pytestmark = pytest.mark.slow

IDLE_SECONDS = 6


@contextlib.contextmanager
def woken_by_gateway(
    cluster, hub, tmp_path, namespace: str, service: str, spec: dict, model_dir, *gateway_args: str
) -> Iterator[tuple[GatewayProcess, Actuator]]:
    """A gateway published as the ready endpoint of goodput-system/goodput-gateway, an operator whose
    autoscaler reads it every second, and `service` created from `spec` with an actuator playing the
    kubelet for it; once the gateway lists the service."""
    try:
        cluster.core.create_namespace({"metadata": {"name": "goodput-system"}})
    except ApiException as err:
        if err.status != 409:
            raise
    with Started() as started:
        gateway = started.gateway(cluster.kubeconfig, tmp_path / "gateway.log", *gateway_args)
        gateway_port = int(gateway.url.rsplit(":", 1)[1])
        put_endpoint(cluster, "goodput-system", "goodput-gateway", "gw-0", host_address(), gateway_port, True)
        started.callback(delete_endpoint, cluster, "goodput-system", "goodput-gateway", "gw-0")
        started.stops(
            OperatorProcess(
                cluster.kubeconfig,
                tmp_path / "operator.log",
                hub.endpoint,
                "--autoscaler-period-seconds",
                "1",
                "--autoscaler-window-seconds",
                "3",
            ).start()
        )
        actuator = Actuator(cluster, namespace, service, model_dir, tmp_path, ())
        cluster.create_service(namespace, service, spec)
        started.stops(actuator.start())
        wait_for(lambda: any(m["service"] == service for m in gateway.models()), 20, "the gateway to see it")
        yield gateway, actuator


def counts(actuator: Actuator) -> list[int]:
    return [n for _, n in list(actuator.history)]


def test_a_held_request_wakes_a_service_at_zero_and_idleness_returns_it_there(
    cluster, hub, namespace, tiny_model_dir, tmp_path
):
    spec = tiny_spec(
        autoscaling={"mode": "goodput", "minReplicas": 0, "maxReplicas": 1, "idlePeriod": f"{IDLE_SECONDS}s"}
    )
    with woken_by_gateway(cluster, hub, tmp_path, namespace, "sleepy", spec, tiny_model_dir) as (gateway, actuator):
        time.sleep(3)
        # (the scale subresource of a CR without spec.replicas answers 500 on this server: no history yet)
        assert 1 not in counts(actuator), "nothing wakes a service nobody asked for"

        answers: list[tuple[int, float]] = []

        def ask() -> None:
            started = time.monotonic()
            body = json.dumps({"model": f"{namespace}/tiny", "prompt": "good morning", "max_tokens": 4}).encode()
            request = urllib.request.Request(
                gateway.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
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

        wait_for(
            lambda: counts(actuator)[-2:] == [1, 0], IDLE_SECONDS + 30, "the autoscaler to return the service to zero"
        )
        assert counts(actuator) in ([1, 0], [0, 1, 0])
        reasons = [e.reason for e in cluster.events(namespace, "sleepy")]
        assert "ScaledUp" in reasons and "ScaledDown" in reasons


def test_pending_batch_lines_wake_a_service_to_its_batch_replicas_and_it_returns_to_zero(
    cluster, hub, namespace, tiny_model_dir, tmp_path
):
    # spec.batch.maxReplicas 2: a batch submitted to a service at zero wakes it to two replicas (none of
    # which online traffic asked for), they run the batch, and idleness takes the service back to zero
    spec = tiny_spec(
        autoscaling={
            "mode": "goodput",
            "minReplicas": 0,
            "maxReplicas": 3,
            "idlePeriod": f"{IDLE_SECONDS}s",
            "scaleDownWindow": "3s",
        },
        batch={"maxReplicas": 2},
    )
    database = f"sqlite:///{tmp_path}/batch.db"
    with woken_by_gateway(
        cluster, hub, tmp_path, namespace, "nightly", spec, tiny_model_dir, "--database", database
    ) as (gateway, actuator):
        time.sleep(2)
        assert 1 not in counts(actuator) and 2 not in counts(actuator)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        lines = "".join(
            json.dumps(
                {
                    "custom_id": f"n-{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"model": f"{namespace}/tiny", "prompt": f"line {i}", "max_tokens": 6},
                }
            )
            + "\n"
            for i in range(40)
        )
        batch_file = client.files.create(file=("in.jsonl", io.BytesIO(lines.encode())), purpose="batch")
        batch = client.batches.create(input_file_id=batch_file.id, endpoint="/v1/completions", completion_window="24h")
        wait_for(lambda: 2 in counts(actuator), 20, "the autoscaler to give the batch its two replicas")
        status = cluster.get_service(namespace, "nightly")["status"]["autoscaler"]
        assert status["lastDecision"]["from"] == 0 and status["lastDecision"]["to"] == 2
        assert "batch lines pending" in status["lastDecision"]["reason"]
        wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", 120, "the batch to complete")
        done = client.batches.retrieve(batch.id)
        assert done.request_counts.completed == 40, gateway.log()[-3000:]
        assert max(counts(actuator)) == 2  # batch work got what spec.batch.maxReplicas allows, no more
        wait_for(lambda: counts(actuator)[-1:] == [0], IDLE_SECONDS + 40, "the autoscaler to return it to zero")
        assert counts(actuator)[-3:] == [2, 1, 0]  # one replica at a time, the last by idleness
