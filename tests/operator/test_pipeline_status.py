"""InferencePipeline status from the operator: Ready follows the services a pipeline calls.

There is no kubelet in this cluster: to make a service Ready the test writes its runtime
pod's status the way a kubelet would (Ready), and the Deployment controller, the operator
and then the pipeline's status follow.
"""

from datetime import datetime, timezone

import pytest
from harness import Cluster, wait_for
from pipeline_helpers import create_pipeline, install_pipeline_crd, pipeline_condition

SERVICE = {
    "model": {"source": "file:///models/tiny", "servedName": "chat-model"},
    "resources": {"gpu": 0, "memory": "2Gi"},
}
STEPS = [
    {"name": "rules", "kind": "guard", "rules": {"pii": [{"type": "email"}]}},
    {"kind": "generate", "service": "chat"},
]


@pytest.fixture(scope="module")
def pipeline_crd(cluster):
    install_pipeline_crd(cluster)


def ready_is(cluster, namespace, name, status, reason):
    def check():
        c = pipeline_condition(cluster, namespace, name, "Ready")
        return c if c and (c["status"], c["reason"]) == (status, reason) else None

    return wait_for(check, 60, f"pipeline {name} Ready={status} ({reason})")


def kubelet_says_ready(cluster: Cluster, namespace: str, service: str) -> None:
    pods = wait_for(
        lambda: (
            cluster.core.list_namespaced_pod(namespace, label_selector=f"serving.goodput.dev/service={service}").items
        ),
        what="the ReplicaSet's pod",
    )
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    cluster.core.patch_namespaced_pod_status(
        pods[0].metadata.name,
        namespace,
        {
            "status": {
                "phase": "Running",
                "startTime": now,
                "conditions": [
                    {"type": t, "status": "True", "lastTransitionTime": now}
                    for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
                ],
                "containerStatuses": [
                    {
                        "name": "runtime",
                        "image": "x",
                        "imageID": "",
                        "ready": True,
                        "restartCount": 0,
                        "started": True,
                        "state": {"running": {"startedAt": now}},
                    }
                ],
            }
        },
    )


def test_ready_names_a_missing_service_then_follows_it_to_ready(cluster, pipeline_crd, operator, namespace):
    create_pipeline(cluster, namespace, "chat-guarded", STEPS)
    missing = ready_is(cluster, namespace, "chat-guarded", "False", "ServiceNotFound")
    assert "InferenceService 'chat' not found" in missing["message"]
    table = cluster.kubectl("get", "gpipe", "-n", namespace).stdout
    assert table.split("\n")[0].split() == ["NAME", "STEPS", "READY", "STATUS", "AGE"]
    assert "guard:input,generate" in table and "ServiceNotFound" in table

    cluster.create_service(namespace, "chat", SERVICE)
    waiting = ready_is(cluster, namespace, "chat-guarded", "False", "ServiceNotReady")
    assert "'chat'" in waiting["message"]
    if not cluster.has_controllers:
        pytest.skip("no kube-controller-manager: the Deployment never counts a ready pod")
    kubelet_says_ready(cluster, namespace, "chat")
    cluster.wait_condition(namespace, "chat", "Ready", "True")
    ready_is(cluster, namespace, "chat-guarded", "True", "Serving")
    status = cluster.custom.get_namespaced_custom_object(
        "serving.goodput.dev", "v1alpha1", namespace, "inferencepipelines", "chat-guarded"
    )["status"]
    assert status["services"] == [{"name": "chat", "ready": True}]

    cluster.custom.delete_namespaced_custom_object(
        "serving.goodput.dev", "v1alpha1", namespace, "inferenceservices", "chat"
    )
    ready_is(cluster, namespace, "chat-guarded", "False", "ServiceNotFound")


def test_a_spec_the_schema_cannot_check_is_not_valid_naming_the_field(cluster, pipeline_crd, operator, namespace):
    create_pipeline(
        cluster,
        namespace,
        "bad-regex",
        [
            {"kind": "guard", "rules": {"deny": [{"name": "broken", "pattern": "(unclosed"}]}},
            {"kind": "generate", "service": "chat"},
        ],
    )
    wait_for(
        lambda: (pipeline_condition(cluster, namespace, "bad-regex", "Valid") or {}).get("status") == "False",
        60,
        "Valid=False",
    )
    valid = pipeline_condition(cluster, namespace, "bad-regex", "Valid")
    assert valid["message"].startswith("spec.steps[0].rules.deny[0].pattern: is not a valid regular expression")


def test_the_schema_refuses_an_unknown_step_kind_naming_the_field(cluster, pipeline_crd, namespace):
    result = cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        check=False,
        input_text="""
apiVersion: serving.goodput.dev/v1alpha1
kind: InferencePipeline
metadata: {name: wrong}
spec:
  steps: [{kind: summarize, service: chat}]
""",
    )
    assert result.returncode != 0 and "summarize" in result.stderr
    assert "spec.steps[0].kind" in result.stderr or "spec.steps.kind" in result.stderr  # 1.20 leaves out the index
    explained = cluster.kubectl("explain", "inferencepipeline.spec.steps.rules.pii.type").stdout
    assert "Luhn" in explained
