"""`kubectl apply` an InferenceService on a real node and get pods that serve, roll and heal.

The tests run in file order and share one service, `chat`, as a user would: install,
apply, query, change the spec while a client keeps sending, delete a pod, delete the service.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any

import openai
import pytest
from node import OPERATOR_NAMESPACE, RUNTIME_IMAGE, Node, chat, cluster_ip, condition, wait_for

NAME = "chat"
READY_SECONDS = 300
ROLL_SECONDS = 300


def service_manifest(name: str, source: str, max_num_seqs: int = 8) -> dict[str, Any]:
    return {
        "apiVersion": "serving.goodput.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},  # in the kubeconfig's namespace, the tests' own
        "spec": {
            "model": {"source": source, "servedName": name, "maxModelLen": 256, "dtype": "float32"},
            "engine": {"maxNumSeqs": max_num_seqs, "maxBatchedTokens": 256},
            "resources": {"gpu": 0, "cpu": "250m", "memory": "1Gi"},
            "slo": {"ttft": "2s", "tpot": "200ms"},
        },
    }


def runtime_pods(node: Node, name: str) -> list[dict[str, Any]]:
    pods = node.get("pods", selector=f"serving.goodput.dev/service={name}") or []
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def ready_pods(node: Node, name: str) -> list[dict[str, Any]]:
    return [p for p in runtime_pods(node, name) if condition(p, "Ready").get("status") == "True"]


def service_ready(node: Node, name: str) -> bool:
    return condition(node.get("inferenceservice", name), "Ready").get("status") == "True"


@pytest.fixture(scope="module")
def chat_service(installed: Node, models: dict[str, Any]) -> Node:
    installed.apply(service_manifest(NAME, "pvc://models/tiny"))
    wait_for(
        lambda: service_ready(installed, NAME),
        READY_SECONDS,
        "InferenceService chat to report Ready=True",
        explain=installed.describe,
    )
    return installed


def test_operator_runs_in_its_pod_with_its_own_service_account(installed: Node) -> None:
    pods = installed.get("pods", namespace=OPERATOR_NAMESPACE, selector="app.kubernetes.io/name=goodput-operator")
    pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]  # not a restarted one on its way out
    assert len(pods) == 1
    pod = pods[0]
    assert pod["status"]["phase"] == "Running"
    assert pod["spec"]["serviceAccountName"] == "goodput-operator"
    assert condition(pod, "Ready")["status"] == "True"
    # the operator reached the API server from inside the pod: its startup log says so
    logs = installed.kubectl("logs", "-n", OPERATOR_NAMESPACE, pod["metadata"]["name"]).stdout
    assert "Traceback" not in logs, logs[-3000:]


def test_applied_service_becomes_ready_and_streams_through_its_cluster_ip(chat_service: Node) -> None:
    node = chat_service
    pods = ready_pods(node, NAME)
    assert len(pods) == 1, node.describe()
    ip = cluster_ip(node, NAME)
    client = openai.OpenAI(base_url=f"http://{ip}/v1", api_key="unused", timeout=60)
    stream = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hello there"}], max_tokens=12, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) >= 2, pieces  # streamed, not one blob
    assert "".join(pieces).strip()

    listing = node.kubectl("get", "gsvc", NAME).stdout.splitlines()
    header, row = listing[0].split(), listing[1].split()
    columns = dict(zip(header, row, strict=False))
    assert columns["MODEL"] == "pvc://models/tiny"
    assert columns["REPLICAS"] == "1" and columns["READY"] == "1"
    assert columns["STATUS"] == "Serving"


def test_a_pod_reaches_the_service_through_its_cluster_ip(chat_service: Node) -> None:
    node = chat_service
    ip = cluster_ip(node, NAME)
    script = (
        "import json, urllib.request\n"
        f"body = json.dumps({{'model': '{NAME}', 'stream': True, 'max_tokens': 8,"
        " 'messages': [{'role': 'user', 'content': 'hi'}]}).encode()\n"
        f"req = urllib.request.Request('http://{ip}/v1/chat/completions', body,"
        " {'Content-Type': 'application/json'})\n"
        "with urllib.request.urlopen(req, timeout=60) as r:\n"
        "    events = [line for line in r.read().decode().splitlines() if line.startswith('data: ')]\n"
        "print(json.dumps({'events': len(events), 'done': events[-1] == 'data: [DONE]'}))\n"
    )
    node.kubectl("delete", "pod", "e2e-client", "--ignore-not-found", "--wait=true")
    node.kubectl(
        "run",
        "e2e-client",
        f"--image={RUNTIME_IMAGE}",
        "--image-pull-policy=Never",
        "--restart=Never",
        "--command",
        "--",
        "python3",
        "-c",
        script,
    )
    try:
        wait_for(
            lambda: (node.get("pod", "e2e-client") or {}).get("status", {}).get("phase") in ("Succeeded", "Failed"),
            120,
            "the client pod to finish",
            explain=node.describe,
        )
        pod = node.get("pod", "e2e-client")
        logs = node.kubectl("logs", "e2e-client").stdout
        assert pod["status"]["phase"] == "Succeeded", logs
        result = json.loads(logs.strip().splitlines()[-1])
        assert result["done"] and result["events"] >= 3, result
    finally:
        node.kubectl("delete", "pod", "e2e-client", "--ignore-not-found", "--wait=false")


class SteadyClient:
    """Sends one chat completion after another over a keep-alive connection, counting failures."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self.host, 80, timeout=60)
        while not self._stop.is_set():
            try:
                chat(self.host, NAME, "steady", max_tokens=4, conn=conn)
                self.ok += 1
            except Exception as exc:  # every kind of failure is what this client counts
                self.failures.append(f"{time.strftime('%H:%M:%S')} {type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection(self.host, 80, timeout=60)
            time.sleep(0.05)
        conn.close()

    def __enter__(self) -> SteadyClient:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=90)


def test_new_max_num_seqs_rolls_the_pod_without_failed_requests(chat_service: Node) -> None:
    node = chat_service
    (old_pod,) = ready_pods(node, NAME)
    with SteadyClient(cluster_ip(node, NAME)) as client:
        wait_for(lambda: client.ok >= 5, 60, "the steady client's first answers")
        node.apply(service_manifest(NAME, "pvc://models/tiny", max_num_seqs=4))

        def rolled() -> bool:
            pods = runtime_pods(node, NAME)
            return (
                len(pods) == 1
                and pods[0]["metadata"]["name"] != old_pod["metadata"]["name"]
                and condition(pods[0], "Ready").get("status") == "True"
                and node.get("pod", old_pod["metadata"]["name"]) is None
            )

        wait_for(rolled, ROLL_SECONDS, "the roll to a new pod and the old pod's exit", explain=node.describe)
        answered_at_roll = client.ok
        wait_for(lambda: client.ok >= answered_at_roll + 5, 60, "answers from the new pod")
    assert client.failures == [], client.failures[:10]
    assert client.ok >= 10
    (new_pod,) = ready_pods(node, NAME)
    args = new_pod["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "4"


def test_a_deleted_pod_comes_back_and_serves(chat_service: Node) -> None:
    node = chat_service
    (pod,) = ready_pods(node, NAME)
    node.kubectl("delete", "pod", pod["metadata"]["name"], "--wait=false")
    wait_for(
        lambda: [p for p in ready_pods(node, NAME) if p["metadata"]["name"] != pod["metadata"]["name"]],
        READY_SECONDS,
        "a replacement pod to become Ready",
        explain=node.describe,
    )
    answer = chat(cluster_ip(node, NAME), NAME, "are you back?")
    assert answer["choices"][0]["message"]["content"]
    wait_for(lambda: service_ready(node, NAME), 60, "Ready=True again")


@pytest.mark.parametrize(
    ("name", "source", "expected"),
    [
        ("missing-path", "pvc://models/no-such-model", "no-such-model"),
        ("unknown-arch", "pvc://models/unknown-arch", "GPTNeoXForCausalLM"),
        (
            "unreadable",
            "pvc://models/unreadable",
            "model.safetensors in /mnt/models/unreadable as uid 1000: permission",
        ),
    ],
)
def test_a_spec_that_cannot_run_says_why_in_a_condition_and_an_event(
    installed: Node, models: dict[str, Any], name: str, source: str, expected: str
) -> None:
    node = installed
    node.apply(service_manifest(name, source))
    try:

        def failing() -> dict[str, Any] | None:
            ready = condition(node.get("inferenceservice", name), "Ready")
            return ready if ready.get("status") == "False" and expected in ready.get("message", "") else None

        ready = wait_for(failing, READY_SECONDS, f"{name}: Ready=False naming {expected!r}", explain=node.describe)
        assert ready["reason"] == "RuntimeFailing", ready
        events = node.get("events") or []
        warnings = [
            e
            for e in events
            if e["involvedObject"].get("kind") == "InferenceService"
            and e["involvedObject"].get("name") == name
            and e.get("type") == "Warning"
        ]
        assert any(expected in e.get("message", "") for e in warnings), [e.get("message") for e in warnings]
        listing = node.kubectl("get", "gsvc", name).stdout
        assert "RuntimeFailing" in listing, listing
    finally:
        node.kubectl("delete", "inferenceservice", name, "--wait=false")


def test_deleting_the_service_removes_its_deployment_service_and_pods(chat_service: Node) -> None:
    node = chat_service
    node.kubectl("delete", "inferenceservice", NAME, "--wait=true", timeout=180)
    wait_for(
        lambda: node.get("deployment", f"{NAME}-runtime") is None and node.get("service", NAME) is None,
        120,
        "the Deployment and Service to be garbage collected",
        explain=node.describe,
    )
    wait_for(
        lambda: not (node.get("pods", selector=f"serving.goodput.dev/service={NAME}") or []),
        180,
        "the runtime pods to go",
        explain=node.describe,
    )
