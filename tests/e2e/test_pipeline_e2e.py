"""An InferencePipeline on a real node: over a real runtime pod, one request refused, one served.

`kubectl apply -k manifests/` installed both CRDs, the operator and the gateway. A pipeline
names a service that does not exist yet, so its Ready condition names it; then the service
comes up (a runtime pod on the tiny model), the pipeline turns Ready, and requests sent to the
gateway's ClusterIP with `model: <pipeline>` are guarded: one carrying a card number is refused
with OpenAI's content_filter error, an ordinary one is answered by the pod.
"""

from __future__ import annotations

import http.client
import json
from typing import Any

from node import OPERATOR_NAMESPACE, Node, cluster_ip, condition, wait_for

SERVICE, PIPELINE = "piped", "guarded"
READY_SECONDS = 300


def post(host: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection(host, 80, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def listed(host: str) -> dict[str, Any]:
    conn = http.client.HTTPConnection(host, 80, timeout=10)
    conn.request("GET", "/v1/models")
    return {m["id"]: m for m in json.loads(conn.getresponse().read())["data"]}


def test_a_pipeline_over_a_real_pod_refuses_one_request_and_serves_another(installed: Node, models: Any) -> None:
    node = installed
    host = cluster_ip(node, "goodput-gateway", OPERATOR_NAMESPACE)
    node.apply(
        {
            "apiVersion": "serving.goodput.dev/v1alpha1",
            "kind": "InferencePipeline",
            "metadata": {"name": PIPELINE},
            "spec": {
                "steps": [
                    {
                        "name": "input-rules",
                        "kind": "guard",
                        "rules": {"pii": [{"type": "card"}, {"type": "email", "action": "redact"}]},
                    },
                    {"kind": "template", "system": "Answer briefly."},
                    {"kind": "generate", "service": SERVICE, "defaults": {"maxTokens": 8, "temperature": 0}},
                    {"kind": "guard", "stage": "output", "rules": {"maxLength": 2000}},
                ]
            },
        }
    )
    try:
        wait_for(
            lambda: condition(node.get("inferencepipeline", PIPELINE), "Ready").get("reason") == "ServiceNotFound",
            60,
            "the pipeline to name its missing service",
        )
        assert f"'{SERVICE}'" in condition(node.get("inferencepipeline", PIPELINE), "Ready")["message"]
        node.apply(
            {
                "apiVersion": "serving.goodput.dev/v1alpha1",
                "kind": "InferenceService",
                "metadata": {"name": SERVICE},
                "spec": {
                    "model": {
                        "source": "pvc://models/tiny",
                        "servedName": SERVICE,
                        "maxModelLen": 256,
                        "dtype": "float32",
                    },
                    "resources": {"gpu": 0, "cpu": "250m", "memory": "1Gi"},
                    "slo": {"ttft": "5s", "tpot": "1s"},
                },
            }
        )
        wait_for(
            lambda: condition(node.get("inferencepipeline", PIPELINE), "Ready").get("status") == "True",
            READY_SECONDS,
            "the pipeline to be Ready",
            explain=lambda: node.describe(),
        )
        wait_for(lambda: listed(host).get(PIPELINE, {}).get("ready") is True, 60, "the gateway to serve it")

        status, body = post(
            host, {"model": PIPELINE, "messages": [{"role": "user", "content": "my card is 4111 1111 1111 1111"}]}
        )
        assert status == 400, body
        assert body["error"]["code"] == "content_filter" and "pii-card" in body["error"]["message"]
        assert "4111" not in body["error"]["message"]

        status, body = post(host, {"model": PIPELINE, "messages": [{"role": "user", "content": "good morning"}]})
        assert status == 200, body
        assert body["model"] == PIPELINE and body["usage"]["completion_tokens"] == 8
        logs = node.kubectl(
            "logs", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/name=goodput-gateway", "--tail=-1", check=False
        ).stdout
        assert "4111" not in logs
    finally:
        node.kubectl("delete", "inferencepipeline", PIPELINE, "--wait=false", check=False)
        node.kubectl("delete", "inferenceservice", SERVICE, "--wait=false", check=False)
