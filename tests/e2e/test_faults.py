"""Faults on the real node, under a steady load through the gateway: a runtime pod deleted, a runtime
process killed, the kubelet killed and restarted.

One service, `faulty`, runs two replicas of the tiny random-weight model; three clients of the
official `openai` SDK (no client-side retries) send greedy chat completions to the gateway's
ClusterIP, before, through and after each fault. What a user would see is asserted: no request
fails where the gateway could carry it on. A request whose replica went before the client got a byte
is retried elsewhere; a stream already under way is resumed on the other replica from the token ids
it has seen, so the client's stream goes on. The service returns to two Ready replicas.

Each test prints one `FAULT-ROW {json}` line, which bench/faults.py collects into its table.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
from datetime import datetime, timezone
from typing import Any

import pytest
from faults import (
    SteadyLoad,
    gateway_pods,
    gateway_retries,
    kill_runtime_process,
    report,
    restart_component,
    serving_pod,
)
from node import OPERATOR_NAMESPACE, Node, cluster_ip, condition, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.slow]

NAME = "faulty"
READY_SECONDS = 300


# how long after an endpoint turns ready in the API kube-proxy may still route as before
PROXY_SYNC_SECONDS = 3.0


def ready_pods(node: Node) -> list[dict[str, Any]]:
    pods = node.get("pods", selector=f"serving.goodput.dev/service={NAME}") or []
    return [
        p for p in pods if not p["metadata"].get("deletionTimestamp") and condition(p, "Ready").get("status") == "True"
    ]


def service_ready(node: Node, replicas: int) -> bool:
    svc = node.get("inferenceservice", NAME) or {}
    return (
        condition(svc, "Ready").get("status") == "True"
        and svc.get("status", {}).get("readyReplicas") == replicas
        and len(ready_pods(node)) == replicas
    )


@pytest.fixture(scope="module")
def faulty(installed: Node, models: dict[str, Any]) -> Any:
    node = installed
    wait_for(
        lambda: len(gateway_pods(node)) == 2,
        READY_SECONDS,
        "both gateway pods to be Ready",
        explain=lambda: node.describe(OPERATOR_NAMESPACE),
    )
    node.apply(
        {
            "apiVersion": "serving.goodput.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": NAME},
            "spec": {
                "model": {"source": "pvc://models/tiny", "servedName": NAME, "maxModelLen": 256, "dtype": "float32"},
                "engine": {"maxNumSeqs": 8, "maxBatchedTokens": 256},
                "resources": {"gpu": 0, "cpu": "250m", "memory": "1Gi"},
                "replicas": 2,
                "autoscaling": {"mode": "none"},
            },
        }
    )
    wait_for(lambda: service_ready(node, 2), READY_SECONDS, "two Ready replicas of faulty", explain=node.describe)
    base_url = f"http://{cluster_ip(node, 'goodput-gateway', OPERATOR_NAMESPACE)}/v1"
    yield node, base_url
    node.kubectl("delete", "inferenceservice", NAME, "--wait=false", check=False)


def check_losses(load: SteadyLoad) -> None:
    """What a replica lost under greedy requests may cost a client: nothing. A non-streamed request gets its
    first byte only with its whole answer, so the gateway can always send it elsewhere; a stream under way
    is resumed on another replica; a client is never left with an error or a short answer."""
    assert not load.failed, [(o.stream, o.chunks, o.error) for o in load.failed]


def test_a_runtime_pod_deleted_under_streams_loses_none_each_stream_goes_on_elsewhere(faulty: Any) -> None:
    node, base_url = faulty
    retried_before = gateway_retries(node, node.namespace, NAME)
    with SteadyLoad(base_url, NAME, max_tokens=128, streamed_only=True) as load:
        wait_for(lambda: load.answered >= 6, 120, "the streams' first answers")
        victim = serving_pod(ready_pods(node))["metadata"]["name"]  # a replica with streams under way
        # a second's grace, shorter than the pod's preStop delay: its streams under way either end before the
        # pod goes or are resumed on the other replica (the run's retry_reasons say which); none may fail
        node.kubectl("delete", "pod", victim, "--grace-period=1", "--wait=false")
        deleted = time.monotonic()
        wait_for(
            lambda: victim not in [p["metadata"]["name"] for p in ready_pods(node)] and service_ready(node, 2),
            READY_SECONDS,
            "a replacement pod and two Ready replicas again",
            explain=node.describe,
        )
        converged = time.monotonic() - deleted
        at_convergence = load.answered
        wait_for(lambda: load.answered >= at_convergence + 6, 120, "answers after the replacement")
    by_reason = gateway_retries(node, node.namespace, NAME) - retried_before
    retried = by_reason.total()
    check_losses(load)
    report(
        {
            "fault": "runtime pod deleted (1 s grace) under greedy streams (128 tokens), 2 replicas behind the gateway",
            "tier": "e2e",
            "requests": len(load.outcomes),
            "failed": len(load.failed),
            "retried": retried,
            "converge_s": round(converged, 1),
            "retry_reasons": dict(by_reason),
            "errors": sorted({o.error for o in load.failed}),
        }
    )


def test_a_runtime_process_killed_under_steady_load_is_retried_by_the_gateway(faulty: Any) -> None:
    node, base_url = faulty
    retried_before = gateway_retries(node, node.namespace, NAME)
    with SteadyLoad(base_url, NAME, max_tokens=24) as load:
        wait_for(lambda: load.answered >= 10, 120, "the steady load's first answers")
        victim = serving_pod(ready_pods(node))  # a replica with requests in flight, for them to meet the crash
        restarts = victim["status"]["containerStatuses"][0]["restartCount"]
        kill_runtime_process(node, victim)  # a crash: no SIGTERM, no drain, the endpoint still listed
        killed = time.monotonic()

        def restarted() -> bool:
            pod = node.get("pod", victim["metadata"]["name"]) or {}
            statuses = pod.get("status", {}).get("containerStatuses") or [{}]
            return statuses[0].get("restartCount", 0) > restarts and service_ready(node, 2)

        wait_for(
            restarted, READY_SECONDS, "the container restarted and two Ready replicas again", explain=node.describe
        )
        converged = time.monotonic() - killed
        at_convergence = load.answered
        wait_for(lambda: load.answered >= at_convergence + 10, 120, "answers after the restart")
    by_reason = gateway_retries(node, node.namespace, NAME) - retried_before
    retried = by_reason.total()
    check_losses(load)
    assert retried > 0, "no request met the dead replica: the gateway retried or resumed nothing"
    report(
        {
            "fault": "runtime process SIGKILLed (a crash) under steady load, 2 replicas behind the gateway",
            "tier": "e2e",
            "requests": len(load.outcomes),
            "failed": len(load.failed),
            "retried": retried,
            "converge_s": round(converged, 1),
            "retry_reasons": dict(by_reason),
            "errors": sorted({o.error for o in load.failed}),
        }
    )


def test_a_connection_to_the_service_range_that_no_endpoint_takes_is_refused(faulty: Any) -> None:
    """An address of the service range that kube-proxy sends nowhere is refused on the node, as a
    Service without endpoints is: a client retries a refusal at once, while a packet let out by the
    default route could be answered by anything there (on the development machine an egress proxy
    answers any address's port 80 with an empty 404, which a client would read as the gateway's)."""
    node, _ = faulty
    services = json.loads(node.kubectl("get", "services", "--all-namespaces", "-o", "json").stdout)["items"]
    taken = {svc["spec"].get("clusterIP") for svc in services}
    network = ipaddress.ip_network(os.environ.get("GOODPUT_SERVICE_CIDR", "10.0.0.0/24"))
    free = next(str(ip) for ip in reversed(list(network.hosts())) if str(ip) not in taken)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((free, 80), timeout=10).close()


def test_the_kubelet_restarting_leaves_the_pods_serving(faulty: Any) -> None:
    """The runtime pods keep serving through the kubelet's restart: a client talking to one pod
    straight at its IP loses nothing, and no container restarts. Through the gateway's Service
    a client may meet a short gap: a restarted kubelet (1.20 as later ones) reports every pod
    with a readiness probe not ready until that probe next runs, so for a moment the gateway's own Service has no
    ready endpoint and kube-proxy refuses the connection. Such a request failed before any byte,
    with a connection error the client can retry at once, and only in that window."""
    node, base_url = faulty
    pods = ready_pods(node)
    before = {p["metadata"]["uid"]: [c["restartCount"] for c in p["status"]["containerStatuses"]] for p in pods}
    direct_url = f"http://{pods[0]['status']['podIP']}:8000/v1"
    retried_before = gateway_retries(node, node.namespace, NAME)
    with SteadyLoad(base_url, NAME) as load, SteadyLoad(direct_url, NAME, clients=1) as direct:
        wait_for(lambda: load.answered >= 10 and direct.answered >= 5, 120, "the steady loads' first answers")
        node_name = pods[0]["spec"]["nodeName"]
        killed_at = datetime.now(timezone.utc).replace(microsecond=0)
        killed = time.monotonic()
        restart_component(node, "kubelet", signal="KILL", pause=5)
        restarted = time.monotonic()

        def node_ready() -> bool:
            """The new kubelet has posted the node's status (a heartbeat after the kill), and both runtime pods
            and both gateway pods (the Service the load goes through) are Ready."""
            ready = condition(node.get("node", node_name), "Ready")
            beat = datetime.fromisoformat(ready.get("lastHeartbeatTime", "1970-01-01T00:00:00Z").replace("Z", "+00:00"))
            return (
                ready.get("status") == "True"
                and beat > killed_at
                and service_ready(node, 2)
                and len(gateway_pods(node)) == 2
            )

        wait_for(node_ready, 180, "the node Ready again", explain=node.describe)
        converged = time.monotonic() - restarted
        # a pod Ready in the API reaches kube-proxy's iptables rules a moment later (one run saw a connection
        # refused 75 ms after both runtime pods read Ready, with a gateway pod not yet ready behind the Service)
        settled = time.monotonic() + PROXY_SYNC_SECONDS
        at_convergence = load.answered
        wait_for(lambda: load.answered >= at_convergence + 20, 120, "answers after the kubelet's restart")
    by_reason = gateway_retries(node, node.namespace, NAME) - retried_before
    retried = by_reason.total()
    assert not direct.failed, [o.error for o in direct.failed]
    # on this 2-core node a pod's readiness probe can time out once more while the new kubelet settles;
    # what must not happen is a replaced pod or a restarted container
    wait_for(lambda: service_ready(node, 2), 120, "both pods Ready again", explain=node.describe)
    after = {
        p["metadata"]["uid"]: [c["restartCount"] for c in p["status"]["containerStatuses"]] for p in ready_pods(node)
    }
    assert after == before, f"the kubelet's restart replaced or restarted runtime containers\n{node.describe()}"
    for o in load.failed:
        # a connection refused while the gateway's Service has no ready endpoint, before any byte, only
        # while the kubelet restarts (docs/reliability.md)
        assert o.chunks == 0 and o.error.startswith("APIConnectionError"), (o.chunks, o.error)
        assert killed <= o.at <= settled, f"a request failed outside the kubelet's restart: {o.error}"
    gap = (max(o.at for o in load.failed) - min(o.at for o in load.failed)) if load.failed else 0.0
    report(
        {
            "fault": "kubelet SIGKILL, 5 s down, restarted, under steady load",
            "tier": "e2e",
            "requests": len(load.outcomes) + len(direct.outcomes),
            "failed": len(load.failed),
            "retried": retried,
            "converge_s": round(converged, 1),
            "direct_to_pod": len(direct.outcomes),
            "refused_window_s": round(gap, 1),
            "retry_reasons": dict(by_reason),
            "errors": sorted({o.error for o in load.failed}),
        }
    )
