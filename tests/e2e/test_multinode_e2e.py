"""A replica spanning pods on the real node, on CPU with gloo, through the gateway.

Three services run the tiny random-weight model: `single`, one pod per replica, and `spread`, with
`parallelism: {tensor: 2, nodes: 2}`: each of its two replicas is a group of two pods (a
StatefulSet `spread-runtime-<i>`, pod -0 the leader that serves HTTP, pod -1 a worker holding the
other tensor-parallel rank), meeting at the ClusterIP of the group's leader Service; and `staged`,
with `parallelism: {pipeline: 2, nodes: 2}`: two replicas of two pods, one pipeline stage each
(one decoder layer of the tiny model's two), passing activations between them. The node is
one machine, so both pods of a group run on it: the operator places a group's pods with no
anti-affinity (one pod per node comes from each pod asking for a node's GPUs), which is what
lets a one-node cluster run a group at all.

What a user would see is asserted:

- greedy answers through the gateway are the same from `spread` and from `staged` as from `single`;
- only the leaders are ready endpoints (a worker never takes requests), and `status.placement`
  names the StatefulSet mode;
- the worker pod of one group deleted under a steady load, for `spread` (its tensor-parallel rank)
  and for `staged` (its second stage): its leader exits (the group restarts as a unit), the gateway
  sends what failed before the client got a byte to the other group, so no non-streamed request
  fails, the group comes back, and the service's status and Events say which pod failed and why.
"""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
from faults import SteadyLoad, gateway_pods, gateway_retries
from node import OPERATOR_NAMESPACE, Node, cluster_ip, condition, wait_for

pytestmark = pytest.mark.slow

SINGLE, SPREAD, STAGED = "single", "spread", "staged"
READY_SECONDS = 300
PROMPTS = ("The river ran past the mill", "count to five", "hello")


def service_spec(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.goodput.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "pvc://models/tiny", "servedName": name, "maxModelLen": 256, "dtype": "float32"},
            "engine": {"maxNumSeqs": 8, "maxBatchedTokens": 256},
            "resources": {"gpu": 0, "cpu": "100m", "memory": "1Gi"},  # 7 pods on a 2-core node
            "autoscaling": {"mode": "none"},
            **extra,
        },
    }


def pods_of(node: Node, name: str) -> list[dict[str, Any]]:
    pods = node.get("pods", selector=f"serving.goodput.dev/service={name}") or []
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def ready(pod: dict[str, Any]) -> bool:
    return condition(pod, "Ready").get("status") == "True"


def service_ready(node: Node, name: str, replicas: int) -> bool:
    svc = node.get("inferenceservice", name) or {}
    return condition(svc, "Ready").get("status") == "True" and svc.get("status", {}).get("readyReplicas") == replicas


def answer(client: openai.OpenAI, model: str, prompt: str) -> str:
    result = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return result.choices[0].message.content or ""


def restarts(pod: dict[str, Any] | None) -> int:
    return sum(c.get("restartCount", 0) for c in ((pod or {}).get("status") or {}).get("containerStatuses") or ())


@pytest.fixture(scope="module")
def spread(installed: Node, models: dict[str, Any]) -> Any:
    node = installed
    wait_for(
        lambda: len(gateway_pods(node)) == 2,
        READY_SECONDS,
        "both gateway pods to be Ready",
        explain=lambda: node.describe(OPERATOR_NAMESPACE),
    )
    started = time.monotonic()
    node.apply(
        [
            service_spec(SINGLE, replicas=1),
            service_spec(SPREAD, replicas=2, parallelism={"tensor": 2, "nodes": 2}),
            service_spec(STAGED, replicas=2, parallelism={"pipeline": 2, "nodes": 2}),
        ]
    )
    try:
        wait_for(
            lambda: (
                service_ready(node, SINGLE, 1) and service_ready(node, SPREAD, 2) and service_ready(node, STAGED, 2)
            ),
            READY_SECONDS,
            "one Ready replica of single, two Ready groups of spread and two of staged",
            explain=node.describe,
        )
        print(f"the three services Ready {time.monotonic() - started:.0f} s after they were applied")
        host = cluster_ip(node, "goodput-gateway", OPERATOR_NAMESPACE)
        client = openai.OpenAI(base_url=f"http://{host}/v1", api_key="none", max_retries=0, timeout=120)
        wait_for(lambda: bool(answer(client, SPREAD, "warm up")), 120, "a first answer from spread")
        wait_for(lambda: bool(answer(client, SINGLE, "warm up")), 120, "a first answer from single")
        wait_for(lambda: bool(answer(client, STAGED, "warm up")), 120, "a first answer from staged")
        yield node, client, f"http://{host}/v1"
    finally:
        node.kubectl("delete", "inferenceservice", SINGLE, SPREAD, STAGED, "--wait=false", check=False)


def test_a_replica_of_two_pods_answers_as_one_pod_does(spread: Any) -> None:
    node, client, _ = spread
    status = node.get("inferenceservice", SPREAD)["status"]
    assert status["placement"] == {"mode": "StatefulSet", "podsPerReplica": 2, "ranksPerPod": 1}
    pods = {p["metadata"]["name"]: p for p in pods_of(node, SPREAD)}
    assert sorted(pods) == ["spread-runtime-0-0", "spread-runtime-0-1", "spread-runtime-1-0", "spread-runtime-1-1"]
    # the leaders are the service's ready endpoints; a worker is running but never ready
    assert sorted(name for name, pod in pods.items() if ready(pod)) == ["spread-runtime-0-0", "spread-runtime-1-0"]
    assert all(pods[f"spread-runtime-{i}-1"]["status"]["phase"] == "Running" for i in (0, 1))
    assert len({p["spec"]["nodeName"] for p in pods.values()}) == 1  # both pods of each group on the one node
    leader_log = node.kubectl("logs", "spread-runtime-0-0", "--tail=-1").stdout
    assert "Pod 1 of 2 joined the group" in leader_log, leader_log[-2000:]

    for prompt in PROMPTS:
        one_pod, two_pods = answer(client, SINGLE, prompt), answer(client, SPREAD, prompt)
        assert two_pods == one_pod and one_pod, (prompt, one_pod, two_pods)


def test_a_replica_of_two_pipeline_stages_answers_as_one_pod_does(spread: Any) -> None:
    node, client, _ = spread
    status = node.get("inferenceservice", STAGED)["status"]
    assert status["placement"] == {"mode": "StatefulSet", "podsPerReplica": 2, "ranksPerPod": 1}
    pods = {p["metadata"]["name"]: p for p in pods_of(node, STAGED)}
    # each replica: stage 0 with the leader, stage 1
    assert sorted(pods) == ["staged-runtime-0-0", "staged-runtime-0-1", "staged-runtime-1-0", "staged-runtime-1-1"]
    assert [name for name, pod in sorted(pods.items()) if ready(pod)] == ["staged-runtime-0-0", "staged-runtime-1-0"]
    for prompt in PROMPTS:
        one_pod, two_stages = answer(client, SINGLE, prompt), answer(client, STAGED, prompt)
        assert two_stages == one_pod and one_pod, (prompt, one_pod, two_stages)


# the staged group's worker deleted (its second pipeline stage) restarts the group as the spread one's does, by the
# same StatefulSet and leader exit: `make test-extended` only, for time (about 50 s)
@pytest.mark.parametrize("name", [SPREAD, pytest.param(STAGED, marks=pytest.mark.extended)])
def test_the_worker_pod_deleted_restarts_its_group_and_loses_no_request(spread: Any, name: str) -> None:
    node, client, base_url = spread
    leader, worker = f"{name}-runtime-0-0", f"{name}-runtime-0-1"
    leader_restarts = restarts(node.get("pod", leader))
    old_uid = node.get("pod", worker)["metadata"]["uid"]
    retried_before = gateway_retries(node, node.namespace, name)
    told: list[str] = []  # what the service's Available condition said while the group was down
    with SteadyLoad(base_url, name) as load:
        wait_for(lambda: load.answered >= 10, 120, "the steady load's first answers")
        node.kubectl("delete", "pod", worker, "--grace-period=1", "--wait=false")
        deleted = time.monotonic()

        def leader_restarted() -> bool:
            message = condition(node.get("inferenceservice", name), "Available").get("message", "")
            if "exited" in message:
                told.append(message)
            return restarts(node.get("pod", leader)) > leader_restarts

        wait_for(leader_restarted, 60, "the group's leader to exit and restart", explain=node.describe)
        exited = time.monotonic() - deleted

        def recovered() -> bool:
            leader_restarted()
            new = node.get("pod", worker)
            return bool(new and new["metadata"]["uid"] != old_uid and service_ready(node, name, 2))

        wait_for(recovered, READY_SECONDS, "the group back: two Ready groups", explain=node.describe)
        back = time.monotonic() - deleted
        at_recovery = load.answered
        wait_for(lambda: load.answered >= at_recovery + 6, 120, "answers after the group came back")
    retried = gateway_retries(node, node.namespace, name) - retried_before
    print(
        f"worker deleted: leader restarted after {exited:.1f} s, group Ready again after {back:.1f} s; "
        f"{load.answered} answered, {len(load.failed)} failed, gateway retries {dict(retried)}"
    )
    # a non-streamed request gets its first byte with its whole answer: the gateway can always send it on
    assert not [o for o in load.failed if not o.stream], [o.error for o in load.failed]
    # a stream may fail only once tokens reached the client, and then with an error, never cut short silently
    assert all(o.chunks > 0 and o.error for o in load.failed), [(o.chunks, o.error) for o in load.failed]
    # the answers are still the one-pod service's
    assert answer(client, name, PROMPTS[0]) == answer(client, SINGLE, PROMPTS[0])

    # the story: the leader's exit, told on the service (Available's message, a Warning Event)
    events = node.get("events", selector="") or []
    failing = [
        e
        for e in events
        if e.get("involvedObject", {}).get("name") == name
        and e.get("reason") == "RuntimeFailing"
        and leader in e.get("message", "")
    ]
    assert failing, [(e.get("reason"), e.get("message")) for e in events if e["involvedObject"].get("name") == name]
    assert "exited 1" in failing[-1]["message"], failing[-1]["message"]
    said = [m for m in told if f"pod {leader}: runtime exited 1" in m]
    assert said, told
    print(f"Available said: {said[-1]}\nWarning Event RuntimeFailing: {failing[-1]['message']}")
    # once the group serves again the story is over: a worker is never ready, yet its old crash is not told on
    wait_for(
        lambda: condition(node.get("inferenceservice", name), "Available").get("message") == "2/2 replicas ready",
        60,
        "Available to say no more of the crash once the group serves",
        explain=lambda: str(condition(node.get("inferenceservice", name), "Available")),
    )
