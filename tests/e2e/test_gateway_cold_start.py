"""One endpoint on a real node: a service at zero answers through the gateway after a cold start.

`kubectl apply -k manifests/` installed the gateway beside the operator. A service in goodput
mode with minReplicas 0 has no pod; a chat completion sent to the gateway's ClusterIP is held
there, the operator reads the held request from the gateway pods and scales the service to one
replica, the kubelet starts it, and the answer comes back. With no further request the
service returns to zero after its idle period.
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

from node import OPERATOR_NAMESPACE, Node, cluster_ip, condition, wait_for

NAME = "sleepy"
IDLE = 20  # seconds
PERIOD = 15  # the operator's autoscaler period, as manifests/operator.yaml leaves it


def gateway_ready(node: Node) -> bool:
    pods = node.get("pods", namespace=OPERATOR_NAMESPACE, selector="app.kubernetes.io/name=goodput-gateway") or []
    ready = [
        p for p in pods if condition(p, "Ready").get("status") == "True" and not p["metadata"].get("deletionTimestamp")
    ]
    return len(ready) == 2


def listed(host: str) -> dict[str, Any]:
    conn = http.client.HTTPConnection(host, 80, timeout=10)
    conn.request("GET", "/v1/models")
    return {m["id"]: m for m in json.loads(conn.getresponse().read())["data"]}


def replicas(node: Node) -> int:
    deploy = node.get("deployment", f"{NAME}-runtime")
    return int((deploy or {}).get("spec", {}).get("replicas", -1))


def test_a_service_at_zero_answers_through_the_gateway_after_a_cold_start(installed: Node, models: Any) -> None:
    node = installed
    wait_for(
        lambda: gateway_ready(node),
        300,
        "both gateway pods to be Ready",
        explain=lambda: node.describe(OPERATOR_NAMESPACE),
    )
    host = cluster_ip(node, "goodput-gateway", OPERATOR_NAMESPACE)
    node.apply(
        {
            "apiVersion": "serving.goodput.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": NAME},
            "spec": {
                "model": {"source": "pvc://models/tiny", "servedName": NAME, "maxModelLen": 256, "dtype": "float32"},
                "resources": {"gpu": 0, "cpu": "250m", "memory": "1Gi"},
                "autoscaling": {"mode": "goodput", "minReplicas": 0, "maxReplicas": 1, "idlePeriod": f"{IDLE}s"},
            },
        }
    )
    try:
        wait_for(lambda: listed(host).get(NAME, {}).get("replicas") == 0, 60, "the gateway to list the service")
        wait_for(lambda: replicas(node) == 0, 60, "the Deployment at zero")

        started = time.monotonic()
        conn = http.client.HTTPConnection(host, 80, timeout=600)
        body = json.dumps(
            {"model": NAME, "messages": [{"role": "user", "content": "good morning"}], "max_tokens": 8, "stream": True}
        )
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()[:300]
        first = response.readline()
        first_byte = time.monotonic() - started
        rest = response.read().decode()
        assert first.startswith(b"data: ") and rest.rstrip().endswith("data: [DONE]")
        print(f"cold start through the gateway: first byte after {first_byte:.1f} s")
        events = [e for e in node.get("events") or [] if e["involvedObject"]["name"] == NAME]
        assert any(e["reason"] == "ScaledUp" and "held at the gateway" in e["message"] for e in events), events

        wait_for(
            lambda: replicas(node) == 0,
            IDLE + 4 * PERIOD + 30,
            "the service to return to zero",
            explain=lambda: json.dumps(node.get("inferenceservice", NAME).get("status"), indent=1),
        )
    finally:
        node.kubectl("delete", "inferenceservice", NAME, "--wait=false", check=False)
