"""A spec that cannot run ends in a clear condition and one Warning Event, not a silent crash loop.

There is no kubelet in this cluster. The tests write a runtime pod's status through the
status subresource the way a kubelet would (containerStatuses in CrashLoopBackOff with
the runtime's termination message, then Ready), standing in for the kubelet; the e2e
tier (tests/e2e) runs the runtime in a real cluster. The pod itself is the one the
Deployment's ReplicaSet created when kube-controller-manager runs, else one made here
with the Deployment's labels.
"""

import time
from datetime import datetime, timedelta, timezone

import pytest
from harness import RUNTIME_IMAGE, Cluster, OperatorProcess, wait_for

SPEC = {"model": {"source": "pvc://models/missing-dir"}, "resources": {"gpu": 0, "memory": "2Gi"}}
CANNOT_SERVE = "Cannot serve /mnt/models/missing-dir: no config.json in the directory"
SELECTOR = "serving.goodput.dev/service={}"


@pytest.fixture(scope="module")
def operator(cluster, hub, tmp_path_factory):
    """No periodic resync to fall back on: a pod change must reach the service through the pod watch."""
    log = tmp_path_factory.mktemp("operator-pods") / "operator.log"
    with OperatorProcess(cluster.kubeconfig, log, hub.endpoint, "--resync-seconds", "3600") as process:
        yield process
    assert "Traceback" not in process.log(), process.log()[-6000:]


def _stamp(seconds_ago: float = 0) -> str:
    return (datetime.now(timezone.utc) - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _runtime_pod(cluster: Cluster, namespace: str, name: str) -> str:
    """The name of one of the service's runtime pods."""
    deployment = cluster.wait_deployment(namespace, name)
    if cluster.has_controllers:
        pods = wait_for(
            lambda: cluster.core.list_namespaced_pod(namespace, label_selector=SELECTOR.format(name)).items,
            what="the ReplicaSet's pod",
        )
        return str(pods[0].metadata.name)
    template = deployment.spec.template
    pod = cluster.core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"generateName": f"{name}-runtime-", "labels": template.metadata.labels},
            "spec": {"containers": [{"name": "runtime", "image": RUNTIME_IMAGE}]},
        },
    )
    return str(pod.metadata.name)


def _kubelet_writes(cluster: Cluster, namespace: str, pod: str, containers: list[dict], ready: bool) -> None:
    """Pod status as a kubelet reports it, through the status subresource."""
    now = _stamp()
    flag = "True" if ready else "False"
    status = {
        "phase": "Running",
        "conditions": [
            {"type": t, "status": s, "lastTransitionTime": now}
            for t, s in (("PodScheduled", "True"), ("Initialized", "True"), ("ContainersReady", flag), ("Ready", flag))
        ],
        "containerStatuses": containers,
        "startTime": now,
    }
    cluster.core.patch_namespaced_pod_status(pod, namespace, {"status": status})


def _crash_looping(restarts: int) -> dict:
    return {
        "name": "runtime",
        "image": RUNTIME_IMAGE,
        "imageID": "",
        "ready": False,
        "restartCount": restarts,
        "started": False,
        "state": {
            "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container=runtime"}
        },
        "lastState": {
            "terminated": {
                "exitCode": 1,
                "reason": "Error",
                "message": CANNOT_SERVE + "\n",
                "startedAt": _stamp(5),
                "finishedAt": _stamp(1),
            }
        },
    }


def _serving() -> dict:
    return {
        "name": "runtime",
        "image": RUNTIME_IMAGE,
        "imageID": "",
        "ready": True,
        "restartCount": 4,
        "started": True,
        "state": {"running": {"startedAt": _stamp()}},
    }


def _warnings(cluster: Cluster, namespace: str, name: str, reason: str) -> list:
    return [e for e in cluster.events(namespace, name) if e.type == "Warning" and e.reason == reason]


def test_a_crash_looping_runtime_is_reported_once_and_clears_when_it_serves(cluster, operator, namespace):
    """The pod's CrashLoopBackOff and termination message reach Available and Ready, with one Event."""
    cluster.create_service(namespace, "broken", SPEC)
    cluster.wait_condition(namespace, "broken", "Valid", "True")
    pod = _runtime_pod(cluster, namespace, "broken")

    _kubelet_writes(cluster, namespace, pod, [_crash_looping(restarts=3)], ready=False)
    expected = f"pod {pod}: runtime exited 1 (3 restarts): {CANNOT_SERVE}"
    available = wait_for(
        lambda: (c := cluster.condition(namespace, "broken", "Available")) and c["reason"] == "RuntimeFailing" and c,
        30,
        "Available=False RuntimeFailing",
    )
    assert (available["status"], available["message"]) == ("False", expected)
    ready = cluster.condition(namespace, "broken", "Ready")
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "RuntimeFailing", expected)
    out = cluster.kubectl("get", "gsvc", "broken", "-n", namespace, "-o", "wide").stdout
    assert "RuntimeFailing" in out and CANNOT_SERVE in out
    (event,) = wait_for(lambda: _warnings(cluster, namespace, "broken", "RuntimeFailing"), 30, "a Warning Event")
    assert event.message == expected
    assert event.involved_object.kind == "InferenceService"

    # More restarts of the same failure, and a touch of the service itself: every one a reconcile;
    # the message follows the restart count, the Event is not posted again.
    for restarts in (4, 5, 6):
        _kubelet_writes(cluster, namespace, pod, [_crash_looping(restarts)], ready=False)
        wait_for(
            lambda n=restarts: f"({n} restarts)" in cluster.condition(namespace, "broken", "Available")["message"],
            30,
            f"the restart count {restarts} to follow",
        )
    cluster.patch_service(namespace, "broken", {"metadata": {"annotations": {"touched": "yes"}}})
    time.sleep(3)
    assert len(_warnings(cluster, namespace, "broken", "RuntimeFailing")) == 1

    _kubelet_writes(cluster, namespace, pod, [_serving()], ready=True)
    if cluster.has_controllers:  # the ReplicaSet and Deployment controllers count the ready pod
        available = cluster.wait_condition(namespace, "broken", "Available", "True")
        assert (available["reason"], available["message"]) == ("MinimumReplicasAvailable", "1/1 replicas ready")
        cluster.wait_condition(namespace, "broken", "Ready", "True")
    else:
        wait_for(
            lambda: cluster.condition(namespace, "broken", "Available")["reason"] == "ReplicasNotReady",
            30,
            "the failure to clear",
        )
    assert len(_warnings(cluster, namespace, "broken", "RuntimeFailing")) == 1


def test_an_image_that_cannot_be_pulled_is_named(cluster, operator, namespace):
    """ImagePullBackOff as a kubelet reports it becomes ImagePullFailed with the kubelet's message."""
    cluster.create_service(namespace, "nopull", SPEC)
    pod = _runtime_pod(cluster, namespace, "nopull")
    waiting = {
        "name": "runtime",
        "image": RUNTIME_IMAGE,
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "started": False,
        "state": {"waiting": {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{RUNTIME_IMAGE}"'}},
    }
    _kubelet_writes(cluster, namespace, pod, [waiting], ready=False)
    available = wait_for(
        lambda: (c := cluster.condition(namespace, "nopull", "Available")) and c["reason"] == "ImagePullFailed" and c,
        30,
        "Available=False ImagePullFailed",
    )
    assert available["message"] == (
        f'pod {pod}: cannot pull image {RUNTIME_IMAGE} (ImagePullBackOff): Back-off pulling image "{RUNTIME_IMAGE}"'
    )
    wait_for(lambda: _warnings(cluster, namespace, "nopull", "ImagePullFailed"), 30, "a Warning Event")


def test_the_operator_writes_nothing_to_pods(cluster, operator, namespace):
    """Pods are watched with an event handler only: no finalizer, no kopf annotations."""
    cluster.create_service(namespace, "quiet", SPEC)
    pod = _runtime_pod(cluster, namespace, "quiet")
    _kubelet_writes(cluster, namespace, pod, [_crash_looping(restarts=1)], ready=False)
    cluster.wait_condition(namespace, "quiet", "Available", "False")
    wait_for(
        lambda: cluster.condition(namespace, "quiet", "Available")["reason"] == "RuntimeFailing",
        30,
        "the pod to be seen",
    )
    live = cluster.core.read_namespaced_pod(pod, namespace)
    assert not live.metadata.finalizers
    assert not [k for k in (live.metadata.annotations or {}) if "kopf" in k or "goodput" in k]
    managers = {f.manager for f in live.metadata.managed_fields or ()}
    assert not any("kopf" in m or "goodput" in m for m in managers), managers
