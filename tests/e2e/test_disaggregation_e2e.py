"""Disaggregated prefill and decode on the real node, through the gateway.

One InferenceService with `spec.disaggregation` runs the tiny random-weight model as two roles: the
Deployment `split-runtime` decodes (behind the Service `split`) and `split-prefill` prefills (behind
`split-prefill`). Clients of the official `openai` SDK talk to the gateway's ClusterIP. What a user
would see is asserted:

- a long prompt takes the `disaggregated` path (prefill pod, then a KV hand-off over tcp to the
  decode pod) and answers exactly what the decode pod answers computing the prompt itself;
- a short prompt, under the threshold, takes the `local` path;
- the prefill pod deleted under a steady load of long prompts loses no request: each one goes on
  along `fallback` or `local` while the prefill role is gone, and along `disaggregated` once it is back.

The paths are read from the gateway pods' `goodput_gateway_disaggregation_total`.
"""

from __future__ import annotations

import re
import threading
import urllib.request
from collections import Counter
from typing import Any

import openai
import pytest
from faults import gateway_pods
from node import OPERATOR_NAMESPACE, Node, cluster_ip, condition, wait_for

pytestmark = pytest.mark.slow

NAME = "split"
READY_SECONDS = 300
THRESHOLD = 32  # tokens: two blocks of the runtime's 16
STORY = "The river ran past the mill, the bakery and the old stone bridge before it reached the sea. "


def long_prompt(n: int) -> str:
    return f"Request {n}. " + STORY * 8  # well past the threshold; each begins differently


def paths(node: Node) -> Counter[str]:
    """goodput_gateway_disaggregation_total for the service by path, summed over the gateway pods."""
    total: Counter[str] = Counter()
    for pod in gateway_pods(node):
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8000/metrics", timeout=10) as response:
            text = response.read().decode()
        for line in text.splitlines():
            match = re.match(r"^goodput_gateway_disaggregation_total\{(.*)\} (\S+)$", line)
            if match and f'namespace="{node.namespace}"' in match[1] and f'service="{NAME}"' in match[1]:
                path = re.search(r'path="([^"]*)"', match[1])
                total[path[1] if path else ""] += int(float(match[2]))
    return total


def ready_pods(node: Node, role: str) -> list[dict[str, Any]]:
    pods = node.get("pods", selector=f"serving.goodput.dev/service={NAME},serving.goodput.dev/role={role}") or []
    return [
        p for p in pods if not p["metadata"].get("deletionTimestamp") and condition(p, "Ready").get("status") == "True"
    ]


def both_roles_ready(node: Node) -> bool:
    return len(ready_pods(node, "prefill")) == 1 and len(ready_pods(node, "decode")) == 1


def answer(client: openai.OpenAI, prompt: str) -> str:
    result = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return result.choices[0].message.content or ""


@pytest.fixture(scope="module")
def split(installed: Node, models: dict[str, Any]) -> Any:
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
                "model": {"source": "pvc://models/tiny", "servedName": NAME, "maxModelLen": 512, "dtype": "float32"},
                "engine": {"maxNumSeqs": 8, "maxBatchedTokens": 512},
                "resources": {"gpu": 0, "cpu": "250m", "memory": "1Gi"},
                "replicas": 1,
                "autoscaling": {"mode": "none"},
                "disaggregation": {
                    "prefill": {"minReplicas": 1, "maxReplicas": 1},
                    "decode": {"minReplicas": 1, "maxReplicas": 1},
                    "threshold": THRESHOLD,
                    "transport": "tcp",
                },
            },
        }
    )
    wait_for(lambda: both_roles_ready(node), READY_SECONDS, "a Ready pod in each role", explain=node.describe)
    host = cluster_ip(node, "goodput-gateway", OPERATOR_NAMESPACE)
    client = openai.OpenAI(base_url=f"http://{host}/v1", api_key="none", max_retries=0, timeout=120)
    # the gateway lists the service and its prefill Service's endpoints before the first request counts
    wait_for(lambda: bool(answer(client, "warm up")), 120, "a first answer through the gateway")
    try:
        yield node, client
    finally:
        node.kubectl("delete", "inferenceservice", NAME, "--wait=false", check=False)


def test_a_long_prompt_is_handed_off_and_a_short_one_served_whole(split: Any) -> None:
    node, client = split
    before = paths(node)
    prompt = long_prompt(0)
    handed_off = answer(client, prompt)
    after_long = paths(node)
    assert after_long["disaggregated"] == before["disaggregated"] + 1, (before, after_long)
    # the decode pod computing the same prompt itself answers the same greedy tokens
    decode_ip = ready_pods(node, "decode")[0]["status"]["podIP"]
    direct = openai.OpenAI(base_url=f"http://{decode_ip}:8000/v1", api_key="none", max_retries=0, timeout=120)
    assert answer(direct, prompt) == handed_off
    answer(client, "hi")
    after_short = paths(node)
    assert after_short["local"] == after_long["local"] + 1, (after_long, after_short)
    status = (node.get("inferenceservice", NAME) or {}).get("status", {})
    roles = status.get("disaggregation", {})
    assert roles.get("prefill", {}).get("readyReplicas") == 1 and roles.get("decode", {}).get("readyReplicas") == 1


def test_the_prefill_pod_deleted_under_load_loses_no_request(split: Any) -> None:
    node, client = split
    before = paths(node)
    failures: list[str] = []
    answered = [0]
    stop = threading.Event()
    lock = threading.Lock()

    def run(worker: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                answer(client, long_prompt(1000 * (worker + 1) + n))
                with lock:
                    answered[0] += 1
            except openai.OpenAIError as err:
                with lock:
                    failures.append(f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: answered[0] >= 6, 180, "the load's first answers")
        victim = ready_pods(node, "prefill")[0]["metadata"]["name"]
        node.kubectl("delete", "pod", victim, "--grace-period=1", "--wait=false")
        deleted_at = answered[0]
        wait_for(
            lambda: (
                victim not in [p["metadata"]["name"] for p in ready_pods(node, "prefill")] and both_roles_ready(node)
            ),
            READY_SECONDS,
            "a new prefill pod Ready",
            explain=node.describe,
        )
        recovered = paths(node)["disaggregated"]
        wait_for(lambda: paths(node)["disaggregated"] > recovered, 180, "hand-offs through the new prefill pod")
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    after = paths(node)
    served_whole = (after["fallback"] - before["fallback"]) + (after["local"] - before["local"])
    print(
        f"prefill pod deleted after {deleted_at} answers: {answered[0]} answered, {len(failures)} failed; "
        f"paths {dict(after - before)}"
    )
    assert not failures, failures
    assert served_whole > 0, "no request was served whole while the prefill role was gone"
